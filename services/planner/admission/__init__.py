"""Admission for a shared fleet (pure: no I/O, no clock; the same inputs give the same decision).

Which queued jobs start now and on which devices, under priorities, fair share, quotas, gang
scheduling, conservative backfilling, re-planning within a device range and preemption. Inputs and
outputs live in `model`; `decide` is one pass, `predicted_starts` the slower full listing.
"""

from services.planner.admission.decide import DEFAULT_RESERVE_DEPTH, decide, predicted_starts
from services.planner.admission.model import (
    CALIBRATING,
    DEVICES_BUSY,
    JOB_AHEAD,
    NO_EXECUTOR,
    PREEMPTED,
    QUOTA,
    REASONS,
    REPLANNING,
    Decision,
    Demand,
    Holding,
    Policy,
    Slot,
    Wait,
)
from services.planner.admission.order import admission_order, counted_usage, decayed_usage
from services.planner.admission.profile import Profile

__all__ = [
    "CALIBRATING",
    "DEFAULT_RESERVE_DEPTH",
    "DEVICES_BUSY",
    "JOB_AHEAD",
    "NO_EXECUTOR",
    "PREEMPTED",
    "QUOTA",
    "REASONS",
    "REPLANNING",
    "Decision",
    "Demand",
    "Holding",
    "Policy",
    "Profile",
    "Slot",
    "Wait",
    "admission_order",
    "counted_usage",
    "decayed_usage",
    "decide",
    "predicted_starts",
]
