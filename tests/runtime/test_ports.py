"""Ports for loopback servers: below the ephemeral range, never the same twice, never one already bound."""

from __future__ import annotations

import socket

from services.runtime import ports


def test_ports_are_distinct_and_below_the_ephemeral_range():
    given = [ports.free_port() for _ in range(300)]
    assert len(set(given)) == len(given)
    assert all(ports.FLOOR <= p < ports.ephemeral_low() and p not in ports.TORCH_RANGE for p in given)


def test_a_block_is_consecutive_and_none_of_it_is_given_again():
    first = ports.free_port(block=8)
    block = set(range(first, first + 8))
    assert first + 8 <= ports.ephemeral_low()
    assert not block & {ports.free_port() for _ in range(300)}


def test_a_port_someone_holds_is_passed_over(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "ephemeral_low", lambda: 65_000)  # so the held port is in the chosen range
        free = next(p for p in range(23_000, 24_000) if ports._bindable("127.0.0.1", p))
        picks = iter([taken, taken, free])
        monkeypatch.setattr(ports, "_rng", type("Picks", (), {"randrange": lambda self, lo, hi: next(picks)})())
        monkeypatch.setattr(ports, "_given", set())
        assert ports.free_port() == free


def test_the_range_falls_back_to_linux_default_when_unreadable(monkeypatch, tmp_path):
    monkeypatch.setattr(ports, "RANGE_FILE", tmp_path / "absent")
    assert ports.ephemeral_low() == 32_768
    (tmp_path / "range").write_text("40000\t60999\n")
    monkeypatch.setattr(ports, "RANGE_FILE", tmp_path / "range")
    assert ports.ephemeral_low() == 40_000
