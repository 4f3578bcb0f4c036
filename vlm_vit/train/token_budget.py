"""Token-budget batching: packs of variable-size images with at most N tokens each.

At native resolution images differ in token count, so a fixed batch size either wastes
memory on small images or overflows on large ones. Here items are grouped by first-fit
decreasing into packs whose token counts sum to at most ``max_tokens`` (NaViT's packing,
Qwen2-VL's ``max_tokens`` budget); `TokenBudgetBatchSampler` yields those packs as batches.

    lengths = [tokens_for_size(size, patch_size=16, num_prefix_tokens=1) for size in sizes]
    sampler = TokenBudgetBatchSampler(lengths, max_tokens=4096, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=list_of_tensors)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from vlm_vit.data.samples import ImageBatch, mixed_seed

logger = logging.getLogger(__name__)


def tokens_for_size(size: tuple[int, int], patch_size: int | tuple[int, int],
                    num_prefix_tokens: int = 0) -> int:
    """The encoder sequence length of one image: its patches plus the prefix tokens.

    For example a 742 x 1330 image with patch 14 is a 53 x 95 grid: 5,035 tokens, 5,036 with
    a class token.

    Args:
        size: The image's (height, width) in pixels, each a multiple of the patch size.
        patch_size: The patch side, or (height, width) of a patch.
        num_prefix_tokens: Class and register tokens added to every image.

    Returns:
        ``(height // patch_height) * (width // patch_width) + num_prefix_tokens``.

    Raises:
        ValueError: If a side is not a positive multiple of the patch size, or a value is
            not a positive (prefix: non-negative) int.
    """
    patch = (patch_size, patch_size) if _is_int(patch_size) else tuple(patch_size)
    if len(patch) != 2 or not all(_is_int(p) and p > 0 for p in patch):
        raise ValueError(f"patch_size must be a positive int or (height, width), got "
                         f"{patch_size!r}")
    if len(size) != 2 or not all(_is_int(s) and s > 0 for s in size):
        raise ValueError(f"size must be a (height, width) of positive ints, got {size!r}")
    if not (_is_int(num_prefix_tokens) and num_prefix_tokens >= 0):
        raise ValueError(f"num_prefix_tokens must be a non-negative int, got "
                         f"{num_prefix_tokens!r}")
    (height, width), (patch_height, patch_width) = size, patch
    if height % patch_height or width % patch_width:
        raise ValueError(f"image of height {height} and width {width} is not a multiple of "
                         f"the patch size {patch_height} x {patch_width}")
    return int((height // patch_height) * (width // patch_width) + num_prefix_tokens)


def first_fit_decreasing(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Groups item indices into packs whose lengths sum to at most ``max_tokens``.

    Items are taken longest first (ties in index order) and each goes into the first pack,
    in opening order, that still has room, or opens a new one. FFD uses at most
    11/9 OPT + 6/9 packs (Dosa 2007). A segment tree over the packs' free space finds that
    first pack in O(log n), so a million items take seconds.

    For example lengths ``[5, 7, 3, 2, 4, 6]`` with ``max_tokens=10`` give
    ``[[1, 2], [5, 4], [0, 3]]``, lengths ``[7, 3], [6, 4], [5, 2]``: 7 opens pack 0; 6
    does not fit beside it and opens pack 1; 5 opens pack 2; 4 joins 6 (10); 3 joins 7
    (10); 2 joins 5 (7).

    Args:
        lengths: Per item, its token count (a non-negative int); a list, or a 1-D integer
            tensor or array.
        max_tokens: The budget of one pack.

    Returns:
        The packs in the order they were opened, each the indices it holds in the order
        they were placed (longest first). Every index appears exactly once.

    Raises:
        ValueError: If ``max_tokens`` is not a positive int, or an item's count is
            negative, not an int, or more than ``max_tokens`` (naming the item).
    """
    if not (_is_int(max_tokens) and max_tokens > 0):
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    counts = _checked_lengths(lengths, max_tokens)
    if not counts:
        return []
    order = sorted(range(len(counts)), key=lambda i: -counts[i])  # stable: ties by index
    # Leaves: free space of packs 0..n-1 (unopened packs are empty, max_tokens free, so the
    # leftmost leaf with room is the first open pack with room, else the next new pack).
    # Inner node k holds the max of its children 2k and 2k + 1.
    leaves = 1 << (len(counts) - 1).bit_length()
    free = [max_tokens] * (2 * leaves)
    packs: list[list[int]] = []
    for index in order:
        need, node = counts[index], 1
        while node < leaves:  # descend to the leftmost leaf with free >= need
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        pack = node - leaves
        if pack == len(packs):
            packs.append([])
        packs[pack].append(index)
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return packs


class TokenBudgetBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields packs of dataset indices, each holding at most ``max_tokens`` tokens.

    The packs come from `first_fit_decreasing` once, at construction; they are the same
    every epoch, and with ``shuffle`` their order is a permutation seeded by
    (seed, epoch), so a run is the same for a seed and epochs differ. Every index is in
    exactly one pack each epoch; nothing is dropped or repeated. Use it as
    ``DataLoader(dataset, batch_sampler=sampler, collate_fn=...)`` with a collate that keeps
    the differently sized images as a list. One process: under data parallelism every
    rank would see every pack.

    Args:
        lengths: Per dataset item, its token count, e.g. `tokens_for_size` of its
            native size, or a dataset's ``lengths``.
        max_tokens: The budget of one pack.
        shuffle: Whether to permute the packs' order each epoch; otherwise they come in
            FFD order (largest items first).
        seed: The run's seed for the permutation.

    Raises:
        ValueError: If ``max_tokens`` is not a positive int, or an item's count is
            negative, not an int, or more than ``max_tokens`` (naming the item).
    """

    def __init__(self, lengths: Sequence[int], max_tokens: int, *, shuffle: bool = False,
                 seed: int = 0) -> None:
        if not (_is_int(seed) and seed >= 0):
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.packs = first_fit_decreasing(lengths, max_tokens)
        self.max_tokens, self.shuffle, self.seed, self.epoch = max_tokens, shuffle, seed, 0
        total = sum(_checked_lengths(lengths, max_tokens))
        logger.debug("%d items, %d tokens in %d packs of at most %d (%.1f%% full)",
                     len(lengths), total, len(self.packs), max_tokens,
                     100.0 * total / max(1, len(self.packs) * max_tokens))

    def set_epoch(self, epoch: int) -> None:
        """Chooses the epoch whose permutation `__iter__` yields (with ``shuffle``).

        Raises:
            ValueError: If ``epoch`` is not a non-negative int.
        """
        if not (_is_int(epoch) and epoch >= 0):
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(mixed_seed(self.seed, self.epoch))
            order = torch.randperm(len(self.packs), generator=generator).tolist()
        else:
            order = range(len(self.packs))
        for pack in order:
            yield list(self.packs[pack])  # a copy: callers may change their batch

    def __len__(self) -> int:
        return len(self.packs)


def collate_packed(items: Sequence[torch.Tensor | tuple[torch.Tensor, int]]) -> ImageBatch:
    """Collates `[3, H_i, W_i]` images of different sizes (or `(image, label)` pairs) into a
    batch the trainer hands on whole: `pixel_values` a `vlm_vit.packing.PackedImages`, which
    the encoder, `ImageClassifier` and the LLM bridge encode in one packed pass.

    Raises:
        TypeError: for an item that is neither an image tensor nor an (image, label) pair.
    """
    from vlm_vit.packing import PackedImages

    images, labels = [], []
    for index, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], torch.Tensor):
            images.append(item[0])
            labels.append(int(item[1]))
        elif isinstance(item, torch.Tensor):
            images.append(item)
        else:
            raise TypeError(f"collate_packed got item {index} of type {type(item).__name__}; "
                            "expected a [3, H, W] tensor or an (image, label) pair")
    if labels and len(labels) != len(images):
        raise TypeError("collate_packed got a mix of labelled and unlabelled items")
    return ImageBatch(PackedImages(images), [],
                      torch.tensor(labels, dtype=torch.long) if labels else None)


def _checked_lengths(lengths: Sequence[int], max_tokens: int) -> list[int]:
    """``lengths`` as Python ints, each in 0..max_tokens."""
    if isinstance(lengths, (torch.Tensor, np.ndarray)):
        lengths = lengths.tolist()  # 0-d tensors are not ints; float values stay refused
    counts = []
    for index, count in enumerate(lengths):
        if not (_is_int(count) and count >= 0):
            raise ValueError(f"item {index} has token count {count!r}; expected a "
                             "non-negative int")
        if count > max_tokens:
            raise ValueError(f"item {index} has {int(count)} tokens, more than the budget "
                             f"max_tokens={max_tokens} (it cannot fit in any pack)")
        counts.append(int(count))
    return counts


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
