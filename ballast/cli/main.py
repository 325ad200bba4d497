"""The `ballast` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import grpc
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ballast.config import Settings, load_settings

console = Console()
err = Console(stderr=True)


def _settings(args: argparse.Namespace) -> Settings:
    policy = getattr(args, "policy", None)  # `up` / `serve planner --policy FILE` beat BALLAST_FLEET_POLICY
    return load_settings(data_dir=getattr(args, "data_dir", None),
                         fleet_policy=str(Path(policy).resolve()) if policy else None,
                         executor_cpu_slots=getattr(args, "cpu_slots", None))


def _client(settings: Settings):
    from ballast.client import Client

    return Client.of(settings)


def _rpc_failed(exc: grpc.RpcError) -> int:
    err.print(f"[red]error[/red] {exc.code().name}: {exc.details()}")
    return 1


def _status_table(rows: list[tuple[str, str, str]], settings: Settings, restarts: dict[str, int] | None = None
                  ) -> Table:
    from ballast.cli.control_plane import metrics_url

    table = Table("component", "address", "status", "restarts", "metrics")
    for name, address, status in rows:
        colour = "green" if status == "SERVING" else "red"
        table.add_row(name, address, f"[{colour}]{status}[/{colour}]", str((restarts or {}).get(name, 0)),
                      metrics_url(settings, name) or "-")
    return table


def cmd_up(args: argparse.Namespace) -> int:
    from ballast.cli import control_plane as cp

    settings = _settings(args)
    if settings.fleet_policy:
        from services.specs.policy import load_policy_file

        load_policy_file(settings.fleet_policy)  # a file that cannot be read fails here, before anything starts
    emulated = cp.EmulatedFleet(args.emulate_hosts, args.emulate_devices_per_host, args.emulate_device_kind)
    ok, rows, message = cp.bring_up(settings, args.executors, args.timeout, emulated)
    if rows:
        console.print(_status_table(rows, settings))
    if not ok:
        err.print(message)
        return 1
    console.print(message)
    dashboard = next((r[1] for r in rows if r[0] == "dashboard"), "")
    if dashboard:
        console.print(f"dashboard: {dashboard} (log in with a bearer token, e.g. the admin token above)")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from ballast.cli import control_plane as cp

    settings = _settings(args)
    state = cp.State.load(settings)
    if state is None:
        console.print(f"nothing running in {settings.data_dir}")
        return 0
    killed = cp.stop_all(settings, state)
    if killed:
        err.print(f"force-killed after timeout: {', '.join(killed)}")
    console.print(f"stopped {len(state.children)} processes")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from ballast.cli import control_plane as cp

    settings = _settings(args)
    state = cp.State.load(settings)
    if state is None:
        err.print(f"nothing running in {settings.data_dir}; start it with `ballast up`")
        return 1
    rows = cp.statuses(settings, state)
    restarts = {c.name: c.restarts for c in state.children}
    if args.json:
        from ballast.cli.control_plane import metrics_url

        print(json.dumps([{"component": n, "address": a, "status": s, "metrics": metrics_url(settings, n),
                           "restarts": restarts.get(n, 0)} for n, a, s in rows]))
    else:
        console.print(_status_table(rows, settings, restarts))
        if state.supervisor and not cp.alive(state.supervisor):
            err.print("the supervisor is not running: a process that dies stays down (`ballast down`, then `up`)")
    warning = cp.low_space(settings)
    if warning:
        err.print(f"[yellow]warning[/yellow] {warning}")
    return 0 if all(r[2] == "SERVING" for r in rows) else 1


def cmd_db(args: argparse.Namespace) -> int:
    from services.store import schema

    settings = _settings(args)
    if args.action == "upgrade":
        schema.upgrade(settings.database_url, args.revision or "head")
        if settings.sql_password and schema.set_readonly_password(settings.database_url, settings.sql_password):
            console.print("set the password of the read-only SQL login (ballast_readonly)")
    elif args.action == "downgrade":
        schema.downgrade(settings.database_url, args.revision or "base")
    current = schema.current_revision(settings.database_url)
    console.print(f"database at revision {current or 'none'} (head {schema.head_revision()})")
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    settings = _settings(args)
    with _client(settings) as client:
        try:
            result = client.sql(args.query, limit=args.limit, timeout=args.timeout)
        except grpc.RpcError as exc:
            return _rpc_failed(exc)
    if args.json:
        print(json.dumps({"columns": result.columns, "rows": result.rows, "truncated": result.truncated}))
        return 0
    table = Table(*result.columns)
    for row in result.rows:
        table.add_row(*["NULL" if v is None else escape(str(v)) for v in row])  # values are data, not markup
    console.print(table)
    if result.truncated:
        err.print(f"(truncated at {args.limit or 1000} rows; raise --limit)")
    return 0


def cmd_tenant(args: argparse.Namespace) -> int:
    from ballast.v1 import common_pb2, store_pb2

    settings = _settings(args)
    with _client(settings) as client:
        try:
            if args.action == "rotate":  # the old token stops working (within the services' 5 s cache)
                reply = client.store.RotateTenantToken(store_pb2.RotateTenantTokenRequest(tenant_id=args.name))
            else:
                from ballast.cli.audit import ROLES

                role = ROLES["admin" if args.admin else args.role]
                reply = client.store.CreateTenant(store_pb2.CreateTenantRequest(name=args.name, role=role))
        except grpc.RpcError as exc:
            return _rpc_failed(exc)
    role = common_pb2.TenantRole.Name(reply.tenant.role).removeprefix("TENANT_ROLE_").lower()
    console.print(f"tenant {reply.tenant.name} ({reply.tenant.id}, {role}); token (shown once):")
    print(reply.token)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from services.runtime.logs import configure_logging

    if args.policy and args.service != "planner":
        err.print(f"[red]error[/red] --policy is the planner's option, not the {args.service}'s: "
                  "use `ballast serve planner --policy FILE`")
        return 2
    if args.read_only and args.service != "store":
        err.print(f"[red]error[/red] --read-only is the store's option, not the {args.service}'s: "
                  "use `ballast serve store --read-only`")
        return 2
    if args.emulate and args.service != "executor":
        err.print(f"[red]error[/red] --emulate is the executor's option, not the {args.service}'s: "
                  "use `ballast serve executor --emulate N`")
        return 2
    if args.emulate < 0 or args.devices_per_host < 1 or not 0 <= args.noise < 1 or args.first_host < 0:
        err.print("[red]error[/red] --emulate and --first-host must be >= 0, --devices-per-host >= 1 and --noise "
                  "in [0, 1)")
        return 2
    settings = _settings(args)
    configure_logging("store-read" if args.read_only else args.service, settings.log_level, settings.log_format)
    if args.service == "store":
        from services.store.service import main as serve_store

        freeze_startup_heap()
        return serve_store(settings, read_only=args.read_only)
    if args.service == "profiler":
        from services.profiler.service import main
    elif args.service == "planner":
        from services.planner.service import main
    elif args.service == "dashboard":
        from services.dashboard.service import main
    elif args.emulate:
        from services.executor.emulated import Behaviour
        from services.executor.emulated_hosts import main as emulate

        freeze_startup_heap()
        return emulate(settings, args.emulate, args.devices_per_host, args.device_kind,
                       Behaviour(noise=args.noise, seed=args.seed), first=args.first_host)
    else:
        from services.executor.agent import main as agent_main

        freeze_startup_heap()
        return agent_main(settings, args.index)
    freeze_startup_heap()
    return main(settings)


def freeze_startup_heap() -> None:
    """Move what importing the service made (~125k objects: modules, classes, protobuf descriptors) out of
    the cyclic collector's reach. A full collection scans every tracked object while holding the GIL, and
    with those objects in it each one stalled every call in flight by 70-90 ms under load (measured in the
    store, benchmarks/load.py); without them it takes a few ms. They live as long as the process anyway."""
    import gc

    gc.collect()
    gc.freeze()


def cmd_worker(args: argparse.Namespace) -> int:
    from services.planner.celery_app import run_worker
    from services.runtime.logs import configure_logging

    settings = _settings(args)
    configure_logging("worker", settings.log_level, settings.log_format)
    return run_worker(settings)


def cmd_health(args: argparse.Namespace) -> int:
    from ballast.health import check
    from ballast.transport import client_transport

    status = check(args.address, args.service, args.timeout, client_transport(_settings(args)))
    print(status)
    return 0 if status == "SERVING" else 1


def cmd_tls(args: argparse.Namespace) -> int:
    from ballast.tls import init_bundle

    written = init_bundle(args.ca_dir, args.out, args.server_name, args.agent)
    for path in written:
        console.print(f"wrote {path}")
    console.print(f"certificates in {args.out} ({len(written)} new); the CA key stays in {args.ca_dir}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from ballast.cli.profile import run

    return run(_settings(args), args)


def cmd_plan(args: argparse.Namespace) -> int:
    from ballast.cli.plan import run_plan

    return run_plan(_settings(args), args)


def cmd_explain(args: argparse.Namespace) -> int:
    from ballast.cli.plan import run_explain

    return run_explain(_settings(args), args)


def cmd_submit(args: argparse.Namespace) -> int:
    from ballast.cli.jobs import run_submit

    return run_submit(_settings(args), args)


def cmd_cancel(args: argparse.Namespace) -> int:
    from ballast.cli.jobs import run_cancel

    return run_cancel(_settings(args), args)


def cmd_export(args: argparse.Namespace) -> int:
    from ballast.cli.jobs import run_export

    return run_export(_settings(args), args)


def cmd_evaluations(args: argparse.Namespace) -> int:
    from ballast.cli.evaluations import run

    return run(_settings(args), args)


def cmd_data(args: argparse.Namespace) -> int:
    from ballast.cli.data import run

    return run(args)


def cmd_inspect(args: argparse.Namespace) -> int:
    from ballast.cli.inspect import run

    return run(_settings(args), args)


def cmd_watch(args: argparse.Namespace) -> int:
    from ballast.cli.jobs import run_watch

    return run_watch(_settings(args), args)


def cmd_queue(args: argparse.Namespace) -> int:
    from ballast.cli.fleet import run_queue

    return run_queue(_settings(args), args)


def cmd_fleet(args: argparse.Namespace) -> int:
    from ballast.cli.fleet import run_fleet

    return run_fleet(_settings(args), args)


def cmd_policy(args: argparse.Namespace) -> int:
    from ballast.cli.fleet import run_policy

    return run_policy(_settings(args), args)


def cmd_audit(args: argparse.Namespace) -> int:
    from ballast.cli.audit import run

    return run(_settings(args), args)


def cmd_fidelity(args: argparse.Namespace) -> int:
    from ballast.cli.fidelity import run

    return run(_settings(args), args)


def cmd_supervise(args: argparse.Namespace) -> int:
    from ballast.cli.supervise import run_supervisor

    return run_supervisor(_settings(args))


def cmd_demo(args: argparse.Namespace) -> int:
    from ballast.cli.demo import run_demo

    return run_demo(_settings(args), args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ballast", description="Ballast training control plane")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, fn, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--data-dir", type=Path, default=None,
                       help="data directory (default $BALLAST_DATA_DIR or ~/.ballast)")
        p.set_defaults(fn=fn)
        return p

    p = add("up", cmd_up, "start store, profiler, planner, a worker and N executor agents")
    p.add_argument("--executors", type=int, default=2)
    from ballast.cli.jobs import device_count, device_kind

    p.add_argument("--cpu-slots", type=device_count("--cpu-slots", 1, "slots"), default=None, metavar="N",
                   help="CPU worker slots (devices) per executor agent on a host without GPUs (default "
                        "$BALLAST_EXECUTOR_CPU_SLOTS or 1)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for SERVING")
    p.add_argument("--policy", type=Path, default=None, metavar="FILE",
                   help="fleet policy YAML the planner stores at start-up if it differs from the policy in force "
                        "(default $BALLAST_FLEET_POLICY)")
    p.add_argument("--emulate-hosts", type=device_count("--emulate-hosts", 0, "hosts"), default=0, metavar="N",
                   help="also N emulated hosts in one process, beside or instead of --executors (real agents whose "
                        "workers advance at the plan's predicted time: `ballast serve executor --emulate`)")
    p.add_argument("--emulate-devices-per-host", type=device_count("--emulate-devices-per-host", 1, "devices"),
                   default=8, metavar="D", help="devices per emulated host (default 8)")
    p.add_argument("--emulate-device-kind", type=device_kind("--emulate-device-kind"), default="nvidia-h100-sxm-80gb",
                   metavar="KIND",
                   help="catalog device kind of the emulated hosts (default nvidia-h100-sxm-80gb)")
    add("down", cmd_down, "stop everything `ballast up` started")
    p = add("status", cmd_status, "health of every component (exit 0 only if all SERVING)")
    p.add_argument("--json", action="store_true")
    p = add("db", cmd_db, "database schema: upgrade | downgrade | current")
    p.add_argument("action", choices=["upgrade", "downgrade", "current"])
    p.add_argument("revision", nargs="?", default=None)
    p = add("sql", cmd_sql, "run a read-only SQL query (platform admin)")
    p.add_argument("query")
    p.add_argument("--json", action="store_true")
    p.add_argument("--limit", type=int, default=0, help="row limit (default 1000)")
    p.add_argument("--timeout", type=float, default=0, help="statement timeout in seconds (default 10)")
    p = add("tenant", cmd_tenant, "create a tenant, or rotate its token (the old one is revoked); print the new token")
    p.add_argument("action", choices=["create", "rotate"])
    p.add_argument("name", help="the new tenant's name (create), or the tenant's id (rotate)")
    p.add_argument("--role", choices=["member", "viewer", "admin"], default="member",
                   help="create: member (its own jobs), viewer (reads every tenant's, changes nothing: dashboards) "
                        "or admin")
    p.add_argument("--admin", action="store_true", help="the same as --role admin")
    p = add("audit", cmd_audit, "the audit log: who changed what, when, and the result (newest first)")
    from ballast.cli.audit import add_arguments as add_audit_arguments

    add_audit_arguments(p)
    p = add("serve", cmd_serve, "run one service in the foreground")
    p.add_argument("service", choices=["store", "profiler", "planner", "executor", "dashboard"])
    p.add_argument("--index", type=int, default=0, help="executor agent index (port = executor port + index)")
    p.add_argument("--policy", type=Path, default=None, metavar="FILE",
                   help="planner only: fleet policy YAML stored at start-up if it differs from the policy in force "
                        "(default $BALLAST_FLEET_POLICY)")
    p.add_argument("--read-only", action="store_true",
                   help="store only: serve the read-only RPCs on the store read port, refusing writes "
                        "(`ballast up` starts one beside the store)")
    p.add_argument("--emulate", type=int, default=0, metavar="N",
                   help="executor only: run N emulated hosts in this process (real agents; workers that advance at "
                        "the plan's predicted time instead of training: scale tests without GPUs)")
    p.add_argument("--devices-per-host", type=int, default=8, help="with --emulate: devices per emulated host")
    p.add_argument("--device-kind", type=device_kind("--device-kind"), default="nvidia-h100-sxm-80gb",
                   help="with --emulate: the catalog device kind of every emulated device")
    p.add_argument("--noise", type=float, default=0.02,
                   help="with --emulate: relative spread of an iteration's time around the prediction")
    p.add_argument("--seed", type=int, default=0, help="with --emulate: seed of that noise")
    p.add_argument("--first-host", type=int, default=0, metavar="K",
                   help="with --emulate: number this process's hosts from K (emu-K, ...): several emulator "
                        "processes make one fleet")
    add("worker", cmd_worker, "run a Celery planner worker in the foreground")
    add("supervise", cmd_supervise, "restart the processes `ballast up` started when one dies (`up` runs it)")
    p = add("health", cmd_health, "gRPC health check (exit 0 iff SERVING)")
    p.add_argument("address")
    p.add_argument("--service", default="")
    p.add_argument("--timeout", type=float, default=2.0)
    p = add("tls", cmd_tls, "issue a CA, a server certificate and agent certificates (compose, production)")
    p.add_argument("action", choices=["init"])
    p.add_argument("--ca-dir", type=Path, required=True, help="where the CA certificate and key live (kept private)")
    p.add_argument("--out", type=Path, required=True, help="where ca.crt, server.crt/key and agents/NAME.crt/key go")
    p.add_argument("--server-name", action="append", default=[], metavar="NAME",
                   help="a name or IP clients dial the servers by (repeatable; localhost is always included)")
    p.add_argument("--agent", action="append", default=[], metavar="HOST",
                   help="an executor agent's host name: its certificate's CN, which it registers as (repeatable)")
    p = add("profile", cmd_profile, "profile a model layer by layer (per-layer table, optional projection)")
    from ballast.cli.profile import add_arguments

    add_arguments(p)
    from ballast.cli.plan import add_explain_arguments, add_plan_arguments

    p = add("plan", cmd_plan, "profile a model for a fleet and search its plan (stages, per-layer table, baselines)")
    add_plan_arguments(p)
    p = add("explain", cmd_explain, "a stored plan: its explanation, per-layer strategies and alternatives")
    add_explain_arguments(p)
    from ballast.cli.jobs import add_cancel_arguments, add_export_arguments, add_submit_arguments, add_watch_arguments

    p = add("inspect", cmd_inspect, "check a model against Ballast's rules and list the layers it is cut into "
                                    "(your own factory or Hugging Face model before you submit it)")
    p.add_argument("spec", help="model spec YAML (e.g. examples/user-mlp.yaml)")
    p.add_argument("--json", action="store_true")
    from ballast.cli.jobs import add_data_arguments

    add_data_arguments(p)
    p = add("submit", cmd_submit, "submit a training job (profiled, planned and run by the control plane)")
    add_submit_arguments(p)
    p = add("watch", cmd_watch, "follow a job's events (state changes, plan, progress)")
    add_watch_arguments(p)
    p = add("cancel", cmd_cancel, "cancel a job (at once if nothing runs it yet, else once its workers stopped)")
    add_cancel_arguments(p)
    p = add("evaluations", cmd_evaluations, "a job's validation losses (--eval-every) beside its training loss")
    from ballast.cli.evaluations import add_arguments as add_evaluations_arguments

    add_evaluations_arguments(p)
    p = add("data", cmd_data, "prepare data on this machine: `data tokenize TEXT --out DIR` writes token files")
    from ballast.cli.data import add_data_arguments as add_tokenize_arguments

    add_tokenize_arguments(p)
    p = add("export", cmd_export, "write a job's trained weights into a directory (safetensors, torch or a Hugging "
                                  "Face save_pretrained directory), streamed from the planner")
    add_export_arguments(p)
    from ballast.cli.fleet import add_fleet_arguments, add_policy_arguments, add_queue_arguments

    p = add("queue", cmd_queue, "the shared fleet's queue in admission order: why each job waits, when it starts")
    add_queue_arguments(p)
    p = add("fleet", cmd_fleet, "every device: online or degraded, which job leases it since when, use over the "
                                "last hour; `fleet clear HOST --reason TEXT` gives a degraded host back (admin)")
    add_fleet_arguments(p)
    p = add("policy", cmd_policy, "the fleet policy: `policy show [--version N]`, `policy set FILE` (admin)")
    add_policy_arguments(p)
    p = add("fidelity", cmd_fidelity, "predicted against measured iteration time and peak memory over the stored "
                                      "runs, by model, layout and host class (optionally a PNG plot)")
    from ballast.cli.fidelity import add_arguments as add_fidelity_arguments

    add_fidelity_arguments(p)
    p = add("demo", cmd_demo, "up, train examples/gpt-tiny.yaml on local CPU executors, report, shut down")
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--executors", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iterations", type=int, default=30)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse, then the checks that span flags (a subcommand's `check` default): exit 2 with the subcommand's
    usage and the problem, before anything is sent."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check = getattr(args, "check", None)
    problem = check(args) if check else None
    if problem:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(problem)
    return args


# The commands that run the plane or a part of it: what they write in the data dir (the database and its WAL, logs,
# checkpoints, executor folders, tokens) is the operator's alone, 0600 files in 0700 folders, and so is what their
# children (services, workers) write. Other commands leave the user's umask alone (an export is the user's file).
PLANE_COMMANDS = ("up", "serve", "worker", "demo", "supervise")
PRIVATE_UMASK = 0o077


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command in PLANE_COMMANDS:
        os.umask(PRIVATE_UMASK)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - a CLI prints the reason, not a traceback
        from ballast.errors import ClientError
        from ballast.tls import TlsError
        from services.runtime.errors import BallastError

        if isinstance(exc, BallastError | ClientError | TlsError):
            err.print(f"[red]error[/red] {escape(str(exc))}")
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
