"""Code that runs inside each spawned calibration rank.

Kept apart from the parent-side orchestration so a spawned child imports only torch and this
module. Everything sent back to the parent is a plain dict of str/int/float/list built here, so
the queue never carries user objects. Messages: ``{"kind": "stage"}`` at each step (the parent
names the step a hung or dead rank was in), then one ``{"kind": "result"}`` or ``{"kind": "error"}``.
"""

from __future__ import annotations

import math
import statistics
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Preferred torch API first; later names are fallbacks for builds/backends lacking the former.
# *_single are the torch 2.13 names; *_into_tensor / *_tensor warn as deprecated there.
CANDIDATES = {
    "allreduce": ("all_reduce",),
    "allgather": ("all_gather_single", "all_gather_into_tensor", "all_gather"),
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter"),
    "all_to_all": ("all_to_all_single", "all_to_all"),
}
UNSUPPORTED = (RuntimeError, NotImplementedError, ValueError, TypeError, AttributeError)


class _Rank:
    """One rank's view: device, sync, and how to run each collective on it."""

    def __init__(self, rank: int, world: int, backend: str, queue: Any) -> None:
        self.rank, self.world, self.backend, self.queue = rank, world, backend, queue
        self.cuda = backend == "nccl"
        self.device = torch.device("cuda", rank % torch.cuda.device_count()) if self.cuda else torch.device("cpu")
        self.stage_name = "start"

    def stage(self, what: str) -> None:
        self.stage_name = what
        self.queue.put({"kind": "stage", "rank": self.rank, "stage": what})

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        if self.cuda:
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()
        self.sync()

    def timed(self, op: Callable[[], object], repeats: int, warmup: int) -> list[float]:
        """Seconds per call: warm-up, then each repeat starts from a barrier so rank skew is excluded."""
        for _ in range(warmup):
            op()
        self.sync()
        out = []
        for _ in range(repeats):
            self.barrier()
            t0 = time.perf_counter()
            op()
            self.sync()
            out.append(time.perf_counter() - t0)
        return out

    def op(self, collective: str, api: str, numel: int) -> Callable[[], object]:
        """A closure running one call of ``api`` on fresh buffers of ``numel`` float32 per rank."""
        n, dev = self.world, self.device
        x = torch.ones(numel, dtype=torch.float32, device=dev)
        if collective == "allreduce":
            return lambda: dist.all_reduce(x)
        if collective == "allgather":
            if api == "all_gather":
                outs = [torch.empty_like(x) for _ in range(n)]
                return lambda: dist.all_gather(outs, x)
            out = torch.empty(numel * n, dtype=x.dtype, device=dev)
            fn = getattr(dist, api)
            return lambda: fn(out, x)
        if collective == "reduce_scatter":
            out = torch.empty(numel // n, dtype=x.dtype, device=dev)
            if api == "reduce_scatter":
                ins = list(x.chunk(n))
                return lambda: dist.reduce_scatter(out, ins)
            fn = getattr(dist, api)
            return lambda: fn(out, x)
        if collective == "all_to_all":
            if api == "all_to_all":
                ins, outs = list(x.chunk(n)), [torch.empty(numel // n, dtype=x.dtype, device=dev) for _ in range(n)]
                return lambda: dist.all_to_all(outs, ins)
            out = torch.empty_like(x)
            return lambda: dist.all_to_all_single(out, x)
        raise ValueError(f"unknown collective {collective!r}")

    def p2p(self, numel: int) -> Callable[[], object]:
        """Round trip 0 -> 1 -> 0; other ranks idle. Halved by the caller for one-way time."""
        x = torch.ones(numel, dtype=torch.float32, device=self.device)
        if self.rank == 0:
            return lambda: (dist.send(x, 1), dist.recv(x, 1))
        if self.rank == 1:
            return lambda: (dist.recv(x, 0), dist.send(x, 0))
        return lambda: None

    def probe(self, collective: str, numel: int) -> tuple[str | None, str]:
        """First API in CANDIDATES that runs here, or (None, why none did).

        Every rank runs the same torch build, so an API missing on one is missing on all and
        the ranks stay in step; a barrier re-aligns them after a failed try.
        """
        reasons = []
        for api in CANDIDATES[collective]:
            if not hasattr(dist, api):
                reasons.append(f"{api}: absent in torch {torch.__version__}")
                continue
            try:
                self.op(collective, api, numel)()
                self.sync()
                return api, ""
            except UNSUPPORTED as exc:
                reasons.append(f"{api}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                self.barrier()
        return None, f"{self.backend}: " + "; ".join(reasons)

    def compute_kernel(self) -> Callable[[], None]:
        """Fixed matmul loop: small on CPU (one intra-op thread), big enough to fill a GPU."""
        side, iters = (4096, 20) if self.cuda else (256, 40)
        a = torch.randn(side, side, device=self.device)
        b = torch.randn(side, side, device=self.device)

        def run() -> None:
            c = a
            for _ in range(iters):
                c = torch.mm(a, b)
            del c

        return run

    def compute_time(self, run: Callable[[], None]) -> float:
        """Compute-only time: CUDA events on the compute stream, so in-flight NCCL work is not waited on."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        t0 = time.perf_counter()
        run()
        return time.perf_counter() - t0

    def overlap(self, numel: int, repeats: int, warmup: int) -> dict[str, float]:
        """Compute time alone vs with allreduces in flight (Galvatron-BMW §V's overlap slowdown).

        The allreduces are issued async_op=True before the compute starts: gloo runs them on its
        own worker threads, NCCL on its own stream, so they contend with the compute for cores /
        SMs exactly as overlapped gradient sync would. Every rank issues the same count ``k``
        (agreed by a MAX allreduce), enough to outlast the compute.
        """
        run = self.compute_kernel()
        for _ in range(warmup):
            run()
        self.sync()
        alone = []
        for _ in range(repeats):
            self.barrier()
            alone.append(self.compute_time(run))
        buf = torch.ones(numel, dtype=torch.float32, device=self.device)
        comm = statistics.median(self.timed(lambda: dist.all_reduce(buf), repeats, 1))
        k_local = min(10_000, max(2, math.ceil(1.5 * statistics.median(alone) / max(comm, 1e-9)) + 1))
        k = torch.tensor([k_local], dtype=torch.int64, device=self.device)
        dist.all_reduce(k, op=dist.ReduceOp.MAX)
        k_all = int(k.item())
        concurrent = []
        for _ in range(repeats):
            self.barrier()
            works = [dist.all_reduce(buf, async_op=True) for _ in range(k_all)]
            concurrent.append(self.compute_time(run))
            for work in works:
                work.wait()
            self.sync()
        return {
            "compute_alone_s": statistics.median(alone),
            "compute_concurrent_s": statistics.median(concurrent),
            "allreduce_s": comm,
            "allreduces_in_flight": k_all,
            "bytes": numel * 4,
        }


def run_rank(rank: int, world: int, port: int, plan: dict[str, Any], queue: Any) -> None:
    """Spawn target: rendezvous, measure ``plan``, put one result or error dict on ``queue``."""
    me = _Rank(rank, world, plan["backend"], queue)
    try:
        torch.set_num_threads(1)
        me.stage("rendezvous")
        timeout = timedelta(seconds=plan["timeout_s"])
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        if me.cuda:
            torch.cuda.set_device(me.device)
        dist.init_process_group(plan["backend"], store=store, rank=rank, world_size=world, timeout=timeout)
        queue.put({"kind": "result", "rank": rank, **_measure(me, plan)})
    except BaseException as exc:  # noqa: BLE001 - report anything, including KeyboardInterrupt, then exit
        queue.put(
            {
                "kind": "error",
                "rank": rank,
                "stage": me.stage_name,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=6),
            }
        )
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - already failing or exiting; the parent reaps us
                pass


def _measure(me: _Rank, plan: dict[str, Any]) -> dict[str, Any]:
    repeats, warmup, world = plan["repeats"], plan["warmup"], me.world
    numels = [max(world, (b // 4) // world * world) for b in plan["sizes_bytes"]]
    times: dict[str, dict[str, list[float]]] = {}
    apis: dict[str, str] = {}
    unsupported: dict[str, str] = {}
    if plan["p2p"]:
        times["p2p"] = {}
        for numel in numels:
            me.stage(f"p2p {numel * 4} B")
            rtts = me.timed(me.p2p(numel), repeats, warmup)
            if me.rank < 2:
                times["p2p"][str(numel * 4)] = [t / 2.0 for t in rtts]
        apis["p2p"] = "send/recv round trip / 2"
    for collective in plan["collectives"]:
        me.stage(f"{collective} probe")
        api, why = me.probe(collective, numels[0])
        if api is None:
            unsupported[collective] = why
            continue
        apis[collective] = api
        times[collective] = {}
        for numel in numels:
            me.stage(f"{collective} {numel * 4} B via {api}")
            times[collective][str(numel * 4)] = me.timed(me.op(collective, api, numel), repeats, warmup)
    overlap = None
    if plan["overlap"]:
        me.stage("overlap")
        overlap = me.overlap(numels[-1], repeats, warmup)
    me.stage("done")
    return {"times": times, "apis": apis, "unsupported": unsupported, "overlap": overlap}
