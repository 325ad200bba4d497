"""`ballast profile`'s progress: the ETA estimate and the plain lines printed when stderr is not a terminal."""

from __future__ import annotations

import pytest

from ballast.cli.profile import Eta, clock, progress_line
from ballast.v1 import services_pb2


def test_eta_counts_the_pace_from_the_first_progress_not_from_the_start():
    eta = Eta()
    assert eta(0.0, 0.0) is None  # queued: no progress yet
    assert eta(5.0, 0.1) is None  # the first progress: no pace yet (5 s of start-up are not counted)
    assert eta(7.0, 0.3) == pytest.approx(7.0)  # 0.2 in 2 s: 0.7 left takes 7 s
    assert eta(8.0, 0.3) == pytest.approx(10.5)  # a second without progress: a slower pace
    assert eta(9.0, 0.9) == pytest.approx(0.5)
    assert eta(9.5, 1.0) == 0.0


def test_plain_line_has_fraction_phase_elapsed_eta_and_message():
    update = services_pb2.ProfileProgress(phase="measure", layer_index=1, layers_total=6, micro_batch_size=16,
                                          fraction=0.42, message="measuring block.0 at micro-batch 16")
    assert progress_line(update, 65.2, 7.4) == ("profile  42% measure layer 2/6 m=16  elapsed 1:05 eta 0:07  "
                                                "measuring block.0 at micro-batch 16")
    queued = services_pb2.ProfileProgress(phase="queued", message="waiting for the profiler")
    assert progress_line(queued, 0.0, None) == "profile   0% queued  elapsed 0:00 eta -:--  waiting for the profiler"
    assert clock(-1.0) == "0:00"
