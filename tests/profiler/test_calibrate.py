"""Link calibration: the pure latency + bandwidth fit, a real 2-rank gloo run, and its failure paths."""

from __future__ import annotations

import math
import multiprocessing
import os
import random
import signal
import threading
import time

import pytest

from ballast.v1 import profile_pb2
from services.profiler import calibrate as cal_mod
from services.profiler.calibrate import (
    Calibration,
    CalibrationError,
    Measurement,
    OverlapSample,
    Unsupported,
    calibrate,
    to_proto,
)
from services.profiler.comm_fit import bus_factor, fit, fit_series, least_squares

KiB, MiB = 1024, 1024 * 1024


def _ours() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("ballast-calibrate")]


# --- pure fit -------------------------------------------------------------------------------


def test_fit_recovers_exact_line() -> None:
    sizes = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]
    latency, bw = 50e-6, 2e9
    f = fit("allreduce", 4, sizes, [latency + s / bw for s in sizes])
    assert f.ok and f.note == ""
    assert f.latency_s == pytest.approx(latency, rel=1e-9)
    assert f.bandwidth == pytest.approx(bw, rel=1e-9)
    assert f.bus_bandwidth == pytest.approx(bw * 2 * 3 / 4, rel=1e-9)
    assert f.r2 == pytest.approx(1.0, abs=1e-12)
    assert f.max_rel_error < 1e-9
    assert f.predict(8 * MiB) == pytest.approx(latency + 8 * MiB / bw)
    assert f.to_dict()["r2"] == f.r2


def test_fit_on_noisy_data_has_r2_below_one() -> None:
    rng = random.Random(7)
    sizes = [s * KiB for s in (64, 128, 256, 512, 1024, 2048, 4096)]
    times = [100e-6 + s / 1e9 * (1 + rng.uniform(-0.3, 0.3)) for s in sizes]
    f = fit("allgather", 2, sizes, times)
    assert 0.5 < f.r2 < 1.0
    assert f.bandwidth is not None and 0.5e9 < f.bandwidth < 2e9


@pytest.mark.parametrize(
    ("sizes", "times", "match"),
    [
        ([1024], [1e-3], "at least 2 points"),
        ([1024, 1024, 1024], [1e-3, 2e-3, 3e-3], "distinct sizes"),
        ([1024, 2048], [1e-3], "2 sizes but 1 times"),
        ([1024, 2048], [1e-3, math.nan], "finite"),
        ([1024, 2048], [1e-3, 0.0], "positive"),
        ([-1, 2048], [1e-3, 2e-3], "non-negative"),
    ],
)
def test_fit_rejects_degenerate_input(sizes: list[int], times: list[float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fit("p2p", 2, sizes, times)


def test_non_positive_slope_is_noted_not_faked() -> None:
    f = fit("allreduce", 2, [1024, 2048, 4096], [3e-3, 2e-3, 1e-3])
    assert not f.ok and f.bandwidth is None and f.bus_bandwidth is None
    assert "non-positive slope" in f.note


def test_bus_factors_and_series() -> None:
    assert bus_factor("p2p", 2) == 1.0
    assert bus_factor("allreduce", 2) == 1.0
    assert bus_factor("allgather", 4) == 3.0
    assert bus_factor("reduce_scatter", 4) == 0.75
    with pytest.raises(ValueError):
        bus_factor("broadcast", 2)
    with pytest.raises(ValueError):
        bus_factor("allreduce", 1)
    assert least_squares([0, 1, 2], [1, 1, 1]) == (1.0, 0.0, 1.0)
    fits, notes = fit_series([("allreduce", 2, 1024, 1e-3), ("allreduce", 2, 2048, 2e-3), ("p2p", 2, 1024, 1e-4)])
    assert [(f.collective, f.group_size) for f in fits] == [("allreduce", 2)]
    assert notes == ["p2p n=2: one distinct size, no fit"]


def test_to_proto_from_synthetic_calibration() -> None:
    cal = Calibration(backend="gloo", device="cpu", software="torch", intra_op_threads=1)
    cal.measurements += [
        Measurement("p2p", 2, 4096, 1e-4, "send/recv", (1e-4, 9e-5)),
        Measurement("allreduce", 3, 4096, 2e-4, "all_reduce", (2e-4, 1e-4, 1e-4)),
    ]
    cal.unsupported.append(Unsupported("all_to_all", 3, "gloo: no"))
    assert to_proto(cal).overlap_slowdown == 0.0  # not measured: left unset
    cal.overlaps.append(OverlapSample(3, 4096, 0.010, 0.009, 1e-3, 4))  # faster under overlap: noise
    assert cal.overlap_slowdown == 1.0
    msg = to_proto(cal, scope=profile_pb2.LINK_SCOPE_INTER_NODE)
    assert [(link.scope, link.bytes, link.seconds) for link in msg.links] == [
        (profile_pb2.LINK_SCOPE_INTER_NODE, 4096, 1e-4)
    ]
    (row,) = msg.collectives
    assert (row.collective, row.group_size, row.bytes, row.seconds) == ("allreduce", 3, 4096, 2e-4)
    assert msg.overlap_slowdown == 1.0


def test_calibrate_validates_arguments() -> None:
    with pytest.raises(ValueError, match="group sizes"):
        calibrate([1])
    with pytest.raises(ValueError, match="repeats"):
        calibrate([2], repeats=2)
    with pytest.raises(ValueError, match="timeout"):
        calibrate([2], timeout_s=0)
    with pytest.raises(ValueError, match="unknown collectives"):
        calibrate([2], collectives=["broadcast"])


# --- real spawned ranks ---------------------------------------------------------------------

SIZES = [4 * KiB, 64 * KiB, 256 * KiB, 1 * MiB]


@pytest.fixture(scope="module")
def real() -> tuple[Calibration, float]:
    t0 = time.monotonic()
    cal = calibrate([2], SIZES, backend="gloo", repeats=5, warmup=2, timeout_s=60)
    return cal, time.monotonic() - t0


@pytest.mark.slow
def test_two_rank_gloo_calibration(real: tuple[Calibration, float]) -> None:
    cal, elapsed = real
    assert elapsed < 45
    assert cal.backend == "gloo" and cal.intra_op_threads == 1
    measured = {m.collective for m in cal.measurements}
    skipped = {u.collective for u in cal.unsupported}
    assert {"p2p", "allreduce", "allgather"} <= measured
    assert measured | skipped == {"p2p", "allreduce", "allgather", "reduce_scatter", "all_to_all"}
    for m in cal.measurements:
        assert m.seconds > 0 and m.seconds == max(m.per_rank_s) and len(m.per_rank_s) == 2
        assert m.bytes in SIZES and m.group_size == 2
    for collective in measured:
        f = cal.fit(collective, 2)
        assert f is not None and f.points == len(SIZES)
        assert not math.isnan(f.r2) and f.r2 <= 1.0  # reported, not asserted high: 2-core noise
    (ov,) = cal.overlaps
    assert ov.compute_alone_s > 0 and ov.compute_concurrent_s > 0 and ov.allreduces_in_flight >= 2
    assert cal.overlap_slowdown is not None and cal.overlap_slowdown >= 1.0
    msg = to_proto(cal)
    assert len(msg.links) == len(SIZES) and all(link.scope == profile_pb2.LINK_SCOPE_INTRA_NODE for link in msg.links)
    assert len(msg.collectives) == len(cal.measurements) - len(SIZES)
    assert msg.overlap_slowdown == cal.overlap_slowdown
    assert not _ours()


@pytest.mark.slow
def test_impossible_timeout_raises_and_reaps() -> None:
    t0 = time.monotonic()
    with pytest.raises(CalibrationError, match=r"group size 2 \(gloo\) failed: timed out after 0.3 s"):
        calibrate([2], SIZES, backend="gloo", timeout_s=0.3)
    assert time.monotonic() - t0 < 0.3 + 2 * cal_mod.REAP_S + 2
    assert not _ours()


@pytest.mark.slow
def test_killed_rank_raises_and_reaps() -> None:
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            calibrate([2], [1 * MiB, 4 * MiB], backend="gloo", repeats=20, timeout_s=60)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while len(children := _ours()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(children) == 2
    pids = [p.pid for p in children]
    victim = next(p for p in children if p.name.endswith("-1"))
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(timeout=30)
    assert not thread.is_alive()
    (exc,) = outcome
    assert isinstance(exc, CalibrationError)
    assert "rank 1 killed by SIGKILL" in str(exc)
    assert not _ours()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
