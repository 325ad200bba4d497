"""Gantt chart of a simulated iteration, for plan reports and for checking a schedule by eye.

One row per (replica, device): compute as full-height bars, transfers and swaps as thin bars under them,
allreduce as a thin bar on top. matplotlib is imported lazily (Agg backend), so the simulator itself stays
free of plotting imports.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from services.planner.sim.model import SimResult

COLOURS = {
    "forward": "#4c72b0",
    "recompute": "#dd8452",
    "backward": "#55a868",
    "send_activation": "#8172b3",
    "send_gradient": "#937860",
    "swap_out": "#da8bc3",
    "swap_in": "#8c8c8c",
    "allreduce": "#c44e52",
}
_COMPUTE = {"forward", "recompute", "backward"}


def plot_timeline(result: SimResult, path: str | Path, title: str | None = None) -> Path:
    """Draw `result.events` (needs keep_timeline=True) to a PNG at `path`; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    if not result.events:
        raise ValueError("no events to draw: simulate with keep_timeline=True")
    rows = sorted({(e.replica, e.device) for e in result.events})
    row_of = {key: i for i, key in enumerate(rows)}
    bars: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for e in result.events:
        bars[(e.kind, row_of[(e.replica, e.device)])].append((e.start_s, e.end_s - e.start_s))
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(rows) + 1.5))
    for (kind, row), spans in bars.items():
        if kind in _COMPUTE:
            y, h = row - 0.3, 0.6
        elif kind == "allreduce":
            y, h = row - 0.45, 0.15
        elif kind.startswith("swap"):
            y, h = row + 0.42, 0.12
        else:
            y, h = row + 0.3, 0.12
        ax.broken_barh(spans, (y, h), facecolors=COLOURS.get(kind, "black"), linewidth=0)
    ax.set_yticks(range(len(rows)), [f"r{r} dev {d}" for r, d in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_xlim(0, result.iteration_s or 1.0)
    kinds = sorted({e.kind for e in result.events}, key=list(COLOURS).index)
    ax.legend(handles=[Patch(color=COLOURS[k], label=k) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    ax.set_title(title or f"iteration {result.iteration_s:.4g} s, bubble {result.bubble_fraction:.1%}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
