"""`ballast demo`: the newcomer's first run. The control plane comes up with local CPU executors, gpt-tiny is
submitted as a job (profiled on this host, planned, trained for real over torch.distributed), and a short
report compares the plan's predicted iteration time with the measured one and saves the loss curve. With two or
more executors it ends with vPipe live: the same model on a 2-stage pipeline whose second half starts switched
off (unbalanced), so the planner migrates layers while it trains -- and again when those layers switch on."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console

from ballast.cli import control_plane as cp
from ballast.cli.follow import follow
from ballast.client import Client
from ballast.config import Settings, load_settings
from ballast.v1 import job_pb2, model_pb2, plan_pb2, services_pb2, store_pb2
from ballast.windows import weight, weighted_median
from services.planner.plans.calibrate import WARMUP, measured_iteration_s
from services.planner.plans.make import CALIBRATED
from services.specs.model import load_model_spec
from services.specs.parallel import ParallelDims

console = Console()


def default_model_path() -> Path:
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = base / "examples" / "gpt-tiny.yaml"
        if candidate.exists():
            return candidate
    raise FileNotFoundError("examples/gpt-tiny.yaml not found; pass --model PATH")


def run_demo(settings: Settings, args: argparse.Namespace) -> int:
    """Up; submit gpt-tiny as a job (profiled here, planned, trained on the local executors); report; down."""
    if args.data_dir is None:
        settings = load_settings(data_dir=Path(tempfile.mkdtemp(prefix="ballast-demo-")))
    spec = load_model_spec(args.model or default_model_path())
    console.rule(f"1. bring the control plane up ({args.executors} CPU executors)")
    ok, rows, message = cp.bring_up(settings, args.executors, 90.0)
    for name, address, status in rows:
        console.print(f"  {name:<12} {address:<18} {status}")
    if not ok:
        console.print(f"[red]{message}[/red]")
        return 1
    state = cp.State.load(settings)
    try:
        with Client.of(settings, ("store", "planner")) as client:
            console.rule(f"2. submit {spec.name}: profile, plan, train {args.iterations} iterations")
            job_spec = job_pb2.JobSpec(name=f"demo-{spec.name}", model=spec, global_batch_size=args.batch,
                                       iterations=args.iterations, seed=1,
                                       optimizer=job_pb2.OptimizerSpec(name="adam", learning_rate=3e-3))
            job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=job_spec))
            console.print(f"  job {job.id}; the same as `ballast submit {args.model or 'examples/gpt-tiny.yaml'} "
                          f"--batch {args.batch} --iterations {args.iterations} --wait`")
            if follow(client, job.id, 0, None) != 0:
                console.print("[red]the job did not succeed[/red]")
                return 1
            console.rule("3. report")
            code = report(client, job.id, settings.data_dir / "loss.png")
            await_calibration(client, job.id)
            if code == 0 and args.executors >= 2 and spec.HasField("transformer"):
                console.rule("4. live rebalancing (vPipe): an unbalanced 2-stage pipeline, layers migrated live")
                code = rebalance_live(client, spec, args)
            return code
    finally:
        console.rule("5. shut down")
        killed = cp.stop_all(settings, state)
        console.print(f"  stopped {len(state.children)} processes" + (f" (force-killed {killed})" if killed else ""))


def rebalance_live(client: Client, spec: model_pb2.ModelSpec, args: argparse.Namespace) -> int:
    """Train the model on 2 stages with its second-half blocks off until mid-run (a dynamic workload): the planner
    sees stage 0 doing all the work, moves layers to stage 1, and moves them back once the blocks switch on."""
    blocks = spec.transformer.num_layers  # layers: embedding, blocks 1..n, head
    late = range(1 + blocks // 2, 1 + blocks)
    iterations = max(args.iterations * 2, 40)
    toggles = [job_pb2.LayerToggle(layer_index=i, iteration=0, active=False) for i in late]
    toggles += [job_pb2.LayerToggle(layer_index=i, iteration=iterations // 2, active=True) for i in late]
    job_spec = job_pb2.JobSpec(name=f"demo-{spec.name}-online", model=spec, global_batch_size=args.batch,
                               iterations=iterations, seed=1, pipeline_stages=2, online_repartition=True,
                               layer_toggles=toggles, optimizer=job_pb2.OptimizerSpec(name="adam", learning_rate=3e-3))
    job = client.jobs.Submit(services_pb2.SubmitJobRequest(spec=job_spec))
    switches = " ".join(f"--toggle {i}:0:off --toggle {i}:{iterations // 2}:on" for i in late)
    console.print(f"  job {job.id}; the same as `ballast submit {args.model or 'examples/gpt-tiny.yaml'} --stages 2 "
                  f"--online {switches} --batch {args.batch} --iterations {iterations} --wait`")
    if follow(client, job.id, 0, None) != 0:
        console.print("[red]the online job did not succeed[/red]")
        return 1
    rows = client.store.ListLayerMigrations(store_pb2.ListLayerMigrationsRequest(job_id=job.id)).migrations
    for m in rows:
        console.print(f"  migration: layer {m.layer_index} stage {m.from_stage} -> {m.to_stage} after iteration "
                      f"{m.iteration} (plan v{m.plan_version}), {m.bytes / 2**20:.2f} MiB in "
                      f"{m.duration_s * 1e3:.0f} ms")
    per_version: dict[int, list[tuple[float, int]]] = {}  # (time, iterations the row covers)
    for m in client.iteration_metrics(job.id):
        per_version.setdefault(m.plan_version, []).append((m.iteration_time_s, weight(m)))
    for version, times in sorted(per_version.items()):
        console.print(f"  plan v{version}: median iteration {weighted_median(times) * 1e3:.1f} ms "
                      f"over {sum(n for _, n in times)} worker-iterations")
    console.print(f"  SQL: ballast sql \"SELECT * FROM layer_migrations WHERE job_id = '{job.id}'\"")
    if not rows:
        console.print("[yellow]  no layer was migrated: the planner judged no move worth it here[/yellow]")
    return 0


def report(client: Client, job_id: str, png: Path) -> int:
    """Plan, predicted against measured iteration time, the loss curve (saved as PNG), the SQL behind it."""
    job = client.jobs.Get(store_pb2.GetRequest(id=job_id))
    plan = client.planner.GetPlan(store_pb2.GetRequest(id=job.plan_id))
    rows = client.iteration_metrics(job_id)
    replicas = ParallelDims.of_plan(plan).dp
    console.print(f"  plan {plan.id}: {len(plan.stages)} stage(s) x {replicas} replica(s), "
                  f"{plan.num_micro_batches} micro-batch(es) of {plan.micro_batch_size}, "
                  f"{plan_pb2.Schedule.Name(plan.schedule).removeprefix('SCHEDULE_')}")
    measured = measured_iteration_s(rows, plan.version, WARMUP)  # as the calibration measures it
    predicted = plan.prediction.iteration_time_s
    console.print(f"  iteration time: predicted {predicted * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms "
                  f"(median after {WARMUP} warm-up iterations), error {(predicted - measured) / measured:+.1%}")
    used = next((line.strip() for line in plan.explanation.splitlines() if CALIBRATED in line), "")
    console.print(f"  prediction: {used}" if used else "  prediction: uncalibrated (the profile alone): no "
                  "calibration of this host class fitted on enough iterations yet (BALLAST_CALIBRATION_MIN_ITERATIONS)")
    losses = sorted((m.iteration, m.loss) for m in rows if m.has_loss and m.replica_index == 0)
    console.print(f"  loss: {losses[0][1]:.3f} at iteration 0 -> {losses[-1][1]:.3f} at iteration {losses[-1][0]}")
    save_curve(losses, png, job_id)
    console.print(f"  loss curve: {png}")
    console.print(f"  SQL: ballast sql \"SELECT iteration, stage_index, replica_index, iteration_time_s, "
                  f"predicted_iteration_time_s, loss FROM iteration_metrics WHERE job_id = '{job_id}'\"")
    return 0 if losses[-1][1] < losses[0][1] else 1


def calibration_outcome(client: Client, job_id: str) -> dict | None:
    """What the calibration task queued for `job_id` concluded (its result: calibrated, version or why not), or
    None while it has not finished. A finished run need not make a new version: a fit that is no better than the
    one in force on the same runs is not stored."""
    rows = client.store.Query(store_pb2.QueryRequest(
        sql="SELECT state, result_json FROM queued_requests WHERE kind = 'jobs.calibrate' "
            f"AND payload_json LIKE '%{job_id}%'")).rows
    for state, result in (list(r) for r in rows):
        if state == "REQUEST_STATE_SUCCEEDED" and result and json.loads(result).get("job_id") == job_id:
            return json.loads(result)
    return None


def await_calibration(client: Client, job_id: str, timeout_s: float = 90.0) -> None:
    """The run just finished recalibrates its host class (a Celery job); wait for its outcome before shutting
    down, so a second `make demo` in the same data dir is planned with it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outcome = calibration_outcome(client, job_id)
        if outcome is None:
            time.sleep(0.5)
            continue
        if not outcome.get("calibrated"):
            console.print(f"  calibration: this run changed nothing: {outcome.get('why', '')}")
            return
        c = next(x for x in client.store.ListCalibrations(store_pb2.ListCalibrationsRequest()).calibrations
                 if x.id == outcome["calibration_id"])
        console.print(f"  calibration {c.id} (version {c.version} for {c.host_class}) fitted from "
                      f"{len(c.job_ids)} run(s): iteration error {c.residual_before:.1%} uncalibrated, "
                      f"{c.residual:.1%} calibrated; run the demo again with the same --data-dir to be planned "
                      "with it")
        return
    console.print(f"[yellow]  no calibration outcome for {job_id} within {timeout_s:.0f} s (see `ballast sql "
                  "\"SELECT * FROM calibrations\"`)[/yellow]")


def save_curve(losses: list[tuple[int, float]], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([i for i, _ in losses], [v for _, v in losses], marker=".")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (mean per token)")
    ax.set_title(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
