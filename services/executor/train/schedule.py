"""Per-stage micro-batch task order: pure functions, no torch.

1F1B (PipeDream-flush / Megatron): stage s of S first runs min(S - s - 1, nm) warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards. At most S - s micro-batches
are in flight (forwarded, not yet backwarded), which bounds stored activations per stage.

GPipe: every forward, then every backward in reverse micro-batch order (the last micro-batch forwarded is
the first whose gradient comes back, as in the GPipe paper); all nm micro-batches are in flight at once.

Both orders are deadlock-free with asynchronous sends, since each stage only ever waits on a receive that
the neighbour's own order produces earlier.
"""

from __future__ import annotations

Task = tuple[str, int]  # ("F" | "B", micro-batch index)


def tasks(schedule: str, num_stages: int, stage: int, num_micro_batches: int) -> list[Task]:
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} outside [0, {num_stages})")
    if num_micro_batches < 1:
        raise ValueError("num_micro_batches must be >= 1")
    nm = num_micro_batches
    if schedule == "gpipe":
        return [("F", j) for j in range(nm)] + [("B", j) for j in reversed(range(nm))]
    if schedule != "1f1b":
        raise ValueError(f"schedule {schedule!r}: use '1f1b' or 'gpipe'")
    warmup = min(num_stages - stage - 1, nm)
    order: list[Task] = [("F", j) for j in range(warmup)]
    for j in range(nm - warmup):
        order += [("F", warmup + j), ("B", j)]
    order += [("B", j) for j in range(nm - warmup, nm)]
    return order


def max_in_flight(order: list[Task]) -> int:
    """Largest number of micro-batches forwarded but not yet backwarded at any point."""
    live = peak = 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak
