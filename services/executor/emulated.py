"""Emulated workers (issue 43): the control plane at fleet scale, with no GPU behind it.

Everything above the worker is production code -- the agent, its Connect stream, its outbox, `Workers` and the
way it follows, stops, drains and repartitions a worker. Only the worker process is replaced, by an in-process
`EmulatedRank` that looks like one to `Workers` (a pid, stdin, stdout lines, wait / poll / signals) and reports
what a real worker reports, in the same JSON events: "started", one "iteration" per iteration at the plan's
predicted time (times a seeded noise), "checkpoint" with the per-layer files and rank 0's manifest written in the
real format (train/checkpoint.py), "plan_applied", "stopped" (drained or not), "done", "error".

The ranks of one job form a `Group` in this process, as a process group would: they advance in lockstep, agree on
a drain or a new plan at the same boundary, and when one rank dies or its host is lost the others fail with a
broken collective (an infrastructure error) after PEER_LOSS_S, as gloo's would. All of a job's ranks must
therefore run in one emulator process. One `Clock` thread fires every rank's iteration ends, so a thousand hosts
cost one timer thread rather than one each.
"""

from __future__ import annotations

import dataclasses
import heapq
import io
import itertools
import json
import logging
import queue
import random
import signal
import subprocess
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.executor.train import checkpoint as ckpt
from services.executor.train.config import WorkerConfig

log = logging.getLogger("ballast.emulated")
PEER_LOSS_S = 1.0  # a rank whose peer died fails this long after (gloo notices a closed socket about as fast)
STOPPED_EXIT = 143  # what a real worker exits with after a stop (train/worker.py)
_pids = itertools.count(1 << 22)  # above any real pid: logs can tell an emulated rank from a process


class Clock:
    """One timer thread for every emulated rank: callbacks run in due order, each outside the lock."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._wake = threading.Condition()
        threading.Thread(target=self._run, name="emulated-clock", daemon=True).start()

    def at(self, when: float, action: Callable[[], None]) -> None:
        with self._wake:
            heapq.heappush(self._heap, (when, next(self._seq), action))
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._wake.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                _, _, action = heapq.heappop(self._heap)
            try:
                action()
            except Exception:  # one rank's bug must not stop every other rank's clock
                log.exception("emulated rank action failed")


@dataclass
class Behaviour:
    """How the emulated workers deviate from the plan: a seeded noise on every iteration, and per host a
    slowdown (a straggler) set at run time."""

    noise: float = 0.02  # relative standard deviation of an iteration's time around the prediction
    seed: int = 0
    slow: dict[str, float] = field(default_factory=dict)  # host name -> iteration time factor

    def factor(self, rng: random.Random, hosts: Sequence[str]) -> float:
        """An iteration lasts as long as its slowest rank: the largest host slowdown, times the noise."""
        return max((self.slow.get(h, 1.0) for h in hosts), default=1.0) * max(0.1, rng.gauss(1.0, self.noise))


class _Stdin:
    """What `Workers` writes commands to: JSON lines, parsed and handed to the rank."""

    def __init__(self, rank: EmulatedRank) -> None:
        self._rank, self.closed = rank, False

    def write(self, line: str) -> int:
        if self.closed or self._rank.returncode is not None:
            raise BrokenPipeError("the emulated worker has exited")
        for text in line.splitlines():
            if text.strip():
                self._rank.command(json.loads(text))
        return len(line)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class _Stdout:
    """The rank's report lines, read by `Workers._follow` until the rank exits."""

    _END = object()

    def __init__(self) -> None:
        self._lines: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def put(self, line: str) -> None:
        self._lines.put(line)

    def end(self) -> None:
        self._lines.put(self._END)

    def __iter__(self) -> Iterator[str]:
        while (line := self._lines.get()) is not self._END:
            yield line


class EmulatedRank:
    """One worker as `Workers` sees a process (the subprocess.Popen surface it uses)."""

    def __init__(self, config: WorkerConfig, host: str, group: Group) -> None:
        self.config, self.host, self.group = config, host, group
        self.pid = next(_pids)
        self.stdin, self.stdout = _Stdin(self), _Stdout()
        self.returncode: int | None = None
        self._exited = threading.Event()
        self.head = {"job_id": config.job_id, "rank": config.rank, "stage": config.stage_index,
                     "replica": config.replica_index}

    # -- the Popen surface ------------------------------------------------------------------------------------
    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"emulated rank {self.config.rank}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        """SIGTERM stops at the next boundary, SIGUSR2 drains there, SIGKILL ends it now (its peers fail)."""
        if self.returncode is not None:
            return
        if sig == signal.SIGKILL:
            self.exit(-signal.SIGKILL)
            self.group.lost(self)
        elif sig == signal.SIGUSR2:
            self.group.asked("drain")
        elif sig in (signal.SIGTERM, signal.SIGINT):
            self.group.asked("stop")

    # -- what the emulated worker does -------------------------------------------------------------------------
    def report(self, event: dict[str, Any]) -> None:
        if self.returncode is None:
            self.stdout.put(json.dumps({**event, **self.head, "time": time.time()}) + "\n")

    def command(self, command: dict[str, Any]) -> None:
        if command.get("command") == "plan":
            self.group.plan(command)
        # a hold is taken as a no-op: emulated ranks have no store writes to hold back

    def exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self.stdout.end()
            self._exited.set()


class Group:
    """The ranks of one job start (one incarnation): lockstep iterations at the predicted time."""

    def __init__(self, clock: Clock, behaviour: Behaviour, first: WorkerConfig) -> None:
        self.clock, self.behaviour, self.first = clock, behaviour, first
        self.ranks: dict[int, EmulatedRank] = {}
        self.done = first.start_iteration
        self.version = first.plan_version
        self.bounds = [list(b) for b in first.stage_bounds]
        self.asks: set[str] = set()
        self.plans: list[dict[str, Any]] = []
        self.over = False
        self.lock = threading.Lock()
        self.rng = random.Random(zlib.crc32(f"{behaviour.seed}/{first.job_id}/{first.init_method}".encode()))

    def join(self, rank: EmulatedRank) -> None:
        with self.lock:
            self.ranks[rank.config.rank] = rank
            ready = len(self.ranks) == rank.config.world_size
        layers = list(range(*self.bounds[rank.config.stage_index]))
        rank.report({"event": "started", "world_size": rank.config.world_size, "num_stages": len(self.bounds),
                     "num_replicas": rank.config.num_replicas, "layers": layers, "parameters": 0,
                     "start_iteration": self.done, "iterations": rank.config.iterations,
                     "schedule": rank.config.schedule, "global_batch_size": rank.config.global_batch_size,
                     "plan_version": self.version, "predicted_iteration_s": rank.config.predicted_iteration_s,
                     "device": "emulated", "pid": rank.pid, "hybrid": {}})
        if ready:
            self._next()
        elif len(self.ranks) == 1:  # as a real rendezvous does, give up on ranks that never come
            self.clock.at(time.monotonic() + rank.config.timeout_s, self._rendezvous_timeout)

    def _rendezvous_timeout(self) -> None:
        with self.lock:
            if self.over or len(self.ranks) == self.first.world_size:
                return
            self.over = True
        self._fail(f"emulated rendezvous timed out with {len(self.ranks)} of {self.first.world_size} ranks")

    def _fail(self, why: str) -> None:
        """Every live rank reports `why` as a broken collective (an infrastructure error) and exits 1."""
        for rank in self._alive():
            rank.report({"event": "error", "message": f"RuntimeError: {why}", "infrastructure": True,
                         "traceback": ""})
            rank.exit(1)

    def asked(self, what: str) -> None:
        with self.lock:
            self.asks.add(what)

    def plan(self, command: dict[str, Any]) -> None:
        with self.lock:
            self.plans.append(command)

    def lost(self, rank: EmulatedRank) -> None:
        """A rank died without a word (killed, its host lost): the rest fail as a broken collective would."""
        with self.lock:
            if self.over:
                return
            self.over = True

        why = f"emulated peer rank {rank.config.rank} is gone (connection closed)"
        self.clock.at(time.monotonic() + PEER_LOSS_S, lambda: self._fail(why))

    def _alive(self) -> list[EmulatedRank]:
        return [r for r in self.ranks.values() if r.returncode is None]

    def _next(self) -> None:
        predicted = self.first.predicted_iteration_s or 0.1
        took = predicted * self.behaviour.factor(self.rng, [r.host for r in self.ranks.values()])
        began = time.monotonic()
        self.clock.at(began + took, lambda: self._ended(took))

    def _ended(self, took: float) -> None:
        with self.lock:
            if self.over:
                return
            asks, self.asks = set(self.asks), set()
            ready = [p for p in self.plans if int(p.get("not_before", 0)) <= self.done + 1]
            self.plans = [p for p in self.plans if p not in ready]
        self.done += 1
        config = self.first
        for rank in self._alive():
            c = rank.config
            rank.report({"event": "iteration", "iteration": self.done, "plan_version": self.version,
                         "iteration_s": took, "forward_s": took / 3, "backward_s": 2 * took / 3,
                         "samples_per_s": c.global_batch_size / took,
                         "layers": list(range(*self.bounds[c.stage_index])),
                         "has_loss": c.stage_index == len(self.bounds) - 1, "loss": 1.0})
        for command in ready:  # the new plan from this boundary on, as every rank agreed
            self.version = max(self.version, int(command.get("version", self.version)))
            self.bounds = [list(b) for b in command.get("stage_bounds", self.bounds)]
            for rank in self._alive():
                rank.report({"event": "plan_applied", "plan_version": self.version, "iteration": self.done})
        last = self.done >= config.iterations
        drain = "drain" in asks and not last
        saved = (bool(config.checkpoint_every) and self.done % config.checkpoint_every == 0) or drain or (
            config.final_checkpoint and last)
        if saved and config.checkpoint_dir:
            self._save()
        if last:
            self._end(0, {"event": "done", "iteration": config.iterations, "parameters": 0})
        elif drain or "stop" in asks:
            self._end(STOPPED_EXIT, {"event": "stopped", "iteration": self.done, "drained": drain,
                                     "message": "drained" if drain else "stopped"})
        else:
            self._next()

    def _end(self, code: int, event: dict[str, Any]) -> None:
        with self.lock:
            self.over = True
        for rank in self._alive():
            rank.report(event)
            rank.exit(code)

    def _save(self) -> None:
        """Every rank's layers as files (a placeholder tensor each: the format, not the weights), then rank 0's
        manifest, each rank's report carrying its layers and rank 0's every layer, as a real worker's does."""
        directory = ckpt.checkpoint_path(self.first.checkpoint_dir, self.done)
        keys = ("layer_index", "uri", "bytes", "sha256")
        meta = {"iterations_done": self.done, "next_iteration": self.done, "seed": self.first.seed,
                "plan_version": self.version, "job_id": self.first.job_id, "model": self.first.model,
                "optimizer": self.first.optimizer.get("name", "adam"), "data": self.first.data,
                "global_batch_size": self.first.global_batch_size,
                "samples_seen": self.done * self.first.global_batch_size, "epoch": 0}
        reports = {}
        for rank in self._alive():
            c = rank.config
            begin, end = self.bounds[c.stage_index]
            mine = {i: (f"layer.{i}", {"emulated": torch.zeros(1)}) for i in range(begin, end)
                    if (i - begin) % c.num_replicas == c.replica_index}
            entries = ckpt.write_snapshot(directory, mine)
            reports[c.rank] = [{k: e[k] for k in keys} for e in entries]
        num_layers = self.bounds[-1][1]
        manifest = ckpt.write_manifest(directory, num_layers, meta)
        every = [{k: e[k] for k in keys} for e in json.loads(manifest.read_text())["layers"].values()]
        for rank in self._alive():
            event = {"event": "checkpoint", "iteration": self.done, "plan_version": self.version,
                     "dir": str(directory), "manifest": "", "checkpoint_s": 0.0, "write_s": 0.0,
                     "background": False, "layers": reports[rank.config.rank]}
            if rank.config.rank == 0:
                event.update(manifest=manifest.resolve().as_uri(), every_layer=every)
            rank.report(event)


class Emulator:
    """The emulated workers of one process: a clock, the behaviour, and each running job start's group."""

    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        self.clock = Clock()
        self._groups: dict[tuple[str, str, int], Group] = {}
        self._ranks: dict[str, list[EmulatedRank]] = {}  # host name -> its ranks
        self._lock = threading.Lock()

    def launcher(self, host: str) -> Callable[[Sequence[str], dict[str, str]], tuple[EmulatedRank, io.BytesIO]]:
        """What `Workers` on host `host` starts a worker with: argv's last item is the rank's config file."""

        def launch(argv: Sequence[str], env: dict[str, str]) -> tuple[EmulatedRank, io.BytesIO]:
            config = WorkerConfig.from_json(Path(argv[-1]).read_text())
            if config.resume_from:  # the position a real worker would resume from
                resumed = int(ckpt.read_manifest(config.resume_from).get("next_iteration", 0))
                config = dataclasses.replace(config, start_iteration=resumed)
            key = (config.job_id, config.init_method, config.plan_version)
            with self._lock:
                self._groups = {k: g for k, g in self._groups.items() if not g.over}
                group = self._groups.setdefault(key, Group(self.clock, self.behaviour, config))
                rank = EmulatedRank(config, host, group)
                self._ranks.setdefault(host, []).append(rank)
                self._ranks[host] = [r for r in self._ranks[host] if r.returncode is None]
            group.join(rank)
            return rank, io.BytesIO()

        return launch

    def lose_host(self, host: str) -> int:
        """Its ranks vanish without a word (the host is gone): their peers elsewhere fail. Returns how many."""
        with self._lock:
            ranks = [r for r in self._ranks.pop(host, []) if r.returncode is None]
        for rank in ranks:
            rank.exit(-signal.SIGKILL)
            rank.group.lost(rank)
        return len(ranks)

    def kill_rank(self, job_id: str, rank: int) -> bool:
        """One worker dies (its process is killed); False if no live rank matches."""
        with self._lock:
            found = [r for ranks in self._ranks.values() for r in ranks
                     if r.config.job_id == job_id and r.config.rank == rank and r.returncode is None]
        for r in found:
            r.kill()
        return bool(found)
