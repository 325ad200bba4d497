"""The plane at fleet scale (issue 43): emulated hosts connected to one planner, and what each costs it.

    .venv/bin/python benchmarks/fleet_scale.py connect --hosts 4096 --seconds 60
    .venv/bin/python benchmarks/fleet_scale.py connect --hosts 1024 --seconds 600 --database-url postgresql+psycopg://...

`connect` starts a plane with `ballast up --executors 0`, samples its services idle, starts emulator processes of
1,024 hosts each (`ballast serve executor --emulate`, real agents whose workers are emulated), waits until every
host is ONLINE, then samples again over `--seconds`. It prints, per service, CPU-seconds per minute and RSS
before and with the fleet; the planner's RSS and CPU per connected host; the heartbeat lag (the store's
`last_heartbeat_at` behind the clock, read every 5 s: the planner writes it for the whole fleet once per
interval, so it runs up to one heartbeat interval plus one write interval); and the hosts not ONLINE at the end
(must be 0: nothing marked lost that was not).

`replay` (benchmarks/fleet_replay.py) runs a seeded, time-compressed job trace through the plane on emulated hosts,
losing hosts as it goes, beside the simulator's replay of the same trace:

    .venv/bin/python benchmarks/fleet_scale.py replay --jobs 2000 --hosts 1024 --losses 100 --database-url ...
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sqlalchemy as sa  # noqa: E402

from benchmarks import fleet_replay  # noqa: E402
from benchmarks.fleet_probe import Sample, hosts_by_state, per_minute, plane_pids, usage  # noqa: E402
from benchmarks.load import ballast, pct  # noqa: E402
from tests.harness import ROOT, make_settings, settings_env  # noqa: E402

HOSTS_PER_PROCESS = 1024
LAG_EVERY_S = 5.0
IDLE_TARGET = 0.25  # the planner's share of one core with 1,024 idle hosts (issue 43's acceptance)


def connect(args: argparse.Namespace) -> bool:
    overrides = {"database_url": args.database_url} if args.database_url else {}
    settings = make_settings(Path(tempfile.mkdtemp(prefix="ballast-fleet-")), agent_heartbeat_s=args.heartbeat_s,
                             **overrides)
    env = settings_env(settings)
    ballast(env, "up", "--executors", "0")
    emulators: list[subprocess.Popen] = []
    try:
        pids = plane_pids(settings.data_dir)
        time.sleep(args.settle)
        idle = usage(pids)
        time.sleep(args.settle)
        bare = usage(pids)
        started = time.monotonic()
        logs = settings.data_dir / "logs"
        for first in range(0, args.hosts, HOSTS_PER_PROCESS):
            count = min(HOSTS_PER_PROCESS, args.hosts - first)
            with open(logs / f"emulator-{first}.log", "w") as log:
                emulators.append(subprocess.Popen(
                    [sys.executable, "-m", "ballast", "serve", "executor", "--emulate", str(count), "--first-host",
                     str(first)], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        engine = sa.create_engine(settings.database_url)
        while (online := hosts_by_state(engine)[0].get("ONLINE", 0)) < args.hosts:
            if time.monotonic() - started > args.timeout:
                print(f"only {online} of {args.hosts} hosts ONLINE after {args.timeout:.0f} s")
                return False
            time.sleep(2.0)
        connected_s = time.monotonic() - started
        time.sleep(args.settle)
        pids.update({f"emulator-{i}": p.pid for i, p in enumerate(emulators)})
        before = usage(pids)
        lags: list[float] = []
        while time.monotonic() - before.at < args.seconds:  # the lag read every few seconds across the window
            time.sleep(min(LAG_EVERY_S, max(0.0, args.seconds - (time.monotonic() - before.at))))
            lags += hosts_by_state(engine)[1]
        after = usage(pids)
        states = hosts_by_state(engine)[0]
        engine.dispose()
    finally:
        for emulator in emulators:
            emulator.terminate()
        for emulator in emulators:
            emulator.wait(timeout=60)
        ballast(env, "down")
    report(args, settings.database_url, idle, bare, before, after, connected_s, states, lags)
    planner_share = per_minute(before, after, "planner") / 60.0
    return states.get("ONLINE", 0) == args.hosts and (args.hosts > 1024 or planner_share <= IDLE_TARGET)


def report(args, url: str, idle: Sample, bare: Sample, before: Sample, after: Sample, connected_s: float,
           states: dict[str, int], lags: list[float]) -> None:
    hosts = args.hosts
    print(f"fleet_scale connect: {hosts} hosts x 8 emulated devices, heartbeat every {args.heartbeat_s:g} s, "
          f"store {url.split(':', 1)[0]}; sampled {after.at - before.at:.0f} s")
    print(f"  all {hosts} hosts ONLINE {connected_s:.0f} s after the emulators started")
    print(f"  {'process':<14} {'CPU-s/min idle':>15} {'CPU-s/min fleet':>16} {'RSS MB idle':>12} "
          f"{'RSS MB fleet':>13}")
    for name in sorted(after.cpu_s):
        print(f"  {name:<14} {per_minute(idle, bare, name) if name in bare.cpu_s else float('nan'):>15.2f} "
              f"{per_minute(before, after, name):>16.2f} {bare.rss_mb.get(name, float('nan')):>12.0f} "
              f"{after.rss_mb[name]:>13.0f}")
    planner = per_minute(before, after, "planner")
    print(f"  planner per connected host: {(after.rss_mb['planner'] - bare.rss_mb['planner']) * 1024 / hosts:.0f} KB "
          f"RSS, {(planner - per_minute(idle, bare, 'planner')) * 1e3 / hosts:.2f} ms CPU per minute; "
          f"{planner / 60:.0%} of one core in all (target with 1,024 hosts: <= {IDLE_TARGET:.0%})")
    print(f"  heartbeat lag p50 {pct(lags, 0.5):.1f} s, p99 {pct(lags, 0.99):.1f} s, max {max(lags, default=0):.1f} s")
    print(f"  hosts by state at the end: {states} (every one ONLINE: nothing marked lost that was not)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="phase", required=True)
    p = sub.add_parser("connect", help="connect N emulated hosts and measure what they cost idle")
    p.add_argument("--hosts", type=int, default=1024)
    p.add_argument("--seconds", type=float, default=60.0, help="how long the connected fleet is sampled")
    p.add_argument("--heartbeat-s", type=float, default=2.0, help="BALLAST_AGENT_HEARTBEAT_S for the plane")
    p.add_argument("--settle", type=float, default=20.0, help="seconds before each idle sample")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for every host to come ONLINE")
    p.add_argument("--database-url", default="", help="the store's database (default: SQLite in the data dir)")
    fleet_replay.add_arguments(sub)
    args = parser.parse_args()
    if args.phase == "replay":
        return 0 if fleet_replay.run(args) else 1
    if args.hosts < 1 or args.seconds <= 0 or args.heartbeat_s <= 0:
        parser.error("--hosts must be >= 1, --seconds and --heartbeat-s > 0")
    return 0 if connect(args) else 1


if __name__ == "__main__":
    sys.exit(main())
