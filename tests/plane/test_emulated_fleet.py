"""256 emulated hosts x 8 devices through the live plane (issue 43's slow test; benchmarks/fleet_scale.py holds
1,024 and 4,096): every host connects to the one planner and stays online, jobs submitted together run side by
side to SUCCEEDED on devices of their own, a lost host morphs its job onto the others, and no device is ever
leased to two jobs at once."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from ballast.v1 import job_pb2, services_pb2, store_pb2
from services.store.db import create_engine
from tests.harness import emulated_plane, online_hosts, wait_for
from tests.plane.test_emulated import ended, spec
from tests.store_fixtures import OVERLAPS

pytestmark = pytest.mark.slow

S = job_pb2.JobState
HOSTS, DEVICES, JOBS, JOB_DEVICES = 256, 8, 6, 32


def test_a_256_host_fleet_runs_jobs_side_by_side_and_morphs_one_off_a_lost_host(tmp_path):
    with emulated_plane(tmp_path, f"fleet-{uuid.uuid4().hex[:8]}", HOSTS, DEVICES, host_lost_s=3.0) as (plane, fleet):
        client = plane.client()
        hosts = online_hosts(client)
        assert len(hosts) == HOSTS and len({h.address for h in hosts}) == HOSTS
        morphing = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec("fleet-morph", 400, JOB_DEVICES)))
        others = [client.jobs.Submit(services_pb2.SubmitJobRequest(spec=spec(f"fleet-{i}", 60, JOB_DEVICES)))
                  for i in range(JOBS - 1)]
        wait_for(lambda: any(m.iteration >= 30 for m in client.iteration_metrics(morphing.id)), timeout=240,
                 what="the job to train past its first checkpoint")
        leases = client.store.ListLeases(store_pb2.ListLeasesRequest(job_id=morphing.id, live_only=True)).leases
        victim = client.store.GetHost(store_pb2.GetRequest(id=leases[0].device.host_id)).name
        assert fleet.lose(victim) > 0

        done = {job.id: ended(client, job.id, plane.settings.data_dir, timeout=300) for job in [morphing, *others]}
        assert {j.state for j in done.values()} == {S.JOB_STATE_SUCCEEDED}, [j.message for j in done.values()]
        events = [e.type for e in client.store.ListJobEvents(
            store_pb2.ListJobEventsRequest(job_id=morphing.id)).events]
        assert events.count("ASSIGNED") >= 2  # started again after the loss, on other hosts
        assert len(online_hosts(client)) == HOSTS - 1  # the lost one only: nothing else was marked lost
        engine = create_engine(plane.settings.database_url)
        try:
            with engine.connect() as conn:
                assert conn.execute(sa.text(OVERLAPS)).scalar_one() == 0
                live = conn.execute(sa.text("SELECT count(*) FROM device_leases WHERE ended_at IS NULL")).scalar_one()
            assert live == 0
        finally:
            engine.dispose()

        def span(job_id: str) -> tuple[float, float]:
            leases = client.store.ListLeases(store_pb2.ListLeasesRequest(job_id=job_id)).leases
            return (min(x.started_at.ToMicroseconds() for x in leases),
                    max(x.ended_at.ToMicroseconds() for x in leases))

        first, last = span(morphing.id)
        assert any(start < last and first < end for start, end in map(span, (j.id for j in others)))  # side by side
