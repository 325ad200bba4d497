"""The planner's online loop on a real store: stage statistics in, a priced repartition out as a new plan version
and a Repartition instruction per host; acks from every host put the plan in force; each migrated layer is one
row; an agent that reconnects running a newer version than the store knows gets it adopted. And when a worker
dies, the job's failure names it, not the peer that only saw a broken collective."""

from __future__ import annotations

import pytest

from ballast.v1 import executor_pb2, fleet_pb2, job_pb2, model_pb2, store_pb2
from services.planner.jobs.prepare import prepare_job
from services.planner.jobs.scheduler import Scheduler
from tests.harness import make_settings, start_plane, wait_for
from tests.planner.jobs.test_prepare import FLEET, Profiler, task

S = job_pb2.JobState
HOSTS = ["host-a", "host-b"]


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    plane = start_plane(make_settings(tmp_path_factory.mktemp("rebalance")), services=("store",))
    yield plane
    plane.stop()


@pytest.fixture
def running(plane, tmp_path):
    """A 2-stage job RUNNING under its first plan, and a scheduler that follows it (instructions collected)."""
    client = plane.client()
    fleet = fleet_pb2.Fleet()
    fleet.CopyFrom(FLEET)
    fleet.nodes, fleet.devices_per_node = 1, 2
    model = model_pb2.ModelSpec(name="gpt-online", family=model_pb2.MODEL_FAMILY_GPT,
                                transformer=model_pb2.TransformerConfig(num_layers=6, hidden_size=256, num_heads=4,
                                                                        vocab_size=1024, seq_length=128))
    spec = job_pb2.JobSpec(name="online", model=model, global_batch_size=8, iterations=100, fleet=fleet,
                           pipeline_stages=2, online_repartition=True)
    job = client.store.CreateJob(store_pb2.CreateJobRequest(spec=spec))
    store = plane.store()
    prepare_job({"job_id": job.id}, task(store, job, Profiler(client.store)))
    job = client.store.TransitionJob(store_pb2.TransitionJobRequest(
        id=job.id, state=S.JOB_STATE_RUNNING, expected_state=S.JOB_STATE_SCHEDULED, event_type="ASSIGNED",
        message="test", attributes={"hosts": ",".join(HOSTS), "world_size": "2",
                                    "ranks": ";".join(f"{h}:{rank}" for rank, h in enumerate(HOSTS))}))
    plan = client.store.GetPlan(store_pb2.GetRequest(id=job.plan_id))
    sent: list[tuple[str, executor_pb2.PlannerMessage]] = []
    scheduler = Scheduler(store, lambda host, message: sent.append((host, message)), lambda: HOSTS, tmp_path)
    scheduler.rebalancer.track(job, plan, HOSTS)
    return client, scheduler, job, plan, sent


def report(scheduler: Scheduler, job: job_pb2.Job, plan, iterations: range, compute: tuple[float, float]) -> None:
    """Both stages' stats for these iterations: stage s spends compute[s] seconds in forward + backward."""
    for it in iterations:
        for stage, (st, seconds) in enumerate(zip(plan.stages, compute, strict=True)):
            layers = list(range(st.layer_begin, st.layer_end))
            stats = executor_pb2.StageStats(
                job_id=job.id, stage_index=stage, iteration=it, plan_version=plan.version, forward_s=seconds / 3,
                backward_s=2 * seconds / 3, iteration_time_s=max(compute) * 1.2, layers=layers, active_layers=layers,
                idle_s=max(compute) * 1.2 - seconds, rank=stage)
            scheduler.on_message(HOSTS[stage], executor_pb2.AgentMessage(
                heartbeat=executor_pb2.Heartbeat(stages=[stats])))


def events(client, job_id: str) -> list[job_pb2.JobEvent]:
    return list(client.store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job_id)).events)


def repartition(running) -> tuple[job_pb2.Job, executor_pb2.RepartitionInstruction, int]:
    """Make stage 0 ten times busier than stage 1 (on the profile's scale) and let the scheduler decide."""
    client, scheduler, job, plan, sent = running
    t = plan.prediction.iteration_time_s
    report(scheduler, job, plan, range(8), compute=(2 * t, 0.2 * t))
    scheduler.tick()
    job = client.store.GetJob(store_pb2.GetRequest(id=job.id))
    assert job.state == S.JOB_STATE_REPARTITIONING, [(e.type, e.message) for e in events(client, job.id)]
    assert sorted(host for host, _ in sent) == HOSTS
    message = sent[0][1]
    assert message.WhichOneof("body") == "repartition" and message.version == plan.version + 1
    return job, message.repartition, message.version


def test_an_unbalanced_job_gets_a_new_plan_version_in_force_once_every_host_acked(running):
    client, scheduler, job, plan, sent = running
    job, instruction, version = repartition(running)
    decided = events(client, job.id)[-1]
    assert decided.type == "REPARTITION" and "stage 0 is the bottleneck" in decided.message
    assert float(decided.attributes["predicted_after_s"]) < float(decided.attributes["predicted_before_s"])
    new = instruction.plan
    assert new.parent_plan_id == plan.id and new.version == version and new.engine == 5  # PLAN_ENGINE_VPIPE
    assert new.stages[0].layer_end < plan.stages[0].layer_end  # layers left the busy stage
    assert all(m.from_stage == 0 and m.to_stage == 1 for m in instruction.moves)
    assert instruction.effective_iteration == 8  # the next boundary every rank reaches holding it
    assert job.plan_version == plan.version  # not in force before every host applied it

    def ack(host: str) -> None:
        scheduler.on_message(host, executor_pb2.AgentMessage(ack=executor_pb2.InstructionAck(
            instruction_id=f"{job.id}-repartition-v{version}-{host}", version=version, ok=True,
            message="plan version applied after iteration 9")))

    ack(HOSTS[0])
    assert client.store.GetJob(store_pb2.GetRequest(id=job.id)).state == S.JOB_STATE_REPARTITIONING
    ack(HOSTS[1])
    job = client.store.GetJob(store_pb2.GetRequest(id=job.id))
    assert (job.state, job.plan_id, job.plan_version) == (S.JOB_STATE_RUNNING, new.id, version)
    assert events(client, job.id)[-1].type == "REPARTITIONED"

    # One row per moved layer, announced once.
    move = instruction.moves[0]
    scheduler.on_message(HOSTS[1], executor_pb2.AgentMessage(layer_migrated=executor_pb2.LayerMigrated(
        rank=1, migration=job_pb2.LayerMigration(job_id=job.id, layer_index=move.layer_index, from_stage=0,
                                                 to_stage=1, bytes=1 << 20, duration_s=0.02, iteration=9,
                                                 plan_version=version))))
    rows = client.store.ListLayerMigrations(store_pb2.ListLayerMigrationsRequest(job_id=job.id)).migrations
    assert [(r.layer_index, r.from_stage, r.to_stage, r.bytes, r.iteration, r.plan_version) for r in rows] == [
        (move.layer_index, 0, 1, 1 << 20, 9, version)]
    assert events(client, job.id)[-1].type == "MIGRATION"

    # Metrics under the new version sit beside the new plan's prediction; a balanced pipeline stays put.
    plan2 = client.store.GetPlan(store_pb2.GetRequest(id=job.plan_id))
    balanced = plan2.prediction.iteration_time_s / 2
    report(scheduler, job, plan2, range(10, 18), compute=(balanced, balanced))
    sent.clear()
    scheduler.tick()
    assert not sent and client.store.GetJob(store_pb2.GetRequest(id=job.id)).state == S.JOB_STATE_RUNNING
    metrics = client.store.ListIterationMetrics(store_pb2.ListIterationMetricsRequest(
        job_id=job.id, from_iteration=10)).metrics
    assert {m.predicted_iteration_time_s for m in metrics} == {plan2.prediction.iteration_time_s}
    for m in metrics:  # and beside the new plan's prediction for the row's own stage
        stage = plan2.stages[m.stage_index]
        assert m.predicted_peak_memory_bytes == stage.predicted_peak_memory_bytes > 0
        assert m.predicted_stage_compute_s == pytest.approx(stage.predicted_time_s * plan2.num_micro_batches)
        assert m.predicted_stage_compute_s > 0



def test_no_repartition_in_the_last_iterations_a_new_plan_could_not_be_measured_in(running):
    """Four iterations left of 100, fewer than warm-up + window: the same imbalance that is worth a
    repartition earlier is left alone (the migration could not pay off, nor be judged, before the end)."""
    client, scheduler, job, plan, sent = running
    t = plan.prediction.iteration_time_s
    report(scheduler, job, plan, range(88, 96), compute=(2 * t, 0.2 * t))
    scheduler.tick()
    assert client.store.GetJob(store_pb2.GetRequest(id=job.id)).state == S.JOB_STATE_RUNNING and sent == []

def test_a_refused_repartition_leaves_the_job_on_its_plan(running):
    client, scheduler, job, plan, sent = running
    job, _, version = repartition(running)
    scheduler.on_message(HOSTS[1], executor_pb2.AgentMessage(ack=executor_pb2.InstructionAck(
        instruction_id=f"{job.id}-repartition-v{version}-{HOSTS[1]}", version=version, ok=False,
        message="worker rank 1 rejected plan version 2: stage_bounds ...")))
    job = client.store.GetJob(store_pb2.GetRequest(id=job.id))
    assert (job.state, job.plan_id) == (S.JOB_STATE_RUNNING, plan.id)
    last = events(client, job.id)[-1]
    assert last.type == "REPARTITION_FAILED" and "rejected plan version 2" in last.message

    # The imbalance persists: the next decision is a new version (the refused one stays stored), not a retry.
    sent.clear()
    t = plan.prediction.iteration_time_s
    report(scheduler, job, plan, range(8, 16), compute=(2 * t, 0.2 * t))
    scheduler.tick()
    assert client.store.GetJob(store_pb2.GetRequest(id=job.id)).state == S.JOB_STATE_REPARTITIONING
    assert {m.version for _, m in sent} == {version + 1}

    # Given up (a host could not be reached), then an ok for it after all: the workers run it, so it is adopted.
    scheduler.rebalancer._abandon(job.id, sent[0][1].repartition.plan, "could not reach host-b")
    assert client.store.GetJob(store_pb2.GetRequest(id=job.id)).state == S.JOB_STATE_RUNNING
    scheduler.on_message(HOSTS[0], executor_pb2.AgentMessage(ack=executor_pb2.InstructionAck(
        instruction_id=f"{job.id}-repartition-v{version + 1}-{HOSTS[0]}", version=version + 1, ok=True)))
    job = client.store.GetJob(store_pb2.GetRequest(id=job.id))
    assert (job.state, job.plan_version) == (S.JOB_STATE_RUNNING, version + 1)
    assert [e.type for e in events(client, job.id)][-3:] == ["REPARTITION_FAILED", "REPARTITION", "REPARTITIONED"]


def test_a_version_applied_while_the_planner_was_away_is_adopted_when_the_agent_reconnects(plane, running):
    client, scheduler, job, plan, _ = running
    job, instruction, version = repartition(running)
    fresh = Scheduler(plane.store(), lambda host, message: None, lambda: HOSTS, scheduler._root)  # a restarted planner
    fresh.on_message(HOSTS[0], executor_pb2.AgentMessage(register=executor_pb2.RegisterAgent(
        applied_versions={job.id: version})))
    job = client.store.GetJob(store_pb2.GetRequest(id=job.id))
    assert (job.state, job.plan_id, job.plan_version) == (S.JOB_STATE_RUNNING, instruction.plan.id, version)


def exit_message(job_id: str, rank: int, code: int, message: str) -> executor_pb2.AgentMessage:
    return executor_pb2.AgentMessage(worker_exit=executor_pb2.WorkerExit(
        job_id=job_id, rank=rank, stage_index=rank, exit_code=code, message=message, iteration=3))


def morphing(client, job_id: str) -> job_pb2.JobEvent:
    events = client.store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job_id)).events
    return next(e for e in events if e.type == "MORPHING")


def test_a_dead_worker_is_named_as_the_cause_even_when_its_peer_reports_first(running):
    client, scheduler, job, _, sent = running
    peer_error = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41000"
    scheduler.on_message(HOSTS[0], exit_message(job.id, 0, 1, peer_error))
    assert client.store.GetJob(store_pb2.GetRequest(id=job.id)).state == S.JOB_STATE_RUNNING  # waiting for the cause
    scheduler.on_message(HOSTS[1], exit_message(job.id, 1, -9, "killed by SIGKILL"))
    done = client.store.GetJob(store_pb2.GetRequest(id=job.id))
    # a signal is lost infrastructure: the job morphs, and with both ranks gone it waits to resume
    assert done.state == S.JOB_STATE_QUEUED and "waiting to resume from the start" in done.message
    event = morphing(client, job.id)
    assert event.attributes["cause"] == "worker_lost" and "worker rank 1" in event.attributes["detail"]
    assert "SIGKILL" in event.attributes["detail"] and event.attributes["failed_iteration"] == "0"
    assert [host for host, m in sent if m.WhichOneof("body") == "stop"] == HOSTS


def test_a_broken_collective_alone_morphs_the_job_after_the_grace_period(running):
    client, scheduler, job, _, _ = running
    scheduler.on_message(HOSTS[0], exit_message(job.id, 0, 1, "RuntimeError: Connection reset by peer"))
    wait_for(lambda: client.store.GetJob(store_pb2.GetRequest(id=job.id)).state == S.JOB_STATE_MORPHING,
             timeout=10, what="the job to morph")
    detail = morphing(client, job.id).attributes["detail"]
    assert "worker rank 0" in detail and "Connection reset by peer" in detail


def test_an_error_in_the_model_fails_the_job_with_its_traceback_never_retried(running):
    client, scheduler, job, _, sent = running
    message = exit_message(job.id, 1, 1, "ValueError: injected fault")
    message.worker_exit.traceback = 'Traceback (most recent call last):\n  File "model.py", line 3\nValueError: x'
    scheduler.on_message(HOSTS[1], message)
    done = client.store.GetJob(store_pb2.GetRequest(id=job.id))
    assert done.state == S.JOB_STATE_FAILED and "ValueError: injected fault" in done.message
    assert "Traceback (most recent call last)" in done.message and 'File "model.py"' in done.message
    types = [e.type for e in client.store.ListJobEvents(store_pb2.ListJobEventsRequest(job_id=job.id)).events]
    assert "MORPHING" not in types


def test_a_job_past_its_morph_budget_fails(plane, running, tmp_path):
    client, _, job, _, sent = running
    scheduler = Scheduler(plane.store(), lambda host, m: sent.append((host, m)), lambda: HOSTS, tmp_path,
                          max_morphs_per_hour=0)
    scheduler.on_message(HOSTS[1], exit_message(job.id, 1, -9, "killed by SIGKILL"))
    done = client.store.GetJob(store_pb2.GetRequest(id=job.id))
    assert done.state == S.JOB_STATE_FAILED and "retry budget is spent (0 morphs in the last hour" in done.message


class RepartitionsFirst:
    """The store, but a repartition (the rebalancer, on another thread) lands between the scheduler's read of
    the job and its first SUCCEEDED transition, so that compare-and-set is refused."""

    def __init__(self, store):
        self._store, self.raced = store, False

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def transition_job(self, request: store_pb2.TransitionJobRequest) -> job_pb2.Job:
        if request.state == S.JOB_STATE_SUCCEEDED and not self.raced:
            self.raced = True
            self._store.transition_job(store_pb2.TransitionJobRequest(
                id=request.id, state=S.JOB_STATE_REPARTITIONING, expected_state=S.JOB_STATE_RUNNING,
                event_type="REPARTITION", message="a concurrent decision"))
        return self._store.transition_job(request)


def test_the_last_exit_ends_the_job_even_when_a_repartition_races_it(plane, running, tmp_path):
    client, _, job, _, _ = running
    store = RepartitionsFirst(plane.store())
    scheduler = Scheduler(store, lambda host, message: None, lambda: HOSTS, tmp_path)
    for rank in (0, 1):
        scheduler.on_message(HOSTS[rank], executor_pb2.AgentMessage(worker_exit=executor_pb2.WorkerExit(
            job_id=job.id, rank=rank, stage_index=rank, finished=True, iteration=100)))
    done = client.store.GetJob(store_pb2.GetRequest(id=job.id))
    assert store.raced and done.state == S.JOB_STATE_SUCCEEDED, [(e.type, e.message) for e in events(client, job.id)]
