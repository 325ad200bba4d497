"""How far repeated measurements stray, robustly: one definition for the profiler's layer times and the
planner's run times, so a profile's spread and a calibration's read alike."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

MAD_SCALE = 1.4826  # the median absolute deviation of a normal sample times this estimates its standard deviation


def robust_spread(values: Sequence[float], center: float) -> float:
    """MAD_SCALE x the median absolute deviation of `values` from `center`, over `center`: a robust coefficient
    of variation; 0 for no values or a center that is not positive."""
    if not values or center <= 0:
        return 0.0
    return MAD_SCALE * statistics.median(abs(v - center) for v in values) / center
