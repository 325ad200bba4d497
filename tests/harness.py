"""Real servers on loopback ports for tests: the store, profiler and planner in-process (real gRPC),
Celery workers and the CLI as real subprocesses."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from ballast.cli.control_plane import ensure_token
from ballast.client import Client, open_channel
from ballast.config import Settings, load_settings
from ballast.transport import agent_transport, client_transport
from ballast.v1 import executor_pb2_grpc
from services.runtime.ports import free_port
from services.runtime.server import Server
from services.runtime.store_client import RemoteStore
from services.store import schema
from services.store.db import create_engine

ROOT = Path(__file__).resolve().parents[1]


def proto_rpcs() -> dict[str, object]:
    """'Service/Method' -> MethodDescriptor for every RPC of every ballast.v1 module."""
    import importlib
    import pkgutil

    import ballast.v1

    found = {}
    for info in pkgutil.iter_modules(ballast.v1.__path__):
        if info.name.endswith("_pb2"):
            module = importlib.import_module(f"ballast.v1.{info.name}")
            for service in module.DESCRIPTOR.services_by_name.values():
                for method in service.methods:
                    found[f"{service.full_name}/{method.name}"] = method
    return found



AGENT_PORTS = 8  # the most executor agents one test plane starts


def make_settings(data_dir: Path, **overrides: object) -> Settings:
    ports = {f"{name}_port": free_port()
             for name in ("store", "store_read", "profiler", "planner", "planner_agent", "dashboard")}
    ports["executor_port"] = free_port(block=AGENT_PORTS)  # agent i serves on executor_port + i
    # metrics endpoints stay off unless a test asks (tests/plane/test_metrics.py): many planes share this process
    ports.update({f"{name}_metrics_port": 0 for name in ("store", "profiler", "planner", "worker", "executor")})
    env = {k: v for k, v in os.environ.items() if not k.startswith("BALLAST_")}
    # a plane's first job is not held for a calibration on arrival unless the test is about it (test_arrival.py);
    # its metrics are a row per iteration, which most tests read, unless the test is about windows (metrics_window_s)
    return load_settings(env, data_dir=data_dir, **{**ports, "calibrate_on_arrival": False, "metrics_window_s": 0.0,
                                                    **overrides})


def in_process_cli(settings: Settings, monkeypatch, capsys) -> Callable[..., tuple[int, str, str]]:
    """`ballast ...` run in this process against `settings` (only its BALLAST_* environment, a wide console):
    returns a function giving (exit code, stdout, stderr) for argv."""
    from ballast.cli.main import main

    for key in [k for k in os.environ if k.startswith("BALLAST_")]:
        monkeypatch.delenv(key)
    for key, value in {**settings_env(settings), "COLUMNS": "300"}.items():
        monkeypatch.setenv(key, value)
    # A console made before this (an earlier test imported its module) kept the width it found then.
    from rich.console import Console

    for name, module in list(sys.modules.items()):
        if name.startswith("ballast.cli"):
            for value in list(vars(module).values()):
                if isinstance(value, Console):
                    monkeypatch.setattr(value, "_width", 300)

    def ballast(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err

    return ballast


def settings_env(settings: Settings) -> dict[str, str]:
    """Environment that makes a subprocess see the same settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BALLAST_")}
    for name in ("data_dir", "database_url", "broker_url", "host", "store_port", "store_read_port", "store_reader",
                 "profiler_port", "planner_port",
                 "planner_agent_port", "executor_port", "dashboard_port", "tls_ca", "tls_cert", "tls_key", "plaintext",
                 "queue", "lease_seconds", "sweep_interval_s", "requeue_unclaimed_s", "visibility_timeout_s",
                 "worker_heartbeat_s", "store_metrics_port", "profiler_metrics_port", "planner_metrics_port",
                 "worker_metrics_port", "executor_metrics_port", "executor_cpu_slots", "allowed_model_factories",
                 "model_path", "data_roots", "allowed_data_factories", "calibrate_on_arrival", "agent_heartbeat_s"):
        value = getattr(settings, name)
        env[f"BALLAST_{name.upper()}"] = ",".join(value) if isinstance(value, tuple) else str(value)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Plane:
    settings: Settings
    servers: dict[str, Server] = field(default_factory=dict)
    agents: list[subprocess.Popen] = field(default_factory=list)  # executor agent processes (executor_plane)

    @property
    def token(self) -> str:
        return self.settings.resolved_token()

    def client(self, token: str | None = None) -> Client:
        return Client.of(self.settings, token=token)

    def store(self, token: str | None = None) -> RemoteStore:
        """The store as the services reach it (the Store interface), as the admin unless `token` is given."""
        return RemoteStore(open_channel(self.settings.address("store"), self.token if token is None else token,
                                        transport=client_transport(self.settings)))

    @contextlib.contextmanager
    def agent_control(self, host: str) -> Iterator[executor_pb2_grpc.ExecutorControlStub]:
        """ExecutorControl as an executor agent reaches it: the planner's agent port, with the client certificate
        the local CA issues for `host` (mutual TLS) and the admin token."""
        channel = open_channel(self.settings.address("planner_agent"), self.token, timeout=None,
                               transport=agent_transport(self.settings, host))
        try:
            yield executor_pb2_grpc.ExecutorControlStub(channel)
        finally:
            channel.close()

    def tls_channel(self, service: str) -> grpc.Channel:
        """A plain grpcio channel (no token, no retries) verified with the data dir's CA."""
        return grpc.secure_channel(self.settings.address(service), client_transport(self.settings).credentials())

    def stop(self) -> None:
        for server in reversed(list(self.servers.values())):
            server.stop(0.5)


def start_plane(settings: Settings, services: tuple[str, ...] = ("store", "profiler", "planner"),
                send: Callable[[str], None] | None = None) -> Plane:
    """Migrate, write the admin token, start the requested services in this process."""
    from services.planner.service import build_server as planner_server
    from services.profiler.service import build_server as profiler_server
    from services.store.service import build_server as store_server

    ensure_token(settings)
    schema.upgrade(settings.database_url)
    plane = Plane(settings)
    if "store" in services:
        plane.servers["store"] = store_server(settings, create_engine(settings.database_url)).start()
    if "profiler" in services:
        plane.servers["profiler"] = profiler_server(settings).start()
    if "planner" in services:
        plane.servers["planner"] = planner_server(settings, send=send).server.start()
    return plane


def run_cli(settings: Settings, *args: str, timeout: float = 120,
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`ballast ARGS` as a user runs it: a child process seeing `settings`, its output captured (wide, so rich does
    not wrap at 80 columns without a terminal)."""
    env = {**settings_env(settings), "COLUMNS": "200", **(extra_env or {})}
    return subprocess.run([sys.executable, "-m", "ballast", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def spawn_cli(settings: Settings, *args: str, extra_env: dict[str, str] | None = None,
              log: Path | None = None) -> subprocess.Popen:
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "ballast", *args], env={**settings_env(settings),
                            **(extra_env or {})}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=ROOT)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


test_deadline: list[float | None] = [None]  # when pytest-timeout kills the running test (set by conftest)
STORY_MARGIN_S = 30.0  # a wait gives up this long before that, leaving time to tell its story


def wait_for(predicate: Callable[[], object], timeout: float = 60.0, interval: float = 0.2, what: str = "",
             story: Callable[[], str] | None = None) -> object:
    """Poll until `predicate` is truthy; on timeout the error says what was awaited and, with `story`,
    what the system looked like then. Inside a test, the wait ends before the test's own time limit."""
    start = time.monotonic()
    deadline = start + timeout
    if test_deadline[0] is not None:
        deadline = min(deadline, test_deadline[0] - STORY_MARGIN_S)
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            told = ""
            if story is not None:
                try:
                    told = "\n" + story()
                except Exception as exc:  # noqa: BLE001 - the timeout is the failure to report
                    told = f"\n(no story: {exc!r})"
            waited = time.monotonic() - start
            raise AssertionError(f"timed out after {waited:.0f}s waiting for {what or predicate}{told}")
        time.sleep(interval)


def submit_to_success(plane: Plane, spec, timeout: float = 600.0):
    """Submit `spec` on `plane` and wait for it to end; the ended job, or SystemExit with why it did not succeed
    (for benchmarks: a run that failed has nothing to measure)."""
    from ballast.v1 import job_pb2, services_pb2, store_pb2

    s = job_pb2.JobState
    client = plane.client()
    job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec))
    done = wait_for(lambda: (j := client.jobs.Get(store_pb2.GetRequest(id=job.id))).state in (
        s.JOB_STATE_SUCCEEDED, s.JOB_STATE_FAILED, s.JOB_STATE_CANCELLED) and j, timeout=timeout,
        what=f"job {spec.name} to end", story=lambda: job_story(client, job.id, plane.settings.data_dir))
    if done.state != s.JOB_STATE_SUCCEEDED:
        raise SystemExit(f"{spec.name} ended {s.Name(done.state)}: {done.message}")
    return done


def covered(metrics) -> dict[tuple[int, int], list[int]]:
    """Per (stage, replica): every iteration its metrics rows cover, in order, repeats kept (a row may be a window
    of iterations, first_iteration .. iteration): each iteration exactly once reads as range(n)."""
    out: dict[tuple[int, int], list[int]] = {}
    for m in sorted(metrics, key=lambda m: (m.stage_index, m.replica_index, m.iteration)):
        first = m.first_iteration if m.iterations else m.iteration
        out.setdefault((m.stage_index, m.replica_index), []).extend(range(first, m.iteration + 1))
    return out


def lineage_problems(metrics, iterations: int) -> list[str]:
    """What keeps a job's metrics from holding each of its `iterations` exactly once per (stage, replica) that ran
    it, counting every iteration a row covers (a window's first_iteration .. iteration): none when it does."""
    seen: dict[tuple[int, int, int], int] = {}
    for m in metrics:
        first = m.first_iteration if m.iterations else m.iteration
        for i in range(first, m.iteration + 1):
            key = (i, m.stage_index, m.replica_index)
            seen[key] = seen.get(key, 0) + 1
    problems = [f"iteration {i} of stage {s}, replica {r} stored {n} times" for (i, s, r), n in sorted(seen.items())
                if n > 1]
    found = {i for i, _, _ in seen}
    if found != set(range(iterations)):
        problems.append(f"iterations missing {sorted(set(range(iterations)) - found)[:10]}, "
                        f"beyond the run {sorted(found - set(range(iterations)))[:10]}")
    return problems


def worker_pids(job_id: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"services.executor.train.worker .*{job_id}"], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def job_story(client: Client, job_id: str, data_dir: Path) -> str:
    """A job that did not end in time, as a test failure should show it: state, events, the last iteration
    each rank reported, the agents' log tails and every live worker's thread stacks (SIGUSR1, worker.py)."""
    from ballast.v1 import job_pb2, store_pb2

    pids = worker_pids(job_id)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(1.0)
    job = client.jobs.Get(store_pb2.GetRequest(id=job_id))
    lines = [f"job {job_id}: {job_pb2.JobState.Name(job.state)} at iteration {job.iteration}: {job.message}",
             f"live worker pids: {pids}"]
    events = client.store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job_id)).events
    lines += [f"  event {e.type}: {e.message[:300]}" for e in events]
    last: dict[tuple[int, int], int] = {}
    for m in client.iteration_metrics(job_id):
        last[(m.stage_index, m.replica_index)] = max(last.get((m.stage_index, m.replica_index), 0), m.iteration)
    lines.append(f"last stored iteration per (stage, replica): {dict(sorted(last.items()))}")
    for log in sorted(data_dir.glob("agent-*.log")):
        lines.append(f"--- {log.name} (tail)")
        lines += log.read_text(errors="replace").splitlines()[-15:]
    for stacks in sorted(data_dir.glob(f"executor/*/{job_id}/*.stacks")):
        lines.append(f"--- {stacks.parent.parent.name}/{stacks.name}")
        lines.append(stacks.read_text(errors="replace")[-4000:])
    return "\n".join(lines)


# Tests about other things run data-parallel jobs on a loaded 2-core machine, where a busy neighbour can read as
# a straggler and leave a host degraded for the module's next test: their planes leave out only a gross one.
# The straggler test and the benchmarks pass STRAGGLERS, the product's thresholds.
QUIET_STRAGGLERS = {"straggler_threshold": 20.0, "straggler_shared_cpu_threshold": 20.0}
STRAGGLERS = {"straggler_threshold": Settings.straggler_threshold,
              "straggler_shared_cpu_threshold": Settings.straggler_shared_cpu_threshold}


@contextlib.contextmanager
def executor_plane(data_dir: Path, queue: str, agents: int = 2, agent_env: dict[str, str] | None = None,
                   **overrides: object) -> Iterator[Plane]:
    """The whole control plane with a real Celery worker and `agents` executor agents (one per "host"),
    up until every agent is online; everything is killed on exit. `plane.agents` are the agent processes
    (started with `agent_env` added, e.g. fault hooks); `overrides` go to the settings (QUIET_STRAGGLERS unless
    they say otherwise)."""
    from ballast.v1 import fleet_pb2, store_pb2

    assert agents <= AGENT_PORTS, f"a test plane reserves ports for {AGENT_PORTS} agents"
    settings = make_settings(data_dir, queue=queue, **{"lease_seconds": 10.0, "sweep_interval_s": 0.5,
                                                       "worker_heartbeat_s": 0.5, **QUIET_STRAGGLERS,
                                                       "metrics_window_s": Settings.metrics_window_s, **overrides})
    plane = start_plane(settings)
    procs = [spawn_cli(settings, "worker", log=settings.data_dir / "worker.log")]
    plane.agents = [spawn_cli(settings, "serve", "executor", "--index", str(i), extra_env=agent_env,
                              log=settings.data_dir / f"agent-{i}.log") for i in range(agents)]
    procs += plane.agents
    try:
        client = plane.client()
        online = store_pb2.ListHostsRequest(state=fleet_pb2.HOST_STATE_ONLINE)
        wait_for(lambda: len(client.store.ListHosts(online).hosts) == agents, what=f"{agents} executor agents online")
        yield plane
    finally:
        for proc in {id(p): p for p in procs + plane.agents}.values():  # agents restarted meanwhile too
            kill_group(proc)
        plane.stop()


@contextlib.contextmanager
def emulated_plane(data_dir: Path, queue: str, hosts: int, devices_per_host: int = 8,
                   device_kind: str = "nvidia-h100-sxm-80gb", noise: float = 0.0,
                   **overrides: object) -> Iterator[tuple[Plane, Any]]:
    """The whole control plane with a real Celery worker and `hosts` emulated hosts (services/executor/
    emulated_hosts.py) in this process, up until every host is online: (the plane, the EmulatedHosts, whose
    `lose` and emulator's `kill_rank` inject faults)."""
    from services.executor.emulated import Behaviour
    from services.executor.emulated_hosts import EmulatedHosts

    settings = make_settings(data_dir, queue=queue, **{"lease_seconds": 10.0, "sweep_interval_s": 0.5,
                                                       "worker_heartbeat_s": 0.5, **QUIET_STRAGGLERS,
                                                       "metrics_window_s": Settings.metrics_window_s, **overrides})
    plane = start_plane(settings)
    procs = [spawn_cli(settings, "worker", log=settings.data_dir / "worker.log")]
    fleet = EmulatedHosts(plane.settings, hosts, devices_per_host, device_kind, Behaviour(noise=noise, seed=1))
    try:
        fleet.start()
        client = plane.client()
        wait_for(lambda: len(online_hosts(client)) == hosts, timeout=60 + hosts / 8,
                 what=f"{hosts} emulated hosts online")
        yield plane, fleet
    finally:
        fleet.stop()
        with contextlib.suppress(Exception):  # the planner marks each host offline; then the store may go
            wait_for(lambda: not online_hosts(plane.client()), timeout=30 + hosts / 8, what="hosts offline")
        for proc in procs:
            kill_group(proc)
        plane.stop()


def online_hosts(client: Client) -> list:
    """Every ONLINE host, over all the pages of ListHosts (a page holds 100)."""
    from ballast.v1 import fleet_pb2, store_pb2
    from services.runtime.store_api import every_page

    request = store_pb2.ListHostsRequest(state=fleet_pb2.HOST_STATE_ONLINE)
    return [h for page in every_page(client.store.ListHosts, request) for h in page.hosts]


def restart_agent(plane: Plane, index: int, extra_env: dict[str, str] | None = None) -> None:
    """Start executor agent `index` again (after a test killed it, or to give it `extra_env`, e.g. a fault
    hook), as an operator's supervisor would, and wait until every agent is online."""
    from ballast.v1 import fleet_pb2, store_pb2

    old = plane.agents[index]
    if old.poll() is None:
        kill_group(old)
    gone_at = time.time()
    plane.agents[index] = spawn_cli(plane.settings, "serve", "executor", "--index", str(index), extra_env=extra_env,
                                    log=plane.settings.data_dir / f"agent-{index}.log")
    name = f"-{plane.settings.executor_port + index}"

    def back() -> bool:  # online, heartbeating since the old process died: the new agent, not the old record
        hosts = plane.client().store.ListHosts(store_pb2.ListHostsRequest()).hosts
        return any(h.name.endswith(name) and h.state == fleet_pb2.HOST_STATE_ONLINE
                   and h.last_heartbeat_at.ToMicroseconds() / 1e6 > gone_at for h in hosts)

    wait_for(back, timeout=60, what=f"agent {index} online again")


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Intra-op threads for a block (module fixtures cannot use the function-scoped `one_thread`)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def of(events: list[dict], kind: str) -> list[dict]:
    """A worker's events of one kind (`run_local` returns each rank's JSON event lines)."""
    return [e for e in events if e["event"] == kind]


def losses(events: list[list[dict]]) -> list[float]:
    """The per-iteration losses the last rank (the last stage) reported."""
    return [e["loss"] for e in of(events[-1], "iteration")]


@contextlib.contextmanager
def small_disk(directory: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` ("3m") mounted at `directory`, to fill on purpose; skips where mounting is not
    allowed (CI runs as root, so there it always runs)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], check=True)
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)
