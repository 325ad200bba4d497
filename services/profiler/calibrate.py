"""Link calibration: collective and point-to-point times from real spawned torch.distributed ranks.

Varuna §4.3 / Table 2 calibrates a few scale-invariant primitives once (activation/gradient send
time intra- and cross-node, allreduce time per ring size) and simulates every configuration from
them; this module measures those primitives on the local node for each requested group size,
fits ``t = latency + bytes / bandwidth`` per collective and group size (comm_fit), and measures the
compute slowdown while communication overlaps it (Galvatron-BMW §V: ~1.3x on GPUs).

Each group size is a fresh set of processes (start method "spawn", one intra-op thread each)
meeting at a TCP store this process serves on 127.0.0.1 with an OS-chosen port, so there is no
free-port race. Children report plain dicts over a queue. Every child is joined within a bounded
time and terminated (then killed) otherwise; any failure raises CalibrationError naming the group
size and what each rank was doing.

Run ``python -m services.profiler.calibrate --help`` for a table of fits on this machine.
"""

from __future__ import annotations

import argparse
import queue as queue_mod
import signal
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch

from ballast.v1 import profile_pb2
from services.profiler import comm_fit, comm_worker

KiB, MiB = 1024, 1024 * 1024
DEFAULT_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "all_to_all")
MIN_REPEATS = 5
REAP_S = 3.0  # grace for a child to exit after the result, and again after terminate()


class CalibrationError(RuntimeError):
    """A calibration run failed, timed out or lost a rank; the message says which and where."""


@dataclass(frozen=True)
class Measurement:
    """One (collective, group size, bytes): median over repeats per rank, max over ranks."""

    collective: str
    group_size: int
    bytes: int
    seconds: float
    api: str
    per_rank_s: tuple[float, ...]


@dataclass(frozen=True)
class Unsupported:
    """A collective the backend could not run here; recorded instead of a made-up time."""

    collective: str
    group_size: int
    reason: str


@dataclass(frozen=True)
class OverlapSample:
    """Compute time alone vs with ``allreduces_in_flight`` allreduces of ``bytes`` running (worst rank).

    On a CPU with fewer cores than busy threads (2 ranks x compute + gloo worker on 2 cores) the
    factor is dominated by core contention, not by link contention; it is still the slowdown the
    planner will see on that host, but not a property of the link.
    """

    group_size: int
    bytes: int
    compute_alone_s: float
    compute_concurrent_s: float
    allreduce_s: float
    allreduces_in_flight: int

    @property
    def raw_factor(self) -> float:
        return self.compute_concurrent_s / self.compute_alone_s

    @property
    def factor(self) -> float:
        """Slowdown >= 1 by definition; a measured value below 1 is noise and reads as 1."""
        return max(1.0, self.raw_factor)


@dataclass
class Calibration:
    """Everything one calibrate() call measured, plus the fits derived from it."""

    backend: str
    device: str
    software: str
    intra_op_threads: int
    measurements: list[Measurement] = field(default_factory=list)
    unsupported: list[Unsupported] = field(default_factory=list)
    overlaps: list[OverlapSample] = field(default_factory=list)
    fits: list[comm_fit.LinkFit] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def overlap_slowdown(self) -> float | None:
        """Worst factor over group sizes (conservative for the planner); None if not measured."""
        return max((o.factor for o in self.overlaps), default=None)

    def fit(self, collective: str, group_size: int) -> comm_fit.LinkFit | None:
        return next((f for f in self.fits if f.collective == collective and f.group_size == group_size), None)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["overlap_slowdown"] = self.overlap_slowdown
        return out


def calibrate(
    group_sizes: Sequence[int] = (2,),
    sizes_bytes: Sequence[int] = DEFAULT_SIZES,
    *,
    backend: str | None = None,
    repeats: int = 5,
    warmup: int = 2,
    timeout_s: float = 60.0,
    collectives: Sequence[str] = COLLECTIVES,
    overlap: bool = True,
) -> Calibration:
    """Measure p2p and ``collectives`` over ``sizes_bytes`` for each group size; fit; measure overlap.

    ``backend`` defaults to NCCL when CUDA has a device per rank, else gloo. ``sizes_bytes`` are
    per-rank input bytes of float32 buffers, rounded down to a multiple of ``4 * group_size`` so
    every collective splits evenly (measurements record the size actually sent). Point-to-point
    (rank 0 <-> 1) is measured once, with the smallest group. ``timeout_s`` bounds the whole call,
    all group sizes together, and is also each process group's collective timeout.
    """
    groups = sorted(set(group_sizes))
    sizes = sorted(set(int(s) for s in sizes_bytes))
    if not groups or groups[0] < 2:
        raise ValueError(f"group sizes must be >= 2, got {list(group_sizes)}")
    if not sizes or sizes[0] < 4:
        raise ValueError(f"sizes must be >= 4 bytes, got {list(sizes_bytes)}")
    if repeats < MIN_REPEATS or warmup < 0:
        raise ValueError(f"need repeats >= {MIN_REPEATS} and warmup >= 0, got {repeats}, {warmup}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    unknown = set(collectives) - set(COLLECTIVES)
    if unknown:
        raise ValueError(f"unknown collectives {sorted(unknown)}; expected some of {COLLECTIVES}")
    backend = backend or ("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= groups[-1] else "gloo")
    if backend == "nccl" and torch.cuda.device_count() < groups[-1]:
        raise ValueError(f"nccl needs one GPU per rank: {groups[-1]} ranks, {torch.cuda.device_count()} GPUs")
    device = torch.cuda.get_device_name(0) if backend == "nccl" else "cpu"
    cal = Calibration(backend=backend, device=device, software=f"torch {torch.__version__}", intra_op_threads=1)
    deadline = time.monotonic() + timeout_s
    for i, n in enumerate(groups):
        plan = {
            "backend": backend,
            "sizes_bytes": sizes,
            "repeats": repeats,
            "warmup": warmup,
            "collectives": list(collectives),
            "p2p": i == 0,
            "overlap": overlap,
            "timeout_s": max(1.0, deadline - time.monotonic()),
        }
        _collect(cal, n, _run_group(n, plan, deadline, timeout_s))
    rows = [(m.collective, m.group_size, m.bytes, m.seconds) for m in cal.measurements]
    cal.fits, notes = comm_fit.fit_series(rows)
    cal.notes.extend(notes)
    return cal


def _collect(cal: Calibration, n: int, results: dict[int, dict[str, Any]]) -> None:
    """Median over repeats per rank, then the slowest rank: a collective ends when its last rank does."""
    first = results[0]
    for collective, by_size in first["times"].items():
        for size in by_size:
            per_rank = tuple(
                statistics.median(r["times"][collective][size])
                for _, r in sorted(results.items())
                if size in r["times"].get(collective, {})
            )
            cal.measurements.append(
                Measurement(
                    collective,
                    2 if collective == "p2p" else n,
                    int(size),
                    max(per_rank),
                    first["apis"][collective],
                    per_rank,
                )
            )
    for collective, reason in first["unsupported"].items():
        cal.unsupported.append(Unsupported(collective, n, reason))
        cal.notes.append(f"{collective} n={n} unsupported on {cal.backend}: {reason}")
    if first["overlap"] is not None:
        overlaps = [r["overlap"] for r in results.values()]
        worst = max(overlaps, key=lambda o: o["compute_concurrent_s"] / o["compute_alone_s"])
        cal.overlaps.append(OverlapSample(group_size=n, **worst))


def _run_group(n: int, plan: dict[str, Any], deadline: float, timeout_s: float) -> dict[int, dict[str, Any]]:
    """Spawn ``n`` ranks, gather their results before ``deadline``, always reap them."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results: dict[int, dict[str, Any]] = {}
    stages: dict[int, str] = {}
    procs: list[Any] = []
    q = ctx.Queue()
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=max(1.0, timeout_s))
    )
    try:
        for rank in range(n):
            p = ctx.Process(
                target=comm_worker.run_rank,
                args=(rank, n, store.port, plan, q),
                name=f"ballast-calibrate-{n}-{rank}",
                daemon=True,
            )
            p.start()
            procs.append(p)
        gone_since: float | None = None
        while len(results) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _failure(n, plan, f"timed out after {timeout_s:g} s", procs, stages, results)
            try:
                msg = q.get(timeout=min(0.2, remaining))
            except queue_mod.Empty:
                msg = None
            if msg is None:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
                if not dead:
                    continue
                # An exited rank's last message may still be in the pipe: give it a moment.
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > 1.0:
                    raise _failure(n, plan, f"rank(s) {dead} exited without a result", procs, stages, results)
                continue
            rank = int(msg["rank"])
            if msg["kind"] == "stage":
                stages[rank] = msg["stage"]
            elif msg["kind"] == "error":
                stages[rank] = msg["stage"]
                time.sleep(0.2)  # let a peer's death (often the cause) show in exit codes
                raise _failure(n, plan, f"rank {rank} raised {msg['error']}", procs, stages, results)
            else:
                results[rank] = msg
        for p in procs:
            p.join(timeout=max(0.1, min(REAP_S, deadline - time.monotonic())))
        return results
    finally:
        _reap(procs)
        q.close()
        q.cancel_join_thread()
        del store


def _reap(procs: list[Any]) -> None:
    """Terminate, then kill, whatever is still alive; join each with a bound."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=REAP_S)
        if p.is_alive():
            p.kill()
            p.join(timeout=REAP_S)


def _failure(
    n: int, plan: dict[str, Any], what: str, procs: list[Any], stages: dict[int, str], results: dict[int, Any]
) -> CalibrationError:
    states = []
    for rank, p in enumerate(procs):
        where = stages.get(rank, "starting")
        if rank in results:
            states.append(f"rank {rank} finished")
        elif p.exitcode is None:
            states.append(f"rank {rank} still running in '{where}'")
        elif p.exitcode < 0:
            states.append(f"rank {rank} killed by {signal.Signals(-p.exitcode).name} in '{where}'")
        else:
            states.append(f"rank {rank} exited with code {p.exitcode} in '{where}'")
    return CalibrationError(
        f"link calibration of group size {n} ({plan['backend']}) failed: {what}; " + ", ".join(states)
    )


def to_proto(
    calibration: Calibration, scope: profile_pb2.LinkScope.ValueType = profile_pb2.LINK_SCOPE_INTRA_NODE
) -> profile_pb2.CommCalibration:
    """CommCalibration rows for the Profile; overlap_slowdown stays 0 (unset) when not measured."""
    out = profile_pb2.CommCalibration()
    for m in calibration.measurements:
        if m.collective == "p2p":
            out.links.add(scope=scope, bytes=m.bytes, seconds=m.seconds)
        else:
            out.collectives.add(
                collective=m.collective, group_size=m.group_size, scope=scope, bytes=m.bytes, seconds=m.seconds
            )
    if calibration.overlap_slowdown is not None:
        out.overlap_slowdown = calibration.overlap_slowdown
    for f in calibration.fits:
        out.fits.add(collective=f.collective, group_size=f.group_size, latency_s=f.latency_s,
                     bandwidth_bytes_per_s=f.bandwidth or 0.0, bus_bandwidth_bytes_per_s=f.bus_bandwidth or 0.0,
                     r2=f.r2)
    out.unsupported.extend(f"{u.collective}@{u.group_size}: {u.reason}" for u in calibration.unsupported)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Print measured fits for this host (used for the acceptance table; not a service entry point)."""
    ap = argparse.ArgumentParser(prog="python -m services.profiler.calibrate", description=main.__doc__)
    ap.add_argument("--group-sizes", type=int, nargs="+", default=[2])
    ap.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="per-rank bytes")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    cal = calibrate(args.group_sizes, args.sizes, backend=args.backend, repeats=args.repeats, timeout_s=args.timeout)
    print(f"{cal.backend} on {cal.device}, {cal.software}, {time.monotonic() - t0:.1f} s")
    head = ("collective", "n", "R2", "max rel err", "latency us", "algbw MB/s", "busbw MB/s")
    print(f"{head[0]:<15}{head[1]:>3}{head[2]:>9}" + "".join(f"{h:>12}" for h in head[3:]))
    for f in cal.fits:
        bw = f"{f.bandwidth / 1e6:12.1f}" if f.bandwidth else f"{'-':>12}"
        bus = f"{f.bus_bandwidth / 1e6:12.1f}" if f.bus_bandwidth else f"{'-':>12}"
        print(
            f"{f.collective:<15}{f.group_size:>3}{f.r2:9.4f}{f.max_rel_error:12.3f}{f.latency_s * 1e6:12.1f}{bw}{bus}"
            + (f"  {f.note}" if f.note else "")
        )
    for o in cal.overlaps:
        print(
            f"overlap n={o.group_size}: compute {o.compute_alone_s * 1e3:.2f} ms alone, "
            f"{o.compute_concurrent_s * 1e3:.2f} ms with {o.allreduces_in_flight} x {o.bytes} B allreduces "
            f"-> factor {o.raw_factor:.2f}"
        )
    for note in cal.notes:
        print("note:", note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
