"""How an arrival calibration transfers (issue 45): each run a plane's store holds, priced again from its own profile
and plan uncalibrated, with the class's first (arrival) calibration, and with only that fit's host-level parts
(fixed costs, all-reduce; compute at x1), beside what the run measured. No plane is started: it reads the data dir
of one that ran, e.g. `make demo`'s `.ballast-demo`.

    .venv/bin/python benchmarks/arrival_transfer.py [.ballast-demo]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ballast.v1 import store_pb2  # noqa: E402
from services.planner.jobs.calibrate_job import run_of  # noqa: E402
from services.planner.plans.calibrate import WARMUP, from_proto, measured_iteration_s, simulated_s  # noqa: E402
from services.runtime.store_api import every_page  # noqa: E402
from services.store.db import create_engine  # noqa: E402
from services.store.local import LocalStore  # noqa: E402
from services.store.repository import Repository  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_dir", type=Path, nargs="?", default=Path(".ballast-demo"),
                        help="a plane's data dir, ballast.db and admin.token in it (default: make demo's)")
    args = parser.parse_args()
    if not (args.data_dir / "ballast.db").exists():  # `make bench` runs it with no plane behind it: nothing to read
        print(f"{args.data_dir}: no plane's store here; run `make demo` (or name a data dir) first")
        return 0
    repo = Repository(create_engine(f"sqlite:///{args.data_dir / 'ballast.db'}"))
    store = LocalStore(repo, repo.principal_for_token((args.data_dir / "admin.token").read_text().strip()))
    found = [c for page in every_page(store.list_calibrations, store_pb2.ListCalibrationsRequest())
             for c in page.calibrations]
    if not found:
        raise SystemExit(f"{args.data_dir}: no calibration stored")
    first = min(found, key=lambda c: c.version)
    arrival = from_proto(first)
    host_only = replace(arrival, forward_scale=1.0, backward_scale=1.0, forward_fixed_s=0.0, backward_fixed_s=0.0)
    print(f"{first.host_class} version {first.version}: {first.notes or 'the first fit'}")
    jobs = sorted((j for page in every_page(store.list_jobs, store_pb2.ListJobsRequest()) for j in page.jobs),
                  key=lambda j: j.created_at.ToDatetime())
    for job in jobs:
        run = run_of(store, job.id)
        measured = measured_iteration_s(run.metrics, run.plan.version, WARMUP) if run else 0.0
        if not measured:
            continue
        cells = [f"{job.spec.name[:40]:40s} measured {measured * 1e3:6.1f} ms"]
        for name, cal in (("uncalibrated", None), ("arrival fit", arrival), ("host parts only", host_only)):
            predicted = simulated_s(run.profile, run.plan, cal)
            cells.append(f"{name} {predicted * 1e3:6.1f} ({(predicted - measured) / measured:+.1%})")
        print(" | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
