"""Prometheus metrics: what every process measures (services/runtime/metrics_http.py serves them).

One registry per process (prometheus_client's default). Names follow Prometheus' conventions: units in
the name, `_total` for counters, and no label of unbounded cardinality except `job_id` on the per-job gauges,
whose series are removed when the job ends.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# RPC latency from a few ms (cached reads) to minutes (a WhatIf search, a stream's life)
RPC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

RPC_SECONDS = Histogram("ballast_rpc_duration_seconds", "Time to answer a gRPC call, by server, method and status",
                        ["server", "method", "code"], buckets=RPC_BUCKETS)
STORE_TRANSACTION_SECONDS = Histogram("ballast_store_transaction_duration_seconds",
                                      "Time a store transaction held its connection, by read or write",
                                      ["kind"], buckets=RPC_BUCKETS)
STORE_WRITE_WAIT_SECONDS = Histogram("ballast_store_write_wait_seconds",
                                     "Time a store write waited for SQLite's one writer, by lane (foreground: a "
                                     "caller waits on it; background: a service's own work)",
                                     ["lane"], buckets=RPC_BUCKETS)
STORE_BACKGROUND_WAIT_SECONDS = Histogram("ballast_store_background_wait_seconds",
                                          "Time a service's own store call waited for callers' calls to be "
                                          "served before it started (services/store/gate.py CallGate)",
                                          buckets=RPC_BUCKETS)
ITERATION_SECONDS = Histogram("ballast_iteration_duration_seconds",
                              "Measured training iteration time (each stage and replica's report: one iteration, or "
                              "a window's mean)",
                              buckets=STEP_BUCKETS)
JOB_ITERATION_SECONDS = Gauge("ballast_job_iteration_seconds",
                              "A running job's latest iteration time, measured or predicted by its plan",
                              ["job_id", "source"])
LAYER_MIGRATIONS = Counter("ballast_layer_migrations_total", "Layers moved between stages of running jobs (vPipe)")
MORPHS = Counter("ballast_morphs_total", "Jobs morphed onto another layout, by cause", ["cause"])
TASK_SECONDS = Histogram("ballast_task_duration_seconds", "Queued work run by a planner worker, by kind and outcome",
                         ["kind", "outcome"], buckets=STEP_BUCKETS + (120.0, 300.0))
PLAN_MEMO = Counter("ballast_plan_memo_total", "Plan searches a worker answered from its memo (hit) or ran (miss)",
                    ["outcome"])
# fine below 100 ms, where issue 43's target for an admission pass lies, so a scrape can bound its p99
PASS_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0)
ADMISSION_PASS_SECONDS = Histogram("ballast_admission_pass_seconds",
                                   "One admission pass of the scheduler: snapshot, decision and what it starts",
                                   buckets=PASS_BUCKETS)
DROPPED = Counter("ballast_dropped_total", "Records given up on (never stored), by what they were", ["what"])


def forget_job(job_id: str) -> None:
    """Drop a finished job's per-job series, so they do not pile up."""
    for source in ("measured", "predicted"):
        try:
            JOB_ITERATION_SECONDS.remove(job_id, source)
        except KeyError:
            pass
