"""The order samples are drawn in: every training sample once per epoch, epochs reshuffled from the seed.

Global sample n of a job (iteration i draws n = i * global_batch_size + k) is in epoch n // N at position n % N, and
that position maps to a sample index through a permutation of [0, N) keyed by (seed, epoch): a four-round Feistel
network over the smallest even number of bits that holds N, walked until it lands inside [0, N) (Black and
Rogaway's cycle walking; at most ~4 steps on average). It needs no table, so an epoch of a billion samples costs
nothing to shuffle, and any rank computes any sample's index on its own.
"""

from __future__ import annotations

_MASK = (1 << 64) - 1
ROUNDS = 4


def mix(*values: int) -> int:
    """splitmix64 over the values: a well-spread 63-bit seed from small integers."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 31
    return h >> 1


def permuted(position: int, n: int, key: int) -> int:
    """Position `position` of a keyed permutation of [0, n)."""
    if not 0 <= position < n:
        raise ValueError(f"position {position} outside [0, {n})")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = position
    while True:
        left, right = x >> half, x & mask
        for r in range(ROUNDS):
            left, right = right, left ^ (mix(key, r, right) & mask)
        x = (left << half) | right
        if x < n:
            return x


def train_index(sample: int, n: int, seed: int) -> tuple[int, int]:
    """(epoch, index) of a job's global training sample `sample` over `n` training samples."""
    epoch, position = divmod(sample, n)
    return epoch, permuted(position, n, mix(seed, epoch, 0xDA7A))
