"""Bad input is INVALID_ARGUMENT naming the field and the fix on every backend, never a database error
(a value SQLite would take may not fit PostgreSQL's columns); error messages quote ids briefly.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf import timestamp_pb2

from ballast.v1 import fleet_pb2, job_pb2, profile_pb2, queue_pb2, store_pb2
from services.runtime.errors import InvalidArgument, NotFound
from tests.store_builders import page, plan_msg, profile_msg
from tests.store_fixtures import Store, claim, enqueue, events, new_job


def test_out_of_range_input_is_invalid_argument_on_every_backend(store: Store):
    a, admin = store.as_(store.a), store.as_(store.admin)
    job = new_job(store)
    rid = enqueue(store, '{"bad": 1}').request.id
    lease = claim(store, rid, "w1").request.lease_token
    big, long = 2**64 - 1, "k" * 300
    nan, inf = math.nan, math.inf

    def metrics(**kw) -> Callable[[], Any]:
        msg = job_pb2.IterationMetric(**{"job_id": job.id, "iteration": 1, **kw})
        return lambda: a.write_iteration_metrics(store_pb2.WriteIterationMetricsRequest(metrics=[msg]))

    def profile(pr: profile_pb2.Profile) -> Callable[[], Any]:
        return lambda: a.create_profile(store_pb2.CreateProfileRequest(profile=pr))

    def host(h: fleet_pb2.Host) -> Callable[[], Any]:
        return lambda: admin.register_host(store_pb2.RegisterHostRequest(host=h))

    huge_layer = profile_msg(job.model_id)
    huge_layer.layers[1].parameter_count = big
    bad_sample = profile_msg(job.model_id)
    bad_sample.layers[0].samples[1].forward_s = inf
    far_token = base64.urlsafe_b64encode(json.dumps({"o": 2**70}).encode()).decode()
    big_plan = plan_msg(job.model_id, job_id=job.id)
    big_plan.version = 2**31
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("metrics[0].peak_memory_bytes", metrics(peak_memory_bytes=big)),
        ("metrics[0].iteration", metrics(iteration=2**31)),  # INTEGER is 32-bit on PostgreSQL
        ("metrics[0].recorded_at", metrics(recorded_at=timestamp_pb2.Timestamp(seconds=10**12))),
        ("metrics[0].recorded_at", metrics(recorded_at=timestamp_pb2.Timestamp(seconds=1, nanos=-5))),
        ("metrics[0].loss", metrics(loss=nan, has_loss=True)),
        ("metrics[0].iteration_time_s", metrics(iteration_time_s=inf)),
        (
            "checkpoint.layers[0].bytes",
            lambda: a.create_checkpoint(
                store_pb2.CreateCheckpointRequest(
                    checkpoint=job_pb2.Checkpoint(
                        job_id=job.id, layers=[job_pb2.LayerCheckpoint(
                            layer_index=0, uri=f"/c/{job.id}/iter-00000000/layer-00000.pt", bytes=big)]
                    )
                )
            ),
        ),
        (
            "migration.bytes",
            lambda: a.record_layer_migration(
                store_pb2.RecordLayerMigrationRequest(migration=job_pb2.LayerMigration(job_id=job.id, bytes=big))
            ),
        ),
        ("profile.layers[1].parameter_count", profile(huge_layer)),
        ("profile.layers[0].samples[1].forward_s", profile(bad_sample)),
        ("profile.device.kind", profile(profile_msg(job.model_id, kind=long))),
        (
            "after_seq",
            lambda: a.list_job_events(store_pb2.ListJobEventsRequest(job_id=job.id, after_seq=big)),
        ),
        ("page.page_token", lambda: a.list_jobs(store_pb2.ListJobsRequest(page=page(1, far_token)))),
        ("lease_seconds", lambda: claim(store, rid, "w2", lease=1e300)),
        ("lease_seconds", lambda: claim(store, rid, "w2", lease=inf)),
        ("lease_seconds", lambda: claim(store, rid, "w2", lease=nan)),
        (
            "lease_seconds",
            lambda: admin.renew_lease(store_pb2.RenewLeaseRequest(id=rid, lease_token=lease, lease_seconds=1e300)),
        ),
        ("worker", lambda: claim(store, rid, long)),
        (
            "queued_stale_s",
            lambda: admin.reap_expired_leases(store_pb2.ReapExpiredLeasesRequest(queued_stale_s=1e300)),
        ),
        (
            "queued_stale_s",
            lambda: admin.reap_expired_leases(store_pb2.ReapExpiredLeasesRequest(queued_stale_s=nan)),
        ),
        ("seen_within_s", lambda: a.list_workers(store_pb2.ListWorkersRequest(seen_within_s=1e300))),
        ("seen_within_s", lambda: a.list_workers(store_pb2.ListWorkersRequest(seen_within_s=inf))),
        ("host.name", host(fleet_pb2.Host(name=long))),
        (
            "host.devices[0].spec.kind",
            host(fleet_pb2.Host(name="h1", devices=[fleet_pb2.Device(spec=fleet_pb2.DeviceSpec(kind=long))])),
        ),
        (
            "host.devices[0].spec.memory_bytes",
            host(
                fleet_pb2.Host(
                    name="h1", devices=[fleet_pb2.Device(spec=fleet_pb2.DeviceSpec(kind="cpu", memory_bytes=big))]
                )
            ),
        ),
        ("host.agent_port", host(fleet_pb2.Host(name="h1", agent_port=2**32 - 1))),
        ("kind", lambda: a.enqueue_request(store_pb2.EnqueueRequestRequest(kind=long, payload_json="{}"))),
        ("spec.name", lambda: new_job(store, name=long)),
        (
            "event.type",
            lambda: a.append_job_event(
                store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(job_id=job.id, type=long))
            ),
        ),
        (
            "event.message",
            lambda: a.append_job_event(
                store_pb2.AppendJobEventRequest(event=job_pb2.JobEvent(job_id=job.id, type="T", message="a\x00b"))
            ),
        ),
        ("plan.version", lambda: a.create_plan(store_pb2.CreatePlanRequest(plan=big_plan))),
        (
            "heartbeat.name",
            lambda: admin.record_worker_heartbeat(
                store_pb2.RecordWorkerHeartbeatRequest(heartbeat=queue_pb2.WorkerHeartbeat(name=long))
            ),
        ),
    ]
    for field, call in cases:
        with pytest.raises(InvalidArgument) as err:
            call()
        assert err.value.field == field, (field, str(err.value))
        assert err.value.fix, field
    for table in ("iteration_metrics", "checkpoints", "layer_migrations", "profiles", "hosts", "plans", "workers"):
        assert store.count(table) == 0, table
    assert store.count("jobs") == 1 and store.count("queued_requests") == 1 and len(events(store, job.id)) == 1


def test_ids_quoted_in_errors_are_truncated(store: Store):
    huge = "x" * 10_000
    for call in (
        lambda: store.as_(store.a).get_job(store_pb2.GetRequest(id=huge)),
        lambda: store.as_(store.a).get_checkpoint(store_pb2.GetRequest(id=huge)),
        lambda: store.as_(store.a).get_tenant(store_pb2.GetRequest(id=huge)),
    ):
        with pytest.raises(NotFound) as err:
            call()
        assert len(str(err.value)) < 200 and "x" * 64 + "…" in str(err.value)
    with pytest.raises(InvalidArgument) as err:
        store.as_(store.admin).create_tenant(store_pb2.CreateTenantRequest(name=huge))
    assert len(str(err.value)) < 300
