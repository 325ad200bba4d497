"""One place for configuration: defaults that serve the embedded mode, then a file, then environment.

Precedence (last wins): built-in defaults < TOML file (BALLAST_CONFIG or <data_dir>/ballast.toml) <
environment variables (BALLAST_*). Every service and the CLI read settings through `load_settings`.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

DEFAULT_PORTS = {"store": 50051, "profiler": 50052, "planner": 50053, "planner_agent": 50054, "store_read": 50055,
                 "executor": 50060, "dashboard": 50070}


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    database_url: str
    broker_url: str
    sql_database_url: str = ""
    sql_password: str = ""
    host: str = "127.0.0.1"
    advertise_host: str = ""
    store_port: int = DEFAULT_PORTS["store"]
    # `ballast up` starts a second store process that serves only the read-only RPCs (docs/architecture.md, "Store
    # reads"), on store_read_port: one Python process tops out near one core, and half the store's calls are reads
    store_reader: bool = True
    store_read_port: int = DEFAULT_PORTS["store_read"]
    profiler_port: int = DEFAULT_PORTS["profiler"]
    planner_port: int = DEFAULT_PORTS["planner"]
    # executor agents connect here, with a client certificate (mutual TLS) that names their host
    planner_agent_port: int = DEFAULT_PORTS["planner_agent"]
    executor_port: int = DEFAULT_PORTS["executor"]
    # devices an executor agent offers on a host without GPUs: CPU worker slots sharing its cores and memory
    executor_cpu_slots: int = 1
    # Prometheus metrics, one port per process (executor agent i: executor_metrics_port + i); 0 turns one off
    store_metrics_port: int = 9401
    profiler_metrics_port: int = 9402
    planner_metrics_port: int = 9403
    worker_metrics_port: int = 9404
    executor_metrics_port: int = 9410
    # the read-only web dashboard (HTTPS with the server certificate; HTTP on loopback only with plaintext)
    dashboard_port: int = DEFAULT_PORTS["dashboard"]
    store_address: str = ""
    # where services send the store's read-only RPCs (empty: to the store itself); `ballast up` sets it for its
    # children when it starts the reader, and a read it cannot serve goes to the store
    store_read_address: str = ""
    profiler_address: str = ""
    planner_address: str = ""
    planner_agent_address: str = ""
    dashboard_address: str = ""
    # Transport security (docs/operator-guide.md, "Transport security"): PEM paths; all empty = the data dir's local CA
    # (<data_dir>/tls, created on first start). plaintext turns TLS off and then only loopback binds are allowed.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    plaintext: bool = False
    token: str = ""
    queue: str = "planner"
    lease_seconds: float = 60.0
    sweep_interval_s: float = 5.0
    requeue_unclaimed_s: float = 300.0
    visibility_timeout_s: float = 300.0
    worker_heartbeat_s: float = 5.0
    host_lost_s: float = 5.0  # an executor agent away this long has lost its host: its jobs morph without it
    # how often an idle executor agent says it is alive (the planner hands it out at registration); a lost stream,
    # not a missing heartbeat, is what loses a host, so at thousands of hosts a longer interval costs nothing else
    agent_heartbeat_s: float = 2.0
    # each worker's per-iteration stats are summarised by its agent over windows of about this many seconds of its
    # plan's predicted iterations (count, mean parts, median, p95, max) before they travel and are stored: rows per
    # second are ranks / window, not ranks x iteration rate; 0 stores every iteration (as JobSpec.raw_metrics does)
    metrics_window_s: float = 10.0
    # executor agents the planner holds a Connect stream for at once (a coroutine each on the agent port: a memory cap)
    planner_agent_streams: int = 16_384
    max_morphs_per_hour: int = 10  # per job, for lost workers and hosts; the model's own errors are never retried
    # a degraded (straggler) host still online rejoins on trial after this long, doubled each time it is caught
    # again (at most a day); 0: only `ballast fleet clear` gives it back
    degraded_parole_s: float = 600.0
    # a worker computing this much slower than its data-parallel peers is a straggler (Varuna saw ~30%) ...
    straggler_threshold: float = 0.25
    # ... or this much where CPU workers share one machine's cores (the OS scheduler alone skews them ~40%)
    straggler_shared_cpu_threshold: float = 0.5
    checkpoint_max_interval_s: float = 1800.0
    # elastic jobs (--elastic): how often the scheduler re-allocates devices among them, and the least time
    # between two resizes of one job (hysteresis: a resize is a morph, a drain to a checkpoint and a restart)
    elastic_interval_s: float = 10.0
    elastic_min_resize_interval_s: float = 600.0
    # no job is shrunk so far, nor started so late, that its predicted finish-time fairness (completion time
    # against running alone on its requested devices) passes this; 0 turns the guard off
    elastic_fairness_bound: float = 1.5
    # a host class's calibration (learnt from runs) is used when planning once fitted on this many iterations;
    # 0 plans from profiles alone
    calibration_min_iterations: int = 20
    # a host class the online fleet forms with no calibration runs a short known workload first (seconds), so the
    # first user job on it is priced calibrated (services/planner/jobs/arrival.py); user jobs wait meanwhile
    calibrate_on_arrival: bool = True
    # Per-tenant rate limits (docs/operator-guide.md, "Rate limits"): a token bucket per (tenant, gRPC service) on each
    # server, refilled at rate_limit_rps calls/s up to rate_limit_burst; the platform admin and calls a service forwards
    # for a tenant are not counted. 0 turns the limits off.
    rate_limit_rps: float = 100.0
    rate_limit_burst: int = 200
    # Failed authentications a peer address may make (services/runtime/auth_failures.py): auth_failure_burst at
    # once, then auth_failure_rate a second; past that its calls are RESOURCE_EXHAUSTED until the bucket refills
    # (tokens that authenticated lately still pass). 0 for the rate turns it off.
    auth_failure_rate: float = 2.0
    auth_failure_burst: int = 30
    # a service's own store call (the worker's, the scheduler's, heartbeats) waits at most this long for the
    # callers' calls in flight to be served before it starts (services/store/gate.py); 0 starts it at once, at
    # most 1000 (a waiting call holds a server thread)
    store_background_wait_ms: float = 50.0
    log_level: str = "INFO"
    log_format: str = "json"  # json (one object per line, for shipping) or text (for a terminal)
    # users' own models (docs/models.md): the factories that may be imported, and the directories their files live
    # in (BALLAST_MODEL_PATH, ':'- or ','-separated: added to the import path of every process that builds a
    # model; Hugging Face config and weights directories must lie inside one)
    allowed_model_factories: tuple[str, ...] = ()
    model_path: tuple[str, ...] = ()
    # users' data (docs/data.md): the directories a job's files may be read from, and the data factories allowed
    data_roots: tuple[str, ...] = ()
    allowed_data_factories: tuple[str, ...] = ()
    fleet_policy: str = ""  # policy YAML the planner stores at start-up when it differs (services/specs/policy.py)

    def address(self, service: str) -> str:
        """host:port where `service` listens (explicit *_address wins)."""
        explicit = getattr(self, f"{service}_address", "")
        return explicit or f"{self.host}:{getattr(self, f'{service}_port')}"

    def dashboard_url(self) -> str:
        """Where a browser on this host opens the dashboard: HTTPS, or HTTP with plaintext (loopback only)."""
        host, _, port = self.address("dashboard").rpartition(":")
        if host in ("0.0.0.0", "::", ""):
            host = self.advertised_host()
        return f"{'http' if self.plaintext else 'https'}://{host}:{port}/"

    def advertised_host(self) -> str:
        """The name peers use to reach this host: explicit, else the bind address unless it is a wildcard."""
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            import socket

            return socket.getfqdn()
        return self.host

    @property
    def token_file(self) -> Path:
        return self.data_dir / "admin.token"

    def resolved_token(self) -> str:
        """The bearer token for clients: BALLAST_TOKEN, else the embedded admin token file."""
        if self.token:
            return self.token
        if self.token_file.exists():
            return self.token_file.read_text().strip()
        return ""


def _coerce(name: str, value: object) -> object:
    kind = {f.name: f.type for f in fields(Settings)}[name]
    if kind == "Path":
        return Path(str(value)).expanduser()
    if kind == "int":
        return int(value)  # type: ignore[arg-type]
    if kind == "bool":
        return _bool(name, value)
    if kind == "float":
        return float(value)  # type: ignore[arg-type]
    if kind.startswith("tuple"):
        if isinstance(value, str):
            separators = f",{os.pathsep}" if name in ("model_path", "data_roots") else ","
            return tuple(v.strip() for v in re.split(f"[{re.escape(separators)}]", value) if v.strip())
        return tuple(value)  # type: ignore[arg-type]
    return str(value)


def _bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}: {value!r} is not a boolean; use 1/true/yes or 0/false/no (BALLAST_{name.upper()})")


def load_settings(env: dict[str, str] | None = None, **overrides: object) -> Settings:
    """Build settings from defaults, the optional TOML file, the environment and explicit overrides."""
    env = dict(os.environ if env is None else env)
    data_dir = Path(overrides.get("data_dir") or env.get("BALLAST_DATA_DIR") or "~/.ballast").expanduser()
    values: dict[str, object] = {}
    config_file = Path(env["BALLAST_CONFIG"]) if env.get("BALLAST_CONFIG") else data_dir / "ballast.toml"
    if config_file.exists():
        with config_file.open("rb") as fh:
            values.update(tomllib.load(fh))
    names = {f.name for f in fields(Settings)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"{config_file}: unknown setting(s) {sorted(unknown)}; known: {sorted(names)}")
    for name in names:
        key = f"BALLAST_{name.upper()}"
        if key in env and env[key] != "":
            values[name] = env[key]
    values.update({k: v for k, v in overrides.items() if v is not None})
    values["data_dir"] = data_dir if "data_dir" not in values else values["data_dir"]
    values = {k: _coerce(k, v) for k, v in values.items()}
    dd = values["data_dir"]
    values.setdefault("database_url", f"sqlite:///{Path(dd) / 'ballast.db'}")  # type: ignore[arg-type]
    values.setdefault("broker_url", f"sqla+sqlite:///{Path(dd) / 'broker.db'}")  # type: ignore[arg-type]
    return Settings(**values)  # type: ignore[arg-type]

