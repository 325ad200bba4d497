"""Job morphing (Varuna §4): what the scheduler records when a running job loses a worker or a host, and how
it reads that back. Pure: events in, decisions out; no grpc, no store.

A loss moves the job RUNNING -> MORPHING with a MORPHING event that carries everything the resume needs (cause,
layout, plan version, iterations reached, detection time), so a planner that restarts mid-morph loses nothing.
Once every survivor has exited the job goes back to QUEUED (reason `morphing`) and admission treats it as a
job that may run on any device count up to its plan's, re-planning it (same global batch) for what is free.
When it starts again, the MORPHED event and a job_morphs row record the new layout and what was lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from ballast.v1 import job_pb2

WORKER_LOST, HOST_LOST, STRAGGLER, GROW = "worker_lost", "host_lost", "straggler", "grow"
RESIZE = "resize"  # an elastic job moved to the device count the allocation policy gave it (elastic.py)
CHOSEN = (GROW, RESIZE)  # morphs the scheduler chose, not losses: they spend no retry budget
HOUR_S = 3600.0


@dataclass(frozen=True)
class Loss:
    """A morph in progress: detected, not resumed yet."""

    cause: str
    detail: str
    detected_at: float  # epoch seconds
    from_stages: int
    from_replicas: int
    from_plan_version: int
    failed_iteration: int
    lost_hosts: tuple[str, ...] = ()
    to_devices: int = 0  # a chosen morph's device count (grow, resize); 0: what is free

    def attributes(self) -> dict[str, str]:
        return {"cause": self.cause, "detail": self.detail[:500], "detected_at": f"{self.detected_at:.6f}",
                "from_stages": str(self.from_stages), "from_replicas": str(self.from_replicas),
                "from_plan_version": str(self.from_plan_version), "failed_iteration": str(self.failed_iteration),
                "lost_hosts": ",".join(self.lost_hosts), "to_devices": str(self.to_devices)}

    @classmethod
    def from_attributes(cls, a: dict[str, str]) -> Loss:
        return cls(cause=a.get("cause", WORKER_LOST), detail=a.get("detail", ""),
                   detected_at=float(a.get("detected_at", "0") or 0), from_stages=int(a.get("from_stages", "1")),
                   from_replicas=int(a.get("from_replicas", "1")),
                   from_plan_version=int(a.get("from_plan_version", "1")),
                   failed_iteration=int(a.get("failed_iteration", "0")),
                   lost_hosts=tuple(h for h in a.get("lost_hosts", "").split(",") if h),
                   to_devices=int(a.get("to_devices", "0") or 0))


def pending_loss(events: list[job_pb2.JobEvent]) -> Loss | None:
    """The job's morph in progress: its last MORPHING event, unless a MORPHED (resumed) event followed it."""
    for event in reversed(events):
        if event.type == "MORPHED":
            return None
        if event.type == "MORPHING":
            return Loss.from_attributes(dict(event.attributes))
    return None


def losses_since(events: list[job_pb2.JobEvent], since: float) -> int:
    """Losses the job morphed through after `since` (epoch seconds): its infrastructure retry budget's use
    (growing onto devices that came back is no loss)."""
    return sum(1 for e in events if e.type == "MORPHING" and e.attributes.get("cause") not in CHOSEN
               and e.created_at.ToMicroseconds() / 1e6 >= since)


def morphed_message(loss: Loss, stages: int, replicas: int, resume_iteration: int) -> str:
    """The MORPHED event's message: what was lost and what the job runs on now."""
    lost = max(0, loss.failed_iteration - resume_iteration)
    return (f"morphed after {loss.cause.replace('_', ' ')} ({loss.detail}): {loss.from_stages}x{loss.from_replicas} "
            f"-> {stages}x{replicas} (stages x replicas), resuming from iteration {resume_iteration}; "
            f"{lost} iteration(s) trained again")
