"""I-JEPA's multi-block masks (Assran et al., "Self-Supervised Learning from Images with a
Joint-Embedding Predictive Architecture", CVPR 2023, section 3 and its `MaskCollator`).

Per image: `targets` target blocks (4), each of an area fraction in `target_scale`
(0.15-0.2) and an aspect ratio (height / width) in `aspect_ratio` (0.75-1.5), and one
context block of an area fraction in `context_scale` (0.85-1.0), square, from which every
target block is removed. As in the official collator, the two sizes are drawn once per
batch (one uniform number each, shared by the scale and the aspect ratio), a block never
reaches the grid's last row or column, a mask must hold more than `min_keep` patches
(after 20 failed positions the context drops its overlap constraint with one more target
block, the last first), and indices are row-major and ascending.

At native resolution each image's blocks are drawn on its own grid from the batch's two
draws; `common_length` cuts every mask of a batch to the shortest one of its kind, as the
official collator does, for a stacked batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ATTEMPTS = 20  # positions tried before the context drops a target's constraint


@dataclass
class BlockMasks:
    """One image's masks, as patch indices (int64, ascending, row-major over its grid).

    Attributes:
        context: `[K_c]`, the patches the context encoder sees.
        targets: one `[K_t]` per target block, the patches the predictor predicts.
    """

    context: torch.Tensor
    targets: list[torch.Tensor]


def block_size(draw: float, grid: tuple[int, int], scale: tuple[float, float],
               aspect_ratio: tuple[float, float]) -> tuple[int, int]:
    """A block's (height, width) on `grid` from one uniform `draw` in [0, 1): the area
    fraction and the aspect ratio both at `draw` along their ranges, as the official
    `_sample_block_size`; each side at most the grid's side minus one."""
    rows, cols = grid
    fraction = scale[0] + draw * (scale[1] - scale[0])
    area = int(rows * cols * fraction)
    aspect = aspect_ratio[0] + draw * (aspect_ratio[1] - aspect_ratio[0])
    height = int(round(math.sqrt(area * aspect)))
    width = int(round(math.sqrt(area / aspect)))
    return max(1, min(height, rows - 1)), max(1, min(width, cols - 1))


def _place(size: tuple[int, int], grid: tuple[int, int],
           generator: torch.Generator) -> torch.Tensor:
    """A `[rows, cols]` 0/1 grid with one block of `size` at a drawn position."""
    (height, width), (rows, cols) = size, grid
    top = int(torch.randint(0, max(rows - height, 1), (1,), generator=generator))
    left = int(torch.randint(0, max(cols - width, 1), (1,), generator=generator))
    block = torch.zeros(rows, cols, dtype=torch.int32)
    block[top:top + height, left:left + width] = 1
    return block


def image_masks(grid: tuple[int, int], target_size: tuple[int, int],
                context_size: tuple[int, int], generator: torch.Generator, *,
                targets: int = 4, min_keep: int = 10) -> BlockMasks:
    """One image's context and target blocks on its `grid` (see the module docstring).

    Raises:
        ValueError: when a block of the given size cannot hold more than `min_keep` patches
            (the official collator would draw forever).
    """
    for name, (height, width) in (("target", target_size), ("context", context_size)):
        if height * width <= min_keep:
            raise ValueError(
                f"a {name} block of {height} x {width} patches on a {grid[0]} x {grid[1]} grid "
                f"holds no more than min_keep={min_keep} patches: use larger images, a smaller "
                f"patch or a smaller min_keep")
    target_masks, complements = [], []
    for _ in range(targets):
        block = _place(target_size, grid, generator)
        target_masks.append(torch.nonzero(block.flatten()).squeeze(-1))
        complements.append(1 - block)
    constrained, attempts = len(complements), ATTEMPTS
    while True:
        block = _place(context_size, grid, generator)
        for complement in complements[:constrained]:
            block = block * complement
        context = torch.nonzero(block.flatten()).squeeze(-1)
        if len(context) > min_keep:
            return BlockMasks(context, target_masks)
        attempts -= 1
        if attempts == 0:
            constrained, attempts = max(constrained - 1, 0), ATTEMPTS


def batch_masks(grids: list[tuple[int, int]], generator: torch.Generator, *,
                context_scale: tuple[float, float] = (0.85, 1.0),
                target_scale: tuple[float, float] = (0.15, 0.2),
                aspect_ratio: tuple[float, float] = (0.75, 1.5), targets: int = 4,
                min_keep: int = 10,
                size_generator: torch.Generator | None = None) -> list[BlockMasks]:
    """Masks for a batch of images with these patch `grids`: the target's and the context's
    size draws first (once per batch, in the official order, from `size_generator` when
    given, as the official collator seeds them by its batch counter), then each image's
    positions, all from `generator`."""
    sizes = generator if size_generator is None else size_generator
    target_draw = float(torch.rand(1, generator=sizes))
    context_draw = float(torch.rand(1, generator=sizes))
    return [image_masks(grid, block_size(target_draw, grid, target_scale, aspect_ratio),
                        block_size(context_draw, grid, context_scale, (1.0, 1.0)),
                        generator, targets=targets, min_keep=min_keep)
            for grid in grids]


def common_length(masks: list[BlockMasks]) -> list[BlockMasks]:
    """Every context cut to the batch's shortest, every target to the shortest target (the
    official collator's truncation, which keeps the lowest indices), for stacked batches."""
    context = min(len(m.context) for m in masks)
    target = min(len(t) for m in masks for t in m.targets)
    return [BlockMasks(m.context[:context], [t[:target] for t in m.targets]) for m in masks]
