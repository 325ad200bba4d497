"""Which samples a worker draws and the dropout seeds it uses; the samples themselves are services.data's.

Order inside an iteration: replica r, micro-batch j takes samples [r * nm * m + j * m, ... + m) (`sample_range`);
sample k of iteration i is the job's global sample i * global_batch_size + k (services/data/batches.py), so the global
batch of an iteration is the same multiset of samples under every plan, split, migration and morph.
"""

from __future__ import annotations

from services.data.order import mix


def dropout_seed(seed: int, iteration: int, micro_batch: int) -> int:
    """RNG seed of one micro-batch (global index replica * nm + j): every stage replays the same stream, and
    activation recompute replays it (recompute.py keeps each checkpointed run's RNG state)."""
    return mix(seed, iteration, micro_batch)


def sample_range(replica: int, micro_batch: int, micro_batch_size: int, num_micro_batches: int) -> tuple[int, int]:
    """[begin, end) sample indices within the iteration for (replica, micro-batch)."""
    begin = replica * num_micro_batches * micro_batch_size + micro_batch * micro_batch_size
    return begin, begin + micro_batch_size
