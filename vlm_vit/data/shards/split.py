"""Splits of a stream without reading it first: held-out keys, and a rank's shards."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence

from vlm_vit.data.samples import mixed_seed
from vlm_vit.data.shards.reader import Sample

logger = logging.getLogger(__name__)

def held_out(key: str, fraction: float, seed: int) -> bool:
    """Whether a sample belongs to the held-out part: a seeded hash of its key, so a stream
    can split without reading the whole dataset first."""

    crc = zlib.crc32(key.encode("utf-8", "surrogateescape"))  # a key's bytes: any name
    return fraction > 0 and mixed_seed(seed, crc) / 2 ** 63 < fraction


class KeySplit:
    """Keeps the training part (`test=False`) or the held-out part of a `held_out` split."""

    def __init__(self, fraction: float, seed: int, test: bool) -> None:
        self.fraction, self.seed, self.test = fraction, seed, test

    def __call__(self, sample: Sample) -> bool:
        return held_out(sample.key, self.fraction, self.seed) == self.test


def rank_shards(shards: Sequence[str], rank: int, world_size: int) -> list[int]:
    """The indices of the shards rank `rank` of `world_size` handles in a single pass
    (encoding): every world_size-th, so uneven counts differ by at most one shard."""
    return list(range(rank, len(shards), world_size))
