"""A second plane on one machine (issue 41, item 9): `ballast up` checks every port it will listen on before it
starts anything, and says which is taken and how to move the plane."""

from __future__ import annotations

import socket
from pathlib import Path

from ballast.cli.control_plane import EmulatedFleet, State, bring_up, plane_ports
from tests.harness import free_port, make_settings


def test_a_taken_port_is_named_before_anything_starts(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "second")
    with socket.socket() as other_plane:
        other_plane.bind(("127.0.0.1", settings.planner_port))
        other_plane.listen()
        ok, rows, message = bring_up(settings, executors=2, timeout_s=30)
    assert not ok and rows == []
    assert f"{settings.planner_port} (planner_port)" in message and "ballast.toml" in message
    assert "BALLAST_PLANNER_PORT" in message
    assert State.load(settings) is None  # no child, no state file
    assert not settings.token_file.exists() and not (settings.data_dir / "tls").exists()


def test_the_ports_checked_are_every_one_the_plane_listens_on(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "p", store_metrics_port=free_port())
    checked = dict(plane_ports(settings, executors=2))
    assert checked["store_port"] == settings.store_port and checked["store_metrics_port"] == settings.store_metrics_port
    assert checked["executor_port + 1"] == settings.executor_port + 1
    assert {"store_read_port", "profiler_port", "planner_agent_port", "dashboard_port"} <= set(checked)


def test_more_agents_than_the_planner_holds_streams_for_are_refused_before_anything_starts(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "many", planner_agent_streams=10)
    ok, rows, message = bring_up(settings, executors=2, timeout_s=30, emulated=EmulatedFleet(hosts=9))
    assert not ok and rows == [] and State.load(settings) is None
    assert "11 agents" in message and "planner_agent_streams = 10" in message
    assert "BALLAST_PLANNER_AGENT_STREAMS" in message


def test_emulated_hosts_start_as_serve_executor_emulate_processes_of_1024_hosts_each() -> None:
    from ballast.cli.main import build_parser

    fleet = EmulatedFleet(hosts=4, devices_per_host=2, device_kind="nvidia-a100-80gb")
    [(name, args)] = fleet.processes()
    assert name == "emulated-hosts-0" and args == ["serve", "executor", "--emulate", "4", "--first-host", "0",
                                                   "--devices-per-host", "2", "--device-kind", "nvidia-a100-80gb"]
    parsed = build_parser().parse_args(args)
    assert (parsed.emulate, parsed.first_host, parsed.devices_per_host, parsed.device_kind) == (
        4, 0, 2, "nvidia-a100-80gb")
    big = [(name, build_parser().parse_args(args)) for name, args in EmulatedFleet(hosts=2500).processes()]
    assert [(name, p.emulate, p.first_host) for name, p in big] == [
        ("emulated-hosts-0", 1024, 0), ("emulated-hosts-1", 1024, 1024), ("emulated-hosts-2", 452, 2048)]
