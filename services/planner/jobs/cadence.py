"""How often a job checkpoints when its spec leaves it to Ballast (checkpoint_every 0): Young's interval.

A checkpoint every tau seconds costs C / tau of the run in writing and, at a failure, tau / 2 trained again on
average; the sum is smallest at tau = sqrt(2 C M) (Young, 1974), with C the time one checkpoint takes and M the
mean time between failures the job sees. M is the fleet's observed failure rate (lost workers and hosts per
device-hour) over the job's devices; C is the job's last measured checkpoint, else its model and optimizer
state over a nominal write bandwidth. The interval is bounded by configuration. Pure: numbers in, numbers out.

Workers write checkpoints in the background, so C is what a checkpoint stalls training (the copy to host
memory; the iteration after it also waits for whatever of the write did not fit beside it), and the interval
is at least the background write's time: one write is in flight at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

WRITE_BYTES_PER_S = 200e6  # nominal local-disk write speed for a first estimate of C
ADAM_STATE_FACTOR = 3.0  # parameters + two Adam moments written per layer
NO_FAILURE_MTBF_S = 24 * 3600.0  # a fleet with no failure observed yet is assumed to fail once a day per device


@dataclass(frozen=True)
class Cadence:
    every: int  # iterations between checkpoints (0: never)
    why: str


def checkpoint_cost_s(parameter_bytes: int, measured_s: float = 0.0) -> float:
    """One checkpoint's seconds: measured if known, else the model and optimizer state at a nominal speed."""
    return measured_s if measured_s > 0 else parameter_bytes * ADAM_STATE_FACTOR / WRITE_BYTES_PER_S


def job_mtbf_s(failures: int, device_hours: float, devices: int) -> float:
    """Mean seconds between failures for a job on `devices`: the fleet's failures per device-hour, times its
    devices (any one of them failing stops the job). No failure yet: NO_FAILURE_MTBF_S per device."""
    per_device_s = device_hours * 3600.0 / failures if failures and device_hours > 0 else NO_FAILURE_MTBF_S
    return per_device_s / max(devices, 1)


def young(checkpoint_s: float, mtbf_s: float, iteration_s: float, *, min_every: int = 1,
          max_interval_s: float = 1800.0, write_s: float = 0.0) -> Cadence:
    """Iterations between checkpoints from Young's interval, at least `min_every`, at least the background
    write's `write_s`, and at most `max_interval_s` of training apart."""
    if iteration_s <= 0:
        return Cadence(0, "no predicted iteration time: no checkpoints")
    tau = math.sqrt(2.0 * max(checkpoint_s, 1e-6) * mtbf_s)
    young_every = max(min_every, int(min(tau, max_interval_s) / iteration_s))
    write_every = math.ceil(write_s / iteration_s)
    every = max(young_every, write_every)
    why = (f"every {every} iterations ({every * iteration_s:.1f} s): Young's sqrt(2 x {checkpoint_s:.3g} s checkpoint "
           f"x {mtbf_s / 3600:.3g} h between failures) = {tau:.0f} s"
           + (f", capped at {max_interval_s:.0f} s" if tau > max_interval_s else "")
           + (f", no shorter than the {write_s:.3g} s background write" if write_every > young_every else ""))
    return Cadence(every, why)
