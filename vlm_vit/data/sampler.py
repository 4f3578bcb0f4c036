"""The global batch sampler of map-style datasets: exactly resumable at any batch of any epoch."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from vlm_vit.data.samples import mixed_seed


class GlobalBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's slice of each global batch, resuming at any batch of any epoch.

    The order is a permutation of the dataset seeded by (seed, epoch); batch b is items
    `[b * B, (b + 1) * B)` of it, and rank r gets the r-th of `world_size` equal parts. The
    last incomplete batch is dropped, so every step sees exactly B images (before
    undecodable ones are removed) and no index is repeated to pad, unlike
    `DistributedSampler`.

    With `lengths`, batches hold samples of similar length (less padding in sequence
    models): the permutation is cut into windows of `group_batches` global batches, each
    window is sorted by length (largest first), cut into batches, and the batches' order is
    shuffled within the window. Negative lengths mark another modality (LLaVA's text-only
    records) and sort after every positive one, so batches rarely mix the two.

    Args:
        num_samples: the dataset's length.
        global_batch_size: B, over all processes.
        seed: the run's seed.
        epoch: whose permutation to use.
        start_batch: the first batch to yield (to resume in the middle of an epoch).
        rank: this process.
        world_size: the number of processes; must divide B.
        lengths: per sample, a length to group batches by (see above); None: no grouping.
        group_batches: global batches per sorting window.

    Raises:
        ValueError: when the dataset holds fewer than B items, B does not divide by
            `world_size`, or `start_batch` is past the epoch.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        *,
        seed: int,
        epoch: int = 0,
        start_batch: int = 0,
        rank: int = 0,
        world_size: int = 1,
        lengths: Sequence[int] | None = None,
        group_batches: int = 32,
    ) -> None:
        if lengths is not None and len(lengths) != num_samples:
            raise ValueError(f"{len(lengths)} lengths for {num_samples} samples")
        if global_batch_size % world_size:
            raise ValueError(f"global batch size {global_batch_size} is not divisible by "
                             f"world_size {world_size}")
        self.num_batches = batches_per_epoch(num_samples, global_batch_size)
        if not 0 <= start_batch <= self.num_batches:
            raise ValueError(f"start_batch {start_batch} is outside the epoch's "
                             f"{self.num_batches} batches")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed, self.epoch, self.start_batch = seed, epoch, start_batch
        self.rank, self.world_size = rank, world_size
        self.lengths = None if lengths is None else torch.as_tensor(lengths, dtype=torch.int64)
        self.group_batches = group_batches

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(mixed_seed(self.seed, self.epoch))
        order = torch.randperm(self.num_samples, generator=generator)
        if self.lengths is not None:
            order = self._grouped(order, generator)
        per_rank = self.global_batch_size // self.world_size
        for batch in range(self.start_batch, self.num_batches):
            start = batch * self.global_batch_size + self.rank * per_rank
            yield order[start:start + per_rank].tolist()

    def __len__(self) -> int:
        return self.num_batches - self.start_batch

    def _grouped(self, order: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        size = self.global_batch_size
        parts = []
        for window in order.split(size * self.group_batches):
            # Stable, so equal lengths keep the permutation's (random) order.
            ranked = window[torch.sort(self.lengths[window], descending=True, stable=True)[1]]
            batches = list(ranked.split(size))
            complete = [b for b in batches if len(b) == size]
            shuffled = [complete[i] for i in torch.randperm(len(complete), generator=generator)]
            parts.extend(shuffled + [b for b in batches if len(b) < size])
        return torch.cat(parts)


def batches_per_epoch(num_samples: int, global_batch_size: int) -> int:
    """Complete global batches in one pass over the data.

    Raises:
        ValueError: when the dataset is smaller than one batch.
    """
    if num_samples < global_batch_size:
        raise ValueError(f"the dataset has {num_samples} items, fewer than one batch of "
                         f"{global_batch_size}")
    return num_samples // global_batch_size
