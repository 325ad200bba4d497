"""ParallelDims: the named parallel axes of a job and its rank layout; pure arithmetic, no torch, no groups.

One object for the planner's placement (jobs/assign.py, admission, recovery) and the workers (train/config.py,
launch.py, mesh.py): a job's ranks are laid out here and nowhere else, so nobody computes a rank, a stage or a
replica by hand. Axes are named: "pp" (pipeline stage) and "dp" (the stage's devices, one replica each).
Tensor and sharded data parallelism split a stage's devices per layer (`plan.layers[i]`: dp x sdp x tp = the
stage's devices, TP innermost), so they are not job-wide axes; mesh.py builds their groups inside the "dp" line.
"the same replica on stage s + 1" is `peer(rank, "pp", s + 1)`.

Layout: row-major over `NAMES`, outermost first, the layout of `torch.arange(world).reshape(sizes)` that
`init_device_mesh` uses. With (pp, dp) that is stage-major, `rank = stage * dp + replica`: the replicas of one
stage hold consecutive ranks, and stage s replica r talks p2p to stage s + 1 replica r.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from math import prod
from typing import ClassVar

from ballast.v1 import plan_pb2


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1  # pipeline stages
    dp: int = 1  # data-parallel replicas of every stage

    NAMES: ClassVar[tuple[str, ...]] = ("pp", "dp")  # outermost first: the rank layout's order

    def __post_init__(self) -> None:
        for name, size in zip(self.NAMES, self.sizes, strict=True):
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"ParallelDims.{name}: must be an integer >= 1, got {size!r}")

    @classmethod
    def of_plan(cls, plan: plan_pb2.Plan) -> ParallelDims:
        """A plan's layout: its stages, each over the same device count (ValueError naming the counts if not)."""
        counts = sorted({max(int(s.devices), 1) for s in plan.stages})
        if len(counts) != 1:
            raise ValueError(f"plan {plan.id}: stages over {counts or 'no'} device count(s); executors run "
                             "stages of equal device counts")
        return cls(pp=len(plan.stages), dp=counts[0])

    def stage_and_replica(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of `rank`."""
        where = self.coords(rank)
        return where["pp"], where["dp"]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in self.NAMES)

    @property
    def world_size(self) -> int:
        return prod(self.sizes)

    def size(self, axis: str) -> int:
        return self.sizes[self._axis(axis)]

    def coords(self, rank: int) -> dict[str, int]:
        """Axis name -> this rank's index along it."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        out: dict[str, int] = {}
        for name, size in reversed(list(zip(self.NAMES, self.sizes, strict=True))):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in self.NAMES}

    def rank(self, **coords: int) -> int:
        """The rank at these coordinates; every axis must be named (a missing one is an error, not 0)."""
        if set(coords) != set(self.NAMES):
            raise ValueError(f"give a coordinate for exactly the axes {self.NAMES}, got {sorted(coords)}")
        rank = 0
        for name, size in zip(self.NAMES, self.sizes, strict=True):
            index = coords[name]
            if not 0 <= index < size:
                raise ValueError(f"{name} index {index} outside [0, {size})")
            rank = rank * size + index
        return rank

    def peer(self, rank: int, axis: str, index: int) -> int:
        """The rank with `rank`'s coordinates except `index` along `axis`."""
        return self.rank(**{**self.coords(rank), axis: index})

    def line(self, rank: int, axis: str) -> list[int]:
        """The ranks along `axis` through `rank`, by index along the axis (e.g. a stage's replicas for "dp")."""
        return [self.peer(rank, axis, i) for i in range(self.size(axis))]

    def lines(self, axis: str) -> list[list[int]]:
        """Every line along `axis`, ordered by the other coordinates (row-major): the order in which every rank
        creates one group per line, as `torch.distributed` requires."""
        self._axis(axis)
        others = [(name, size) for name, size in zip(self.NAMES, self.sizes, strict=True) if name != axis]
        starts = product(*(range(size) for _, size in others))
        return [self.line(self.rank(**dict(zip([n for n, _ in others], s, strict=True)), **{axis: 0}), axis)
                for s in starts]

    def _axis(self, axis: str) -> int:
        if axis not in self.NAMES:
            raise ValueError(f"unknown parallel axis {axis!r}; the axes are {self.NAMES}")
        return self.NAMES.index(axis)
