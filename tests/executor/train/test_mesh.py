"""The executor's rank layout (dims.ParallelDims): pure arithmetic, no process group. The multi-process train
tests exercise the Mesh's groups themselves."""

from __future__ import annotations

import pytest
import torch

from services.specs.parallel import ParallelDims


def test_layout_is_stage_major():
    dims = ParallelDims(pp=2, dp=3)
    assert dims.world_size == 6 and dims.sizes == (2, 3) and dims.size("dp") == 3
    assert [dims.rank(pp=s, dp=r) for s in range(2) for r in range(3)] == list(range(6))
    assert [dims.coords(rank) for rank in (0, 2, 4)] == [{"pp": 0, "dp": 0}, {"pp": 0, "dp": 2}, {"pp": 1, "dp": 1}]
    assert all(dims.rank(**dims.coords(rank)) == rank for rank in range(6))


def test_lines_and_peers_along_an_axis():
    dims = ParallelDims(pp=3, dp=2)
    assert dims.lines("dp") == [[0, 1], [2, 3], [4, 5]]  # the replicas of each stage
    assert dims.lines("pp") == [[0, 2, 4], [1, 3, 5]]  # each replica index through the pipeline
    assert dims.line(3, "dp") == [2, 3] and dims.line(3, "pp") == [1, 3, 5]
    assert dims.peer(3, "pp", 2) == 5 and dims.peer(3, "pp", 0) == 1 and dims.peer(3, "dp", 0) == 2


@pytest.mark.parametrize("sizes", [(1, 1), (1, 4), (4, 1), (2, 3), (3, 2)])
def test_lines_are_the_device_mesh_groups(sizes):
    # init_device_mesh lays ranks out as arange(world).reshape(sizes) and makes one group per line of each dim,
    # in this order: Mesh takes group("dp") from it, so both layouts must agree.
    dims = ParallelDims(*sizes)
    mesh = torch.arange(dims.world_size).reshape(sizes)
    for axis, name in enumerate(dims.NAMES):
        expected = mesh.movedim(axis, -1).reshape(-1, sizes[axis]).tolist()
        assert dims.lines(name) == expected


def test_bad_sizes_axes_and_coordinates_are_named():
    with pytest.raises(ValueError, match=r"ParallelDims\.dp"):
        ParallelDims(pp=2, dp=0)
    dims = ParallelDims(pp=2, dp=2)
    with pytest.raises(ValueError, match="unknown parallel axis 'tp'"):
        dims.lines("tp")
    with pytest.raises(ValueError, match="exactly the axes"):
        dims.rank(pp=1)  # a missing axis is an error, never a silent 0
    with pytest.raises(ValueError, match="dp index 2 outside"):
        dims.rank(pp=0, dp=2)
    with pytest.raises(ValueError, match="rank 4 outside"):
        dims.coords(4)
