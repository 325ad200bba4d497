"""The production deployment description: compose.yaml, Dockerfile and .dockerignore.

compose.yaml is validated against the Compose Specification schema vendored by `check-jsonschema`
(nothing is downloaded), then checked for the properties the topology promises: start order, health
checks, the GPU reservation, and which process may reach the database and the broker.
"""

from __future__ import annotations

import copy
import json
import re
import tomllib
from collections.abc import Callable
from dataclasses import fields
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from ballast.config import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"

GRPC_PORTS = {"store": 50051, "profiler": 50052, "planner": 50053, "executor": 50060}
REQUIRED_SERVICES = {"postgres", "redis", "migrate", "planner-worker", "prometheus", "grafana", *GRPC_PORTS}
THIRD_PARTY = {"postgres", "redis", "prometheus", "grafana"}
# Every BALLAST_* name the settings understand (plus the config file path): derived, never listed twice.
KNOWN_BALLAST_VARS = {f"BALLAST_{f.name.upper()}" for f in fields(Settings)} | {"BALLAST_CONFIG"}
DATABASE_CLIENTS = {"store", "store-read", "migrate"}  # BALLAST_DATABASE_URL / BALLAST_SQL_DATABASE_URL
BROKER_CLIENTS = {"planner", "planner-worker"}
BALLAST_NAME = re.compile(r"\bBALLAST_[A-Z0-9_]+")


@cache
def compose_schema() -> dict[str, Any]:
    """The Compose Specification schema shipped inside the installed check-jsonschema package."""
    resource = files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    return json.loads(resource.read_text(encoding="utf-8"))


def schema_errors(document: Any) -> list[str]:
    """Schema violations of `document`, using the validator for the draft the schema declares."""
    schema = compose_schema()
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    validator = validator_cls(schema, format_checker=validator_cls.FORMAT_CHECKER)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(document)
    ]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    with COMPOSE_FILE.open(encoding="utf-8") as fh:
        return yaml.safe_load(fh)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def env_of(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment as a dict, whichever of the two Compose forms it uses."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    """Dependency name -> condition (Compose's default for the short form is service_started)."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def networks_of(service: dict[str, Any]) -> set[str]:
    """Networks a service joins (Compose puts a service without `networks` on `default`)."""
    nets = service.get("networks")
    if nets is None:
        return {"default"}
    return set(nets)


# --- schema -----------------------------------------------------------------------------------------


def test_compose_file_matches_compose_spec(compose: dict[str, Any]) -> None:
    assert schema_errors(compose) == []


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        pytest.param(
            lambda doc: doc["services"]["store"].update(colour="blue"), "'colour'", id="unknown-service-key"
        ),
        pytest.param(
            lambda doc: doc["services"]["store"].update(ports=50051),
            "services/store/ports: 50051 is not of type 'array'",
            id="ports-not-a-list",
        ),
        pytest.param(
            lambda doc: doc["services"]["migrate"].update(restart=False),
            "services/migrate/restart",
            id="bare-no-restart",
        ),
        pytest.param(
            lambda doc: doc["services"]["store"]["depends_on"]["migrate"].update(condition="service_done"),
            "services/store/depends_on",
            id="bad-depends-on-condition",
        ),
        pytest.param(lambda doc: doc.update(servics={}), "'servics'", id="unknown-top-level-key"),
    ],
)
def test_schema_rejects_broken_copies(
    compose: dict[str, Any], breakage: Callable[[dict[str, Any]], None], expected: str
) -> None:
    """The validator bites: each deliberate breakage is reported, at the place it was made."""
    broken = copy.deepcopy(compose)
    breakage(broken)
    errors = schema_errors(broken)
    assert any(expected in error for error in errors), errors


# --- topology ---------------------------------------------------------------------------------------


def test_required_services_exist(services: dict[str, dict[str, Any]]) -> None:
    assert REQUIRED_SERVICES <= set(services)


@pytest.mark.parametrize("name", sorted(GRPC_PORTS))
def test_grpc_services_serve_and_health_check_their_own_port(
    services: dict[str, dict[str, Any]], name: str
) -> None:
    service = services[name]
    port = GRPC_PORTS[name]
    assert service["command"] == ["ballast", "serve", name]
    assert env_of(service)[f"BALLAST_{name.upper()}_PORT"] == str(port)
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1:4] == ["ballast", "health", f"localhost:{port}"], test
    assert service.get("restart") in {"unless-stopped", "always", "on-failure"}


def test_peer_addresses_point_at_services_on_their_ports(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for key, value in env_of(service).items():
            match = re.fullmatch(r"BALLAST_(STORE|PROFILER|PLANNER)_ADDRESS", key)
            if match:
                peer = match.group(1).lower()
                assert value == f"{peer}:{GRPC_PORTS[peer]}", (name, key, value)
                assert peer in services
            if key == "BALLAST_STORE_READ_ADDRESS":
                assert value == f"store-read:{env_of(service)['BALLAST_STORE_READ_PORT']}", (name, value)


def test_the_read_only_store_serves_its_port_over_the_database_with_a_certificate_for_its_name(
    services: dict[str, dict[str, Any]]
) -> None:
    reader = services["store-read"]
    port = env_of(reader)["BALLAST_STORE_READ_PORT"]
    assert reader["command"] == ["ballast", "serve", "store", "--read-only"]
    assert reader["healthcheck"]["test"][1:4] == ["ballast", "health", f"localhost:{port}"]
    assert reader["depends_on"]["store"] == {"condition": "service_healthy"}
    tls_init = services["tls-init"]["command"]
    assert "store-read" in [tls_init[i + 1] for i, arg in enumerate(tls_init) if arg == "--server-name"]


def test_migrate_runs_once_after_postgres_is_healthy(services: dict[str, dict[str, Any]]) -> None:
    migrate = services["migrate"]
    assert migrate["command"] == ["ballast", "db", "upgrade"]
    assert migrate["restart"] == "no"
    assert depends_on(migrate)["postgres"] == "service_healthy"
    assert services["postgres"]["image"].startswith("postgres:16")
    assert "pg_isready" in services["postgres"]["healthcheck"]["test"]


def test_store_starts_after_migration_completes(services: dict[str, dict[str, Any]]) -> None:
    assert depends_on(services["store"])["migrate"] == "service_completed_successfully"


def test_redis_is_health_checked(services: dict[str, dict[str, Any]]) -> None:
    redis = services["redis"]
    assert redis["image"].startswith("redis:7")
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])


def test_planner_worker_runs_celery_worker(services: dict[str, dict[str, Any]]) -> None:
    worker = services["planner-worker"]
    assert worker["command"] == ["ballast", "worker"]
    assert "ports" not in worker and "container_name" not in worker, "workers must stay scalable"


def test_executor_reserves_nvidia_gpus(services: dict[str, dict[str, Any]]) -> None:
    devices = services["executor"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) and d.get("count") == "all"
        for d in devices
    ), devices


def test_only_store_and_migrate_get_the_database(services: dict[str, dict[str, Any]]) -> None:
    with_db = {name for name, svc in services.items() if "BALLAST_DATABASE_URL" in env_of(svc)}
    assert with_db == DATABASE_CLIENTS
    for name in DATABASE_CLIENTS:
        assert env_of(services[name])["BALLAST_DATABASE_URL"].startswith("postgresql+psycopg://")
        assert "@postgres:5432/" in env_of(services[name])["BALLAST_DATABASE_URL"]


def test_only_store_and_migrate_can_reach_postgres(services: dict[str, dict[str, Any]]) -> None:
    pg_nets = networks_of(services["postgres"])
    sharing = {n for n, svc in services.items() if n != "postgres" and networks_of(svc) & pg_nets}
    assert sharing == DATABASE_CLIENTS


def test_planner_and_workers_get_the_redis_broker(services: dict[str, dict[str, Any]]) -> None:
    for name in BROKER_CLIENTS:
        assert env_of(services[name])["BALLAST_BROKER_URL"].startswith("redis://redis:6379"), name
        assert depends_on(services[name])["redis"] == "service_healthy"
        assert networks_of(services[name]) & networks_of(services["redis"]), name


def test_ballast_services_share_a_network(services: dict[str, dict[str, Any]]) -> None:
    common = set.intersection(*(networks_of(services[n]) for n in [*GRPC_PORTS, "planner-worker"]))
    assert common


def test_only_known_ballast_variables_are_used(services: dict[str, dict[str, Any]]) -> None:
    used = {key for svc in services.values() for key in env_of(svc) if key.startswith("BALLAST_")}
    used |= set(BALLAST_NAME.findall(COMPOSE_FILE.read_text(encoding="utf-8")))
    used |= set(BALLAST_NAME.findall((ROOT / "Dockerfile").read_text(encoding="utf-8")))
    assert used <= KNOWN_BALLAST_VARS, sorted(used - KNOWN_BALLAST_VARS)


def test_secrets_are_required_not_defaulted(services: dict[str, dict[str, Any]]) -> None:
    """The token must come from the operator (`${VAR:?...}`), never a value baked into the file."""
    for name, service in services.items():
        token = env_of(service).get("BALLAST_TOKEN")
        if token is not None:
            assert token.startswith("${BALLAST_TOKEN:?"), name


def test_named_volumes_are_declared(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in services.items():
        for mount in service.get("volumes", []):
            source = mount.split(":", 1)[0] if isinstance(mount, str) else mount.get("source", "")
            if source and not source.startswith((".", "/", "~")):
                assert source in declared, (name, source)
    assert {"postgres", "redis"} <= {n for n, s in services.items() if s.get("volumes")}


def test_services_build_from_the_root_dockerfile(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        if name in THIRD_PARTY:
            continue
        build = service["build"]
        assert build["context"] == "." and build.get("dockerfile", "Dockerfile") == "Dockerfile", name


# --- image ------------------------------------------------------------------------------------------


def test_dockerfile_basics() -> None:
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", text, re.M)
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    assert re.search(r'^CMD \["ballast", "--help"\]$', text, re.M)


def test_dockerfile_torch_pin_matches_pyproject() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    pins = [d for d in pyproject["project"]["dependencies"] if re.match(r"torch\s*==", d)]
    assert len(pins) == 1
    match = re.search(r"^ARG TORCH_VERSION=(\S+)$", (ROOT / "Dockerfile").read_text(encoding="utf-8"), re.M)
    assert match and pins[0].replace(" ", "") == f"torch=={match.group(1)}"


def test_dockerignore_keeps_secrets_and_junk_out_but_sources_in() -> None:
    patterns = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".env", ".git/", ".venv/"} <= patterns
    for needed in ("pyproject.toml", "README.md", "ballast", "services"):
        assert not any(p.rstrip("/") in {needed, f"{needed}/"} or p == "*.md" for p in patterns), needed


# --- monitoring -------------------------------------------------------------------------------------


METRICS_DEFAULTS = {f.name.removesuffix("_metrics_port"): f.default for f in fields(Settings)
                    if f.name.endswith("_metrics_port")}


def test_prometheus_scrapes_every_ballast_process_on_its_metrics_port(services: dict[str, dict[str, Any]]) -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text(encoding="utf-8"))
    mounts = services["prometheus"]["volumes"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts and "tls:/etc/ballast/tls:ro" in mounts
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = {t for job in jobs.values() for c in job.get("static_configs", []) for t in c["targets"]}
    expected = {f"{name}:{METRICS_DEFAULTS[name]}" for name in ("store", "profiler", "planner", "executor")}
    assert targets == expected
    [workers] = jobs["ballast-workers"]["dns_sd_configs"]
    assert (workers["names"], workers["port"]) == (["planner-worker"], METRICS_DEFAULTS["worker"])
    for job in jobs.values():  # HTTPS verified with the plane's CA, presenting its own client certificate
        tls = job["tls_config"]
        assert job["scheme"] == "https" and tls["ca_file"] == "/etc/ballast/tls/ca.crt"
        assert (tls["cert_file"], tls["key_file"]) == ("/etc/ballast/tls/agents/prometheus.crt",
                                                       "/etc/ballast/tls/agents/prometheus.key")
    tls_init = services["tls-init"]["command"]
    assert "planner-worker" in tls_init, "the workers' certificate must name the server_name Prometheus checks"
    assert tls_init[tls_init.index("prometheus") - 1] == "--agent", "tls-init must issue Prometheus's certificate"


def test_the_grafana_dashboard_plots_only_metrics_ballast_exports() -> None:
    from services.runtime import metrics

    exported = {m._name for m in vars(metrics).values() if hasattr(m, "_name") and m._name.startswith("ballast_")}
    exported |= {"ballast_jobs", "ballast_queued_requests", "ballast_leased_devices",  # scrape-time gauges
                 "ballast_queue_jobs", "ballast_queue_oldest_wait_seconds", "ballast_devices"}
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/ballast.json").read_text(encoding="utf-8"))
    used = {name for panel in dashboard["panels"] for t in panel["targets"]
            for name in re.findall(r"ballast_[a-z_]+", t["expr"])}
    base = {re.sub(r"_(bucket|count|sum|total)$", "", n) for n in used}
    names = {re.sub(r"_total$", "", n) for n in exported}
    assert base <= names, sorted(base - names)
    assert len(dashboard["panels"]) >= 12
    provisioned = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/ballast.yml").read_text())
    assert provisioned["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in yaml.safe_load(
        COMPOSE_FILE.read_text(encoding="utf-8"))["services"]["grafana"]["volumes"]
