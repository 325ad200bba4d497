"""Plotly figures as plain dicts ({"data": [...], "layout": {...}}): the page embeds them as JSON and the
locally served plotly.js draws them. Pure functions of rows, so they are tested without a browser."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from services.dashboard.gantt import bubble_fraction, simulate

Figure = dict[str, Any]
MIB = 1024 * 1024
TIMELINE_KINDS = ("event", "migration", "morph")  # rows of the job timeline, bottom to top


def _layout(title: str, x: str, y: str, **extra: Any) -> dict[str, Any]:
    return {"title": {"text": title, "x": 0.01, "xanchor": "left"}, "xaxis": {"title": {"text": x}},
            "yaxis": {"title": {"text": y}}, "margin": {"l": 60, "r": 20, "t": 40, "b": 50}, "height": 320,
            "legend": {"orientation": "h", "x": 1, "xanchor": "right", "y": 1.02, "yanchor": "bottom"}, **extra}


def loss_figure(metrics: list[Any], evaluations: list[Any] = ()) -> Figure:
    """Measured loss per iteration (the mean over the last stage's replicas that reported one), and the validation
    loss of each evaluation, at the iteration it followed (metrics number iterations from 0, evaluations count
    the iterations done)."""
    by_iteration: dict[int, list[float]] = defaultdict(list)
    for m in metrics:
        if m.has_loss:
            by_iteration[m.iteration].append(m.loss)
    xs = sorted(by_iteration)
    ys = [sum(by_iteration[i]) / len(by_iteration[i]) for i in xs]
    trace = {"type": "scatter", "mode": "lines+markers", "name": "measured loss", "x": xs, "y": ys}
    data = [trace]
    if evaluations:
        data.append({"type": "scatter", "mode": "lines+markers", "name": "validation loss",
                     "x": [e.iteration - 1 for e in evaluations], "y": [e.loss for e in evaluations]})
    return {"data": data, "layout": _layout("Loss", "iteration", "loss")}


def iteration_time_figure(metrics: list[Any]) -> Figure:
    """Measured iteration time (the slowest rank's: an iteration lasts as long as it) against the plan's
    predicted iteration time, per iteration."""
    measured: dict[int, float] = {}
    predicted: dict[int, list[float]] = defaultdict(list)
    for m in metrics:
        measured[m.iteration] = max(measured.get(m.iteration, 0.0), m.iteration_time_s)
        if m.predicted_iteration_time_s > 0:
            predicted[m.iteration].append(m.predicted_iteration_time_s)
    xs = sorted(measured)
    px = sorted(predicted)
    return {"data": [
        {"type": "scatter", "mode": "lines+markers", "name": "measured", "x": xs, "y": [measured[i] for i in xs]},
        {"type": "scatter", "mode": "lines", "name": "predicted", "line": {"dash": "dash"}, "x": px,
         "y": [sum(predicted[i]) / len(predicted[i]) for i in px]},
    ], "layout": _layout("Iteration time, predicted vs measured", "iteration", "seconds")}


def timeline(events: list[dict[str, Any]], migrations: list[dict[str, Any]],
             morphs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events, layer migrations and morphs in one list by time: kind, when, what."""
    rows = [{"kind": "event", "iso": e["iso"], "at": e["at"], "what": e["type"], "detail": e["message"]}
            for e in events]
    rows += [{"kind": "migration", "iso": m["iso"], "at": m["at"],
              "what": f"layer {m['layer']}: stage {m['from_stage']} \u2192 {m['to_stage']}",
              "detail": f"iteration {m['iteration']}, plan v{m['plan_version']}, {m['bytes'] / MIB:.2f} MiB in "
                        f"{m['duration_s']:.3f} s"} for m in migrations]
    rows += [{"kind": "morph", "iso": m["iso"], "at": m["at"], "what": f"{m['cause']}: {m['from']} \u2192 {m['to']}",
              "detail": f"failed at iteration {m['failed_iteration']}, lost {m['lost_iterations']}, recovered in "
                        f"{m['recovery_s']:.1f} s; {m['detail']}"} for m in morphs]
    return sorted(rows, key=lambda r: (r["iso"], TIMELINE_KINDS.index(r["kind"])))


def timeline_figure(rows: list[dict[str, Any]]) -> Figure:
    """One marker per event, migration and morph on a time axis, a row for each kind."""
    symbols = {"event": "circle", "migration": "diamond", "morph": "x"}
    data = []
    for kind in TIMELINE_KINDS:
        mine = [r for r in rows if r["kind"] == kind and r["iso"]]
        data.append({"type": "scatter", "mode": "markers", "name": kind, "x": [r["iso"] for r in mine],
                     "y": [kind] * len(mine), "text": [f"{r['what']}<br>{r['detail'][:120]}" for r in mine],
                     "hoverinfo": "text+x", "marker": {"size": 11, "symbol": symbols[kind]}})
    layout = _layout("Timeline: events, migrations, morphs", "time (UTC)", "")
    layout["yaxis"] = {"type": "category", "categoryorder": "array", "categoryarray": list(TIMELINE_KINDS)}
    layout["height"] = 260
    return {"data": data, "layout": layout}


def gantt_figure(stage_times_s: list[float], micro_batches: int, schedule: str) -> Figure:
    """The pipeline's forward (F) and backward (B) passes per stage over one iteration."""
    ops = simulate(stage_times_s, micro_batches, schedule)
    data = []
    for kind, name, colour in (("F", "forward", "#4c78a8"), ("B", "backward", "#f58518")):
        mine = [op for op in ops if op.kind == kind]
        data.append({"type": "bar", "orientation": "h", "name": name, "marker": {"color": colour},
                     "base": [op.start_s for op in mine], "x": [op.end_s - op.start_s for op in mine],
                     "y": [f"stage {op.stage}" for op in mine], "text": [str(op.micro_batch) for op in mine],
                     "textposition": "inside", "hovertemplate": f"{name} micro-batch %{{text}}<extra></extra>"})
    bubble = bubble_fraction(ops, len(stage_times_s))
    layout = _layout(f"Pipeline ({schedule or '1f1b'}), bubble {bubble:.0%}", "seconds", "", barmode="overlay")
    layout["yaxis"] = {"autorange": "reversed"}
    layout["height"] = 120 + 40 * len(stage_times_s)
    return {"data": data, "layout": layout}


def profile_figure(profile: Any) -> Figure:
    """Forward + backward time per sample of the whole model against micro-batch size, measured sizes
    marked apart from interpolated ones."""
    totals: dict[int, float] = defaultdict(float)
    measured: set[int] = set(profile.measured_micro_batch_sizes)
    for layer in profile.layers:
        for s in layer.samples:
            totals[s.micro_batch_size] += s.forward_s + s.backward_s
    xs = sorted(totals)
    per_sample = {m: totals[m] / m for m in xs if m > 0}
    data = [{"type": "scatter", "mode": "lines", "name": "all sizes", "x": list(per_sample),
             "y": list(per_sample.values())},
            {"type": "scatter", "mode": "markers", "name": "measured", "x": [m for m in per_sample if m in measured],
             "y": [per_sample[m] for m in per_sample if m in measured], "marker": {"size": 9}}]
    layout = _layout("Forward + backward per sample", "micro-batch size", "seconds per sample")
    layout["xaxis"].update(type="log", tickvals=list(per_sample), ticktext=[str(m) for m in per_sample])
    return {"data": data, "layout": layout}


def utilisation_figure(devices: list[dict[str, Any]]) -> Figure:
    """Each device's leased share of the last hour."""
    names = [f"{d['host']}/{d['index']}" for d in devices]
    return {"data": [{"type": "bar", "x": names, "y": [round(100 * d["utilisation"], 1) for d in devices],
                      "name": "leased, last hour"}],
            "layout": {**_layout("Utilisation, last hour", "device", "%"), "yaxis": {"range": [0, 100]}}}
