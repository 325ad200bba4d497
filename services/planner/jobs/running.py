"""What the planner tracks of a job whose workers it started, and the words that classify a worker's exit.
No grpc imports; shared by the scheduler and its collaborators (recovery.py, stragglers.py, elastic.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ballast.v1 import fleet_pb2, job_pb2, plan_pb2
from services.planner.jobs import morph, stutter
from services.planner.jobs.assign import pipeline_shape
from services.runtime.errors import FailedPrecondition
from services.specs import placement as placement_spec

S = job_pb2.JobState
# A worker whose peer died fails in its next collective; the dead peer's own exit (a signal, its error) is the
# cause the user needs, and it usually arrives within milliseconds of the symptom.
SYMPTOMS = ("connection closed", "connection reset", "broken pipe", "gloo", "nccl", "timed out", "timeout")
SYMPTOM_GRACE_S = 2.0
END_ATTEMPTS = 5
HOST_LOST_S = 5.0  # an agent away this long has lost its host: its jobs morph (a reconnect within it changes nothing)
RECONNECT_GRACE_S = 12.0  # after a planner start agents reconnect with a backoff of up to 10 s: none is lost before
MAX_MORPHS_PER_HOUR = 10  # infrastructure retry budget per job; errors in the model's code are never retried
GROW_WINDOW = 8  # iterations measured on its current layout before a job is considered for growing
PERSIST_WINDOWS = 2  # consecutive windows a straggler must be found in before it is reported or left out
GROW_WARMUP = 3  # first iterations on the target layout left out of its measured time
DEFAULT_MORPH_COST_S = 10.0  # what a morph is assumed to cost until the job has measured one
PAROLE_CHECK_S = 5.0  # how often degraded hosts are read for one whose parole is served
MAX_PAROLE_S = 24 * 3600.0


def parole_s(base_s: float, caught: int) -> float:
    """A degraded host's time out after being caught `caught` times (1 = the first): doubling, at most a day."""
    return min(base_s * 2.0 ** max(caught - 1, 0), MAX_PAROLE_S)


def is_symptom(message: str) -> bool:
    """Whether a worker's exit message only says a collective or p2p transfer broke."""
    text = message.lower()
    return any(word in text for word in SYMPTOMS)


@dataclass
class Running:
    """What the planner tracks for a job whose workers it started."""

    job: job_pb2.Job
    plan: plan_pb2.Plan
    hosts: list[str]  # host ids running its workers
    world: int
    finished: set[int] = field(default_factory=set)
    exited: set[int] = field(default_factory=set)
    stopping: str = ""  # why Stop was sent ("" while running normally)
    last_loss: float | None = None
    parts: dict[int, dict[int, job_pb2.LayerCheckpoint]] = field(default_factory=dict)  # iteration -> layer -> file
    symptom: str = ""  # the first exit that only reported a broken collective (the cause may follow)
    preempting: str = ""  # the job it is drained for, while being preempted
    drained: set[int] = field(default_factory=set)  # ranks that stopped at the agreed boundary, checkpointed
    ranks: dict[str, list[int]] = field(default_factory=dict)  # host id -> its ranks
    iteration: int = 0  # iterations completed, as the workers report them
    loss: morph.Loss | None = None  # set once a worker or host is lost: the job morphs
    morph_id: str = ""  # the morph it resumed from, until its first iteration is reported
    stored: set[int] = field(default_factory=set)  # iterations whose complete checkpoint is stored
    failed_checkpoints: set[int] = field(default_factory=set)  # iterations whose checkpoint met a disk error
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=GROW_WINDOW))  # last iteration times
    target: int = 0  # the devices it was first planned for (or --max-devices): what it grows back to
    target_iteration_s: float = 0.0  # the predicted iteration time of its first plan for `target` devices
    target_measured_s: float = 0.0  # its median measured iteration time under that plan, before it shrank
    watch: stutter.StutterWatch = field(default_factory=stutter.StutterWatch)  # fail-stutter: compute per replica
    stutter_next: int = 0  # the iteration count at which the straggler test runs next
    stutter_seen: int = 0  # consecutive windows that found a straggler
    stutter_reported: bool = False  # a STRAGGLER event was written (once, unless the verdict is to leave it out)
    resume_iteration: int = 0
    # devices -> (the simulator's iteration time for its re-plan on that many, "" or why no plan fits)
    replanned: dict[int, tuple[float, str]] = field(default_factory=dict)
    # devices -> (its median measured iteration time on an earlier plan with that many, that plan's version)
    measured_on: dict[int, tuple[float, int]] = field(default_factory=dict)
    placement: fleet_pb2.JobPlacement | None = None  # where its ranks run, as stored with its leases

    @classmethod
    def placed(cls, job: job_pb2.Job, plan: plan_pb2.Plan, placement: fleet_pb2.JobPlacement, **kw) -> Running:
        """A job started on `placement`: its hosts, world and ranks are read from it, never derived again."""
        return cls(job, plan, placement_spec.hosts(placement), placement.world_size,
                   ranks=placement_spec.ranks_by_host(placement), placement=placement, **kw)


def devices_of(plan: plan_pb2.Plan) -> int:
    try:
        return pipeline_shape(plan).world_size
    except FailedPrecondition:
        return 0


