"""One function per page: read (as the visitor), shape, and name the template. No HTTP here."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from services.dashboard import charts, reads
from services.dashboard.reads import Backend

Page = tuple[str, dict[str, Any]]


def mib(value: float) -> str:
    return f"{value / (1024 * 1024):,.1f}"


def secs(value: float) -> str:
    return f"{value:.4f}" if value < 10 else f"{value:,.1f}"


def pct(value: float) -> str:
    return f"{100 * value:.0f}%"


FILTERS = {"mib": mib, "secs": secs, "pct": pct}


ENDED = ("SUCCEEDED", "FAILED", "CANCELLED")
REFRESH_S = 5  # a page about something still changing reloads itself this often


def jobs_page(request: Request, backend: Backend) -> Page:
    jobs = reads.jobs(backend)
    return "jobs.html", {"title": "Jobs", "jobs": jobs, "tenants": reads.tenant_names(backend, request.state.principal),
                         "refresh_s": REFRESH_S if any(j["state"] not in ENDED for j in jobs) else 0}


def job_page(request: Request, backend: Backend) -> Page:
    view = reads.job(backend, request.path_params["job_id"])
    rows = charts.timeline(view.events, view.migrations, view.morphs)
    figures = {"loss": charts.loss_figure(view.metrics, view.evaluations),
               "iteration-time": charts.iteration_time_figure(view.metrics),
               "timeline": charts.timeline_figure(rows)}
    return "job.html", {"title": f"Job {view.job['id']}", "job": view.job, "events": view.events, "timeline": rows,
                        "migrations": view.migrations, "morphs": view.morphs, "figures": figures,
                        "metric_rows": len(view.metrics),
                        "tenants": reads.tenant_names(backend, request.state.principal),
                        "refresh_s": 0 if view.job["state"] in ENDED else REFRESH_S}


def queue_page(request: Request, backend: Backend) -> Page:
    return "queue.html", {"title": "Queue", "entries": reads.queue(backend)}


def fleet_page(request: Request, backend: Backend) -> Page:
    fleet = reads.fleet(backend)
    return "fleet.html", {"title": "Fleet", **fleet, "tenants": reads.tenant_names(backend, request.state.principal),
                          "figures": {"utilisation": charts.utilisation_figure(fleet["devices"])}}


def plans_page(request: Request, backend: Backend) -> Page:
    return "plans.html", {"title": "Plans", "plans": reads.plans(backend)}


def plan_page(request: Request, backend: Backend) -> Page:
    plan = reads.plan(backend, request.path_params["plan_id"])
    schedule = reads.schedule_name(plan.schedule)
    stages = [{"index": s.index, "layers": f"{s.layer_begin}\u2013{s.layer_end - 1}" if s.layer_end else "",
               "devices": s.devices, "time_s": s.predicted_time_s, "peak": s.predicted_peak_memory_bytes}
              for s in plan.stages]
    layers = [{"index": la.layer_index, "stage": la.stage_index, "dp": la.dp, "sdp": la.sdp, "tp": la.tp,
               "checkpoint": la.checkpoint, "swap": la.swap_activations} for la in plan.layers]
    alternatives = [{"name": a.name, "engine": reads.engine_name(a.engine),
                     "iteration_s": a.prediction.iteration_time_s, "throughput": a.prediction.throughput_samples_per_s,
                     "oom": a.prediction.out_of_memory,
                     "reason": a.reason} for a in plan.alternatives]
    times = [s.predicted_time_s for s in plan.stages]
    figures = {}
    if times and all(t > 0 for t in times):
        figures["gantt"] = charts.gantt_figure(times, max(plan.num_micro_batches, 1), schedule)
    summary = {"id": plan.id, "job_id": plan.job_id, "version": plan.version, "engine": reads.engine_name(plan.engine),
               "schedule": schedule, "fleet": plan.fleet.name, "device": plan.fleet.device.kind,
               "batch": plan.global_batch_size, "micro_batch": plan.micro_batch_size,
               "micro_batches": plan.num_micro_batches, "iteration_s": plan.prediction.iteration_time_s,
               "throughput": plan.prediction.throughput_samples_per_s, "peak": plan.prediction.peak_memory_bytes,
               "parent": plan.parent_plan_id, "profile_id": plan.profile_id, "created": reads.when(plan.created_at)}
    return "plan.html", {"title": f"Plan {plan.id}", "plan": summary, "explanation": plan.explanation,
                         "stages": stages, "layers": layers, "alternatives": alternatives, "figures": figures}


def profiles_page(request: Request, backend: Backend) -> Page:
    return "profiles.html", {"title": "Profiles", "profiles": reads.profiles(backend)}


def profile_page(request: Request, backend: Backend) -> Page:
    p = reads.profile(backend, request.path_params["profile_id"])
    layers = []
    for la in p.layers:
        first = la.samples[0] if la.samples else None
        layers.append({"index": la.index, "name": la.name, "kind": la.kind, "params": la.parameter_count,
                       "max_mb": la.max_micro_batch_size, "mb": first.micro_batch_size if first else 0,
                       "forward_s": first.forward_s if first else 0.0, "backward_s": first.backward_s if first else 0.0,
                       "peak": first.peak_memory_bytes if first else 0})
    summary = {"id": p.id, "model_id": p.model_id, "device": p.device.kind, "software": p.software,
               "projected": p.projected, "source": p.source_profile_id,
               "measured": ", ".join(str(m) for m in p.measured_micro_batch_sizes), "profiling_s": p.profiling_time_s,
               "created": reads.when(p.created_at)}
    return "profile.html", {"title": f"Profile {p.id}", "profile": summary, "layers": layers,
                            "figures": {"per-sample": charts.profile_figure(p)}}
