"""The morph record's pure parts: what a MORPHING event carries, which morph is in progress, the budget's use."""

from __future__ import annotations

from ballast.v1 import job_pb2
from services.planner.jobs import morph


def event(kind: str, at_s: float, **attributes: str) -> job_pb2.JobEvent:
    e = job_pb2.JobEvent(type=kind, attributes=attributes)
    e.created_at.FromMicroseconds(int(at_s * 1e6))
    return e


LOSS = morph.Loss(morph.HOST_LOST, "host h2 stopped answering", 1000.5, 2, 1, 3, 17, ("h2",))


def test_a_loss_survives_its_event_attributes():
    assert morph.Loss.from_attributes(LOSS.attributes()) == LOSS


def test_the_pending_loss_is_the_last_morphing_not_yet_morphed():
    first = event("MORPHING", 10, **LOSS.attributes())
    assert morph.pending_loss([event("ASSIGNED", 1), first]) == LOSS
    assert morph.pending_loss([first, event("QUEUED", 11), event("MORPHED", 12)]) is None
    again = morph.Loss(morph.WORKER_LOST, "rank 0 killed by SIGKILL", 2000.0, 1, 1, 4, 30)
    later = [first, event("MORPHED", 12), event("MORPHING", 20, **again.attributes())]
    assert morph.pending_loss(later) == again
    assert morph.pending_loss([event("ADMITTED", 1), event("ASSIGNED", 2)]) is None


def test_the_budget_counts_morphs_within_the_window():
    log = [event("MORPHING", 100), event("MORPHED", 110), event("MORPHING", 4000), event("PREEMPTED", 4100),
           event("MORPHING", 4200, cause=morph.GROW)]  # growing back is not a loss
    assert morph.losses_since(log, 0) == 2
    assert morph.losses_since(log, 3600) == 1
    assert morph.losses_since(log, 5000) == 0


def test_the_morphed_message_says_what_changed_and_what_was_lost():
    text = morph.morphed_message(LOSS, 1, 1, 15)
    assert "2x1 -> 1x1" in text and "iteration 15" in text and "2 iteration(s) trained again" in text
