"""Mesh: one rank's view of the ParallelDims, with every process group it will ever use, made once.

torch requires every rank to create every group, members or not, in the same order (Galvatron-BMW §VI), so
all groups are made here, up front, in one fixed order:
1. the regular axes by `init_device_mesh` (pp lines, then dp lines): `group("dp")` is the data-parallel
   gradient allreduce of a stage's replicas. DeviceMesh fits these: its layout is our rank layout (checked
   below), it works with gloo on CPU, it makes no collective while building, and the tensor/sharded data
   parallelism still to come (DTensor, `fully_shard`) takes a DeviceMesh. Its pp lines are made but unused
   (p2p needs one group per direction, below); with NCCL they cost nothing until used.
2. groups that are not whole lines of an axis, by `dist.new_group` (a DeviceMesh cannot express them):
   - tied: for each set of stages holding one shared Parameter, one group per pp line over those stages
     (Varuna §5.1: the shared weight's gradient is summed over its holders);
   - p2p: two groups per adjacent pair along pp, one per direction, so activations and gradients never
     queue behind each other, which NCCL's in-order streams would turn into a deadlock under 1F1B;
   - migration (online only): one group per pp line for every NON-adjacent stage pair, for layer moves that
     skip stages; adjacent moves reuse the pair's forward group, idle between iterations;
   - control (every multi-rank job): one gloo group of every rank for the per-boundary agreement (MIN
     all-reduce of the plan version and the drain flag), gloo even beside NCCL.
3. per tensor-parallel degree t the model uses (hybrid.py), one more `init_device_mesh` of shape
   (pp, dp / t, t), axes ("pp", "dp", "tp"): a stage's replicas regrouped as (dp / t) x t with tp innermost
   (consecutive ranks). `tp_mesh(t)` is this rank's (dp, tp) slice of it.
Live migration moves layers between stages, never ranks: the mesh and its groups outlive every plan change.
O(stages^2 x replicas) groups in all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from services.specs.parallel import ParallelDims

FORWARD, BACKWARD = 0, 1  # p2p directions: activations to the next stage, gradients to the previous one


class Mesh:
    def __init__(self, dims: ParallelDims, rank: int, device_type: str, *, tied_sets: Sequence[tuple[int, ...]],
                 online: bool, tp_degrees: Sequence[int] = ()) -> None:
        """Create every group (collective over the world: every rank calls this at the same point).

        `tied_sets` is model-wide (every rank passes the same list); `online` adds the migration groups that
        live repartitioning needs. The control group exists whenever there is more than one rank: a drain
        (checkpoint, then stop) is agreed on it by every job, online or not."""
        self.dims, self.rank = dims, rank
        self.coords = dims.coords(rank)
        self.device_mesh: DeviceMesh = init_device_mesh(device_type, dims.sizes, mesh_dim_names=dims.NAMES)
        coordinate = self.device_mesh.get_coordinate()
        if coordinate is None or tuple(coordinate) != tuple(self.coords[name] for name in dims.NAMES):
            raise RuntimeError(f"DeviceMesh puts rank {rank} at {coordinate}, the rank layout at {self.coords}")
        me, lines = self.index("pp"), dims.lines("pp")
        self._tied: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for stages in tied_sets:
            for line in lines:
                group = dist.new_group([line[s] for s in stages])
                if rank in line and me in stages:
                    self._tied[stages] = group
        self._p2p: dict[tuple[int, int], dist.ProcessGroup] = {}  # (other stage, direction) -> group
        for s in range(dims.pp - 1):
            for line in lines:
                for direction in (FORWARD, BACKWARD):
                    group = dist.new_group([line[s], line[s + 1]])
                    if rank in line and me in (s, s + 1):
                        self._p2p[(s + 1 if me == s else s, direction)] = group
        self._migration: dict[int, dist.ProcessGroup] = {}  # other, non-adjacent stage -> group
        for s in range(dims.pp if online else 0):
            for t in range(s + 2, dims.pp):
                for line in lines:
                    group = dist.new_group([line[s], line[t]])
                    if rank in line and me in (s, t):
                        self._migration[t if me == s else s] = group
        self.control: dist.ProcessGroup | None = (
            dist.new_group(list(range(dims.world_size)), backend="gloo") if dims.world_size > 1 else None)
        self._tp: dict[int, DeviceMesh] = {}
        for t in sorted(set(tp_degrees)):
            if t < 1 or dims.dp % t:
                raise ValueError(f"tp degree {t} must divide the stage's {dims.dp} ranks")
            self._tp[t] = init_device_mesh(device_type, (dims.pp, dims.dp // t, t),
                                           mesh_dim_names=("pp", "dp", "tp"))["dp", "tp"]

    @property
    def tp_degrees(self) -> list[int]:
        return sorted(self._tp)

    def tp_mesh(self, degree: int) -> DeviceMesh:
        """This rank's (dp, tp) mesh for tensor-parallel degree `degree` (made in __init__ when asked for)."""
        return self._tp[degree]

    def index(self, axis: str) -> int:
        """This rank's index along `axis` (its stage for "pp", its replica for "dp")."""
        self.dims.size(axis)  # names the axes if `axis` is unknown
        return self.coords[axis]

    def peer(self, axis: str, index: int) -> int:
        """Global rank of the rank at `index` along `axis` with this rank's other coordinates."""
        return self.dims.peer(self.rank, axis, index)

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The group along `axis` through this rank; None when the axis has size 1 (nothing to reduce, so no
        collective runs and none is counted)."""
        return self.device_mesh.get_group(axis) if self.dims.size(axis) > 1 else None

    @property
    def tied_sets(self) -> list[tuple[int, ...]]:
        """The stage sets holding a shared Parameter that include this stage, in one global (sorted) order."""
        return sorted(self._tied)

    def tied_group(self, stages: tuple[int, ...]) -> dist.ProcessGroup:
        return self._tied[stages]

    def p2p_group(self, other: int, direction: int) -> dist.ProcessGroup:
        """The group to adjacent stage `other` (same other coordinates) for FORWARD or BACKWARD tensors."""
        return self._p2p[(other, direction)]

    def migration_group(self, other: int) -> dist.ProcessGroup:
        """The group for layer moves between this stage and stage `other` (same other coordinates)."""
        if abs(other - self.index("pp")) == 1:
            return self._p2p[(other, FORWARD)]
        return self._migration[other]
