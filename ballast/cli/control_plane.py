"""`ballast up` / `down` / `status`: the embedded control plane as child processes of one data dir.

State (pids and addresses) lives in <data-dir>/run/state.json so any later command finds them.
Children run in their own sessions, so `up` can return and `down` can signal each process group. A supervisor
(`ballast supervise`, ballast/cli/supervise.py) restarts a child that dies, with backoff, and counts it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ballast.config import Settings
from ballast.health import check
from ballast.tls import TlsError, ensure_server_files
from ballast.transport import client_transport

SERVICES = ("store", "profiler", "planner")


@dataclass
class Child:
    name: str
    pid: int
    address: str = ""
    log: str = ""
    args: list[str] = field(default_factory=list)  # `ballast ARGS` starts it again
    env: dict[str, str] = field(default_factory=dict)  # what it was started with beyond the environment
    restarts: int = 0  # times the supervisor started it again
    last_exit: str = ""  # how it last ended, as the supervisor saw it


@dataclass
class State:
    children: list[Child] = field(default_factory=list)
    supervisor: int = 0  # the pid of `ballast supervise` (0: none)

    @staticmethod
    def path(settings: Settings) -> Path:
        return settings.data_dir / "run" / "state.json"

    @classmethod
    def load(cls, settings: Settings) -> State | None:
        path = cls.path(settings)
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return cls([Child(**c) for c in data["children"]], data.get("supervisor", 0))

    def save(self, settings: Settings) -> None:
        """Atomically: the supervisor rewrites it while `status` reads it."""
        path = self.path(settings)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"children": [asdict(c) for c in self.children], "supervisor": self.supervisor},
                                  indent=2))
        os.replace(tmp, path)


def alive(pid: int) -> bool:
    """True while the process runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # reaps it if it is our own child
        if done:
            return False
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs (macOS): trust kill(0)
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def ensure_token(settings: Settings) -> str:
    """The embedded admin token, created once (0600) in the data directory."""
    from services.runtime.auth import new_token

    if settings.token:
        return settings.token
    path = settings.token_file
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(new_token() + "\n")
    return path.read_text().strip()


def spawn(settings: Settings, name: str, args: list[str], env_extra: dict[str, str] | None = None) -> Child:
    logs = settings.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{name}.log"
    env = {**os.environ, "BALLAST_DATA_DIR": str(settings.data_dir), "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ballast", *args], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Child(name=name, pid=proc.pid, log=str(log_path), args=list(args), env=dict(env_extra or {}))


EMULATED = "emulated-hosts"  # the children that run `up --emulate-hosts N` (services/executor/emulated_hosts.py)
HOSTS_PER_EMULATOR = 1024


@dataclass(frozen=True)
class EmulatedFleet:
    """`up --emulate-hosts`: hosts whose workers advance at the plan's predicted time, HOSTS_PER_EMULATOR to a
    process (one process's agents share its interpreter: about 0.4 GiB and 1,500 threads per 1,024 hosts)."""

    hosts: int = 0
    devices_per_host: int = 8
    device_kind: str = "nvidia-h100-sxm-80gb"

    def processes(self) -> list[tuple[str, list[str]]]:
        """(child name, `ballast` arguments) of each emulator process."""
        return [(f"{EMULATED}-{first // HOSTS_PER_EMULATOR}",
                 ["serve", "executor", "--emulate", str(min(HOSTS_PER_EMULATOR, self.hosts - first)),
                  "--first-host", str(first), "--devices-per-host", str(self.devices_per_host),
                  "--device-kind", self.device_kind])
                for first in range(0, self.hosts, HOSTS_PER_EMULATOR)]


def start_all(settings: Settings, executors: int, timeout_s: float = 60.0,
              emulated: EmulatedFleet = EmulatedFleet()) -> State:
    state = State()
    # the services are told where the store's reader will be; until it serves, they read from the store
    reads = {"BALLAST_STORE_READ_ADDRESS": settings.address("store_read")} if settings.store_reader else {}
    for name in SERVICES:
        policy = ["--policy", settings.fleet_policy] if name == "planner" and settings.fleet_policy else []
        child = spawn(settings, name, ["serve", name, *policy], reads if name != "store" else {})
        child.address = settings.address(name)
        state.children.append(child)
    dashboard = spawn(settings, "dashboard", ["serve", "dashboard"], reads)
    dashboard.address = settings.dashboard_url()
    state.children.append(dashboard)
    state.children.append(spawn(settings, "worker", ["worker"], reads))
    slots = {"BALLAST_EXECUTOR_CPU_SLOTS": str(settings.executor_cpu_slots)}  # `up --cpu-slots` reaches the agents
    for i in range(executors):
        child = spawn(settings, f"executor-{i}", ["serve", "executor", "--index", str(i)], {**reads, **slots})
        child.address = f"{settings.host}:{settings.executor_port + i}"
        state.children.append(child)
    for name, args in emulated.processes():
        child = spawn(settings, name, args, reads)
        child.address = f"{args[3]} host(s) x {emulated.devices_per_host} {emulated.device_kind}"
        state.children.append(child)
    if settings.store_reader:
        start_reader(settings, state, time.monotonic() + timeout_s)
    state.save(settings)
    return state


def start_reader(settings: Settings, state: State, deadline: float) -> None:
    """The store's read-only twin, once the store serves: the store makes the admin's token good at start-up,
    and a reader answering before that would turn the services' first reads away. A store that never serves is
    reported as such; its reader is then not started."""
    store = next(c for c in state.children if c.name == "store")
    transport = client_transport(settings)
    while check(store.address, transport=transport) != "SERVING":
        if not alive(store.pid) or time.monotonic() > deadline:
            return
        time.sleep(0.2)
    reader = spawn(settings, "store-read", ["serve", "store", "--read-only"])
    reader.address = settings.address("store_read")
    state.children.insert(state.children.index(store) + 1, reader)


def metrics_port(settings: Settings, name: str) -> int:
    """The Prometheus port of child `name` (store, profiler, planner, worker, executor-I); 0 when off."""
    if name.startswith("executor-"):
        base = settings.executor_metrics_port
        return base + int(name.split("-", 1)[1]) if base else 0
    return getattr(settings, f"{name}_metrics_port", 0)


def metrics_url(settings: Settings, name: str) -> str:
    """Where Prometheus scrapes child `name` ("" when its metrics are off)."""
    from services.runtime.metrics_http import metrics_url as url

    port = metrics_port(settings, name)
    return url(settings, port) if port else ""


def dashboard_health(settings: Settings, url: str, timeout_s: float = 2.0) -> str:
    """SERVING when the dashboard answers /healthz over TLS verified with the configured CA."""
    import ssl
    import urllib.request

    from ballast.tls import tls_files

    context = None if settings.plaintext else ssl.create_default_context(cafile=str(tls_files(settings).ca))
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/healthz", timeout=timeout_s, context=context) as reply:
            return "SERVING" if reply.status == 200 else f"HTTP {reply.status}"
    except OSError as exc:  # refused, TLS failure, timeout: not serving (yet)
        return f"NOT_SERVING ({type(exc).__name__})"


def worker_names(settings: Settings) -> list[str]:
    """Workers whose heartbeat reached the store recently."""
    from ballast.client import Client
    from ballast.v1 import store_pb2

    with Client.of(settings, ("store",)) as client:
        reply = client.store.ListWorkers(store_pb2.ListWorkersRequest(seen_within_s=max(15.0,
                                         3 * settings.worker_heartbeat_s)), timeout=3)
    return [w.name for w in reply.workers]


def statuses(settings: Settings, state: State) -> list[tuple[str, str, str]]:
    """(name, address, status) for every child; status is SERVING when healthy."""
    rows = []
    workers: list[str] | None = None
    transport = client_transport(settings)
    for child in state.children:
        if not alive(child.pid):
            rows.append((child.name, child.address, "EXITED"))
        elif child.name == "worker":
            if workers is None:
                try:
                    workers = worker_names(settings)
                except Exception as exc:  # noqa: BLE001 - the store may be down
                    workers = []
                    rows.append((child.name, "", f"UNKNOWN: store unreachable ({type(exc).__name__})"))
                    continue
            mine = [w for w in workers if w.endswith(f"-{child.pid}")]
            rows.append((child.name, mine[0] if mine else "", "SERVING" if mine else "NO HEARTBEAT"))
        elif child.name == "dashboard":
            rows.append((child.name, child.address, dashboard_health(settings, child.address)))
        elif child.name.startswith(EMULATED):  # no endpoint of its own: `wait_fleet` sees its hosts register
            rows.append((child.name, child.address, "SERVING"))
        else:
            rows.append((child.name, child.address, check(child.address, transport=transport)))
    return rows


def wait_serving(settings: Settings, state: State, timeout_s: float) -> list[tuple[str, str, str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = statuses(settings, state)
        if all(r[2] == "SERVING" for r in rows):
            return rows
        if any(r[2] == "EXITED" for r in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.3)


def wait_fleet(settings: Settings, executors: int, since: float, timeout_s: float) -> int:
    """Wait until `executors` agents are online with the planner (heartbeating since `since`: a host record left
    ONLINE by an earlier run in the same data dir does not count), so a job submitted right after `up` is planned
    for the whole local fleet. Returns how many were."""
    if executors <= 0:
        return 0
    from ballast.client import Client
    from ballast.v1 import fleet_pb2, store_pb2

    deadline, online = time.monotonic() + timeout_s, 0
    with Client.of(settings, ("store",)) as client:
        while True:
            try:
                hosts = client.store.ListHosts(store_pb2.ListHostsRequest(state=fleet_pb2.HOST_STATE_ONLINE)).hosts
                online = sum(1 for h in hosts if h.last_heartbeat_at.ToMicroseconds() >= since * 1e6)
            except Exception:  # noqa: BLE001 - the store just started; ask again until the deadline
                online = 0
            if online >= executors or time.monotonic() > deadline:
                return online
            time.sleep(0.3)


def stop_all(settings: Settings, state: State, timeout_s: float = 15.0) -> list[str]:
    """SIGTERM every child's process group, the store last so the others can record their final state;
    SIGKILL whatever is left after `timeout_s`. Returns the names that had to be killed."""
    killed: list[str] = []
    if state.supervisor:  # first, or it would start again what is being stopped
        _signal(state.supervisor, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and alive(state.supervisor):
            time.sleep(0.1)
        if alive(state.supervisor):
            killed.append("supervisor")
            _signal(state.supervisor, signal.SIGKILL)
        state = State.load(settings) or state  # the pids of what it restarted
    clients = [c for c in state.children if c.name != "store"]
    stores = [c for c in state.children if c.name == "store"]
    for phase in (clients, stores):
        for child in phase:
            _signal(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(alive(c.pid) for c in phase):
            time.sleep(0.1)
        for child in phase:
            if alive(child.pid):
                killed.append(child.name)
                _signal(child.pid, signal.SIGKILL)
    State.path(settings).unlink(missing_ok=True)
    return killed


def _signal(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


LOW_FREE_BYTES = 1 << 30
LOW_FREE_FRACTION = 0.10


def low_space(settings: Settings) -> str:
    """A warning when the data dir's file system runs low (under 1 GiB or 10% free): the store, checkpoints and
    logs all write there, and a full disk stops the store's writes. "" when there is room."""
    try:
        usage = shutil.disk_usage(settings.data_dir)
    except OSError:
        return ""
    if usage.free >= LOW_FREE_BYTES and usage.free >= LOW_FREE_FRACTION * usage.total:
        return ""
    return (f"low disk space: {usage.free / 2**20:.0f} MiB free of {usage.total / 2**20:.0f} MiB on "
            f"{settings.data_dir}'s file system; the store stops writing when it is full (delete old checkpoints "
            "with --keep-checkpoints, or move the data dir)")


def plane_ports(settings: Settings, executors: int) -> list[tuple[str, int]]:
    """Every (setting, port) the plane about to start listens on (a metrics port of 0 is off)."""
    ports = [(f"{name}_port", getattr(settings, f"{name}_port"))
             for name in ("store", "store_read", "profiler", "planner", "planner_agent", "dashboard")]
    ports += [(f"executor_port + {i}", settings.executor_port + i) for i in range(executors)]
    for name in ("store", "profiler", "planner", "worker"):
        ports.append((f"{name}_metrics_port", metrics_port(settings, name)))
    ports += [(f"executor_metrics_port + {i}", metrics_port(settings, f"executor-{i}")) for i in range(executors)]
    return [(setting, port) for setting, port in ports if port]


def taken_ports(settings: Settings, executors: int) -> list[tuple[str, int]]:
    """The plane's ports another process already listens on (checked by binding them as the servers will)."""
    host = settings.host if settings.host not in ("", "::", "0.0.0.0") else "0.0.0.0"
    taken = []
    for setting, port in plane_ports(settings, executors):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc does: TIME_WAIT is no owner
            try:
                probe.bind((host, port))
            except OSError:
                taken.append((setting, port))
    return taken


def ports_message(taken: list[tuple[str, int]], settings: Settings) -> str:
    listed = ", ".join(f"{port} ({setting})" for setting, port in taken)
    first = taken[0][0].split(" ")[0]
    return (f"nothing started: port(s) {listed} are in use by another process (another plane?). Stop it, or move "
            f"this plane: set other ports in {settings.data_dir / 'ballast.toml'} (e.g. `{first} = "
            f"{taken[0][1] + 1000}`) or the environment (BALLAST_{first.upper()}); every client of this data dir "
            "reads them from there")


def bring_up(settings: Settings, executors: int, timeout_s: float,
             emulated: EmulatedFleet = EmulatedFleet()) -> tuple[bool, list[tuple[str, str, str]], str]:
    """Migrate, start every component, wait for SERVING. On failure everything started is stopped."""
    from services.store import schema

    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    settings.data_dir.chmod(0o700)  # the plane's state: database, tokens, logs, checkpoints (the umask does the rest)
    existing = State.load(settings)
    if existing and any(alive(c.pid) for c in existing.children):
        return False, [], f"already up in {settings.data_dir}; run `ballast down --data-dir {settings.data_dir}` first"
    if executors + emulated.hosts > settings.planner_agent_streams:
        return False, [], (f"{executors + emulated.hosts} agents are more than the planner holds streams for "
                           f"(planner_agent_streams = {settings.planner_agent_streams}); raise it in "
                           f"{settings.data_dir / 'ballast.toml'} or BALLAST_PLANNER_AGENT_STREAMS, or start "
                           "fewer")
    taken = taken_ports(settings, executors)
    if taken:  # before the token, the certificates, the schema or any child: a second plane touches nothing
        return False, [], ports_message(taken, settings)
    ensure_token(settings)
    if not settings.plaintext:
        try:
            ensure_server_files(settings)  # the local CA and certificates, once, before the children race for them
        except (TlsError, ValueError, OSError) as exc:
            return False, [], f"transport security: {exc}"
    try:
        schema.upgrade(settings.database_url)
    except Exception as exc:  # noqa: BLE001 - reported to the user, nothing was started yet
        return False, [], f"cannot migrate {settings.database_url}: {exc}"
    started = time.time()
    state = start_all(settings, executors, timeout_s, emulated)
    deadline = time.monotonic() + timeout_s
    executors += emulated.hosts  # each registers as a host
    rows = wait_serving(settings, state, timeout_s)
    bad = [r for r in rows if r[2] != "SERVING"]
    if not bad:
        online = wait_fleet(settings, executors, started, max(deadline - time.monotonic(), 5.0))
        if online >= executors:
            state.supervisor = spawn(settings, "supervisor", ["supervise"]).pid
            state.save(settings)
            return True, rows, f"control plane up in {settings.data_dir} (admin token in {settings.token_file})"
        message = (f"{online} of {executors} executor agent(s) registered with the planner within {timeout_s:.0f} s; "
                   f"see the executor logs in {settings.data_dir / 'logs'}")
        stop_all(settings, state)
        return False, rows, message
    lines = []
    for name, _, status in bad:
        child = next(c for c in state.children if c.name == name)
        tail = Path(child.log).read_text(errors="replace").splitlines()[-15:]
        lines.append(f"{name} did not report SERVING ({status}); last lines of {child.log}:\n" + "\n".join(tail))
    stop_all(settings, state)
    return False, rows, "\n".join(lines)
