"""PatrickStar's chunk-tensor mapping schema (§6.1): where each parameter lives in fixed-size chunks.

Parameters are laid out in the model's initialisation order, each at the next free offset of the current chunk;
one that does not fit what is left opens a new chunk. Neighbours in time are neighbours in memory, so one
chunk move serves several accesses. Every chunk has the same size, so a freed chunk's memory fits any other
and a chunk is the natural bucket for a collective. The optimizer-state lists (fp32 parameter, momentum,
variance) use the same offsets, so the step of chunk i touches chunk i of every list and nothing else.

For data parallelism over `world` processes (§7) the list is padded to whole communication groups of `world`
consecutive chunks; chunk `g * world + r` of group g belongs to process r (its *local* chunk), the others are
remote to it and exist there only while gathered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    chunk: int
    offset: int  # elements from the chunk's start
    numel: int


@dataclass(frozen=True)
class ChunkLayout:
    chunk_numel: int
    world: int
    slots: tuple[Slot, ...]  # one per parameter, in the order given
    num_chunks: int  # a multiple of world

    def owner(self, chunk: int) -> int:
        return chunk % self.world

    def group(self, chunk: int) -> range:
        first = chunk - chunk % self.world
        return range(first, first + self.world)

    def slots_of(self, chunk: int) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.chunk == chunk]

    def local_chunks(self, rank: int) -> list[int]:
        return [c for c in range(self.num_chunks) if self.owner(c) == rank]


def plan_chunks(numels: Sequence[int], chunk_numel: int, world: int = 1) -> ChunkLayout:
    if chunk_numel < 1 or world < 1:
        raise ValueError(f"chunk size ({chunk_numel} elements) and world ({world}) must be positive")
    largest = max(numels, default=0)
    if largest > chunk_numel:
        raise ValueError(f"chunk_bytes holds {chunk_numel} elements but a parameter has {largest}: raise chunk_bytes "
                         f"to at least {largest} elements (a tensor never spans chunks)")
    slots, chunk, used = [], 0, 0
    for n in numels:
        if used + n > chunk_numel:
            chunk, used = chunk + 1, 0
        slots.append(Slot(chunk, used, n))
        used += n
    count = chunk + 1 if numels else 0
    count = -(-count // world) * world
    return ChunkLayout(chunk_numel, world, tuple(slots), count)
