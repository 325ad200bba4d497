"""Is the host quiet while it is profiled? (issue 45, item 1)

Interference on a shared host (another tenant, a neighbour VM, a build) slows every measurement it overlaps, and
a profile taken under it prices every later plan wrong. A fixed workload (a chain of small matmuls, ~10 ms) is
timed just before and just after the layers are measured; if its time moved by more than NOISY the host was not
quiet, and the driver measures the layers again, keeping per layer and size the faster of the two (interference
only ever adds time). The figure is recorded with the profile (Profile.host_noise, noisy, measure_passes)."""

from __future__ import annotations

import statistics
import time

import torch

NOISY = 0.15  # a fixed workload's time moving more than this between before and after: not a quiet host
SIZE, CHAIN, REPEATS = 128, 24, 9


def probe_s(device: torch.device) -> float:
    """The median time of the fixed workload on `device` (after one warm-up)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.rand(SIZE, SIZE, generator=generator).to(device)
    b = torch.rand(SIZE, SIZE, generator=generator).to(device)
    times = []
    for r in range(REPEATS + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        x = a
        for _ in range(CHAIN):
            x = torch.tanh(x @ b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if r:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def moved(before_s: float, after_s: float) -> float:
    """|after - before| / the faster of the two: how far the host's speed moved over the measurement."""
    low = min(before_s, after_s)
    return abs(after_s - before_s) / low if low > 0 else 0.0
