"""Fuzz every public RPC with hostile requests (hardening issue): clean statuses only, no hang, no crash.

Target: >= 300 cases for every RPC the store, planner and profiler serve; every answer a clean status (OK, or
a refusal such as INVALID_ARGUMENT that names the field); 0 INTERNAL/UNKNOWN, 0 calls past the 10 s deadline,
0 dead servers; the store consistent afterwards (nothing half-written: tests/fuzzing.py CONSISTENCY). A link
calibration (ProfilerService/Calibrate) measures real collectives between processes it starts, so its
deadline is 120 s (tests/fuzzing.py LONG_S). The cases come from the descriptors (tests/fuzzing.py); the
plane is the tests' harness (real gRPC servers on loopback, SQLite), called as the platform admin, who reaches
every code path. The executor agents' ExecutorControl is left out: an agent serves it to the planner alone.
Run from the repository root:
`.venv/bin/python benchmarks/fuzz.py [--cases 300] [--seed 1] [--only StoreService]`. Exits 1 on a finding.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ballast.client import open_channel
from ballast.transport import client_transport  # noqa: E402
from tests.fuzzing import call, cases, inconsistencies, methods  # noqa: E402
from tests.harness import make_settings, start_plane  # noqa: E402


def fuzz(plane, count: int, seed: int, only: str = "") -> list:
    """Every case of every served RPC; the verdicts, and the servers checked alive after their RPCs."""
    verdicts = []
    for server_name, server in plane.servers.items():
        served = {s for s in server.services if not only or s.endswith(only)}
        channel = open_channel(plane.settings.address(server_name), plane.token, timeout=None,
                           transport=client_transport(plane.settings))
        for method in methods(served):
            started = time.monotonic()
            for n, request in enumerate(cases(method, count, seed)):
                verdicts.append(call(channel, method, request, n))
            print(f"  {method.path}: {count} cases in {time.monotonic() - started:.1f} s, "
                  f"{sum(not v.clean for v in verdicts if v.method == method.path)} finding(s)", flush=True)
        channel.close()
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", default="", help="one service, e.g. StoreService")
    args = parser.parse_args()
    plane = start_plane(make_settings(Path(tempfile.mkdtemp(prefix="ballast-fuzz-"))))
    try:
        verdicts = fuzz(plane, args.cases, args.seed, args.only)
    finally:
        plane.stop()
    broken = {rule: n for rule, n in inconsistencies(plane.settings.database_url).items() if n}
    findings = [v for v in verdicts if not v.clean]
    rpcs = len({v.method for v in verdicts})
    codes = collections.Counter(v.code.name for v in verdicts)
    print(f"fuzz: {len(verdicts)} cases over {rpcs} RPCs ({args.cases} each, seed {args.seed}), "
          f"{platform.machine()} ({os.cpu_count()} cores); statuses: {dict(codes.most_common())}")
    print(f"  clean: {len(verdicts) - len(findings)}/{len(verdicts)}; findings: {len(findings)}")
    print(f"  store afterwards: {'consistent' if not broken else broken}")
    for v in findings[:40]:
        print(f"  FINDING {v.method} case {v.case}: {v.why}: {v.detail[:200]}")
    if findings or broken:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
