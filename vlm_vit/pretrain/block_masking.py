"""Block-wise masks for masked image modelling: BEiT's `MaskingGenerator` (Bao et al., "BEiT:
BERT Pre-Training of Image Transformers", ICLR 2022) and the per-batch plan of DINOv2's
`collate_data_and_cast` (Oquab et al., "DINOv2: Learning Robust Visual Features without
Supervision", TMLR 2024), for images whose patch grids may differ.

Every draw comes from the `torch.Generator` passed in (never Python's `random` or torch's
global generator, which the references use), so a seeded run masks the same patches again
and a resumed one continues from the generator's saved state.
"""

from __future__ import annotations

import math

import torch


def _uniforms(generator: torch.Generator, count: int) -> list[float]:
    """`count` float64 draws from [0, 1) (float32 would round the areas and ratios)."""
    return torch.rand(count, dtype=torch.float64, generator=generator).tolist()


def _add_block(mask: torch.Tensor, budget: float, generator: torch.Generator,
               min_patches: float, log_aspect: tuple[float, float]) -> int:
    """Masks one rectangle adding between 1 and `budget` patches, in at most 10 attempts (as
    BEiT); returns how many it added, 0 if every attempt failed."""
    height, width = mask.shape
    for _ in range(10):
        area_draw, aspect_draw, top_draw, left_draw = _uniforms(generator, 4)
        area = min_patches + (budget - min_patches) * area_draw  # budget < min_patches is fine
        aspect = math.exp(log_aspect[0] + (log_aspect[1] - log_aspect[0]) * aspect_draw)
        h = int(round(math.sqrt(area * aspect)))
        w = int(round(math.sqrt(area / aspect)))
        if h >= height or w >= width:  # BEiT keeps every block smaller than the grid
            continue
        top = min(int(top_draw * (height - h + 1)), height - h)  # uniform over the positions
        left = min(int(left_draw * (width - w + 1)), width - w)
        block = mask[top:top + h, left:left + w]
        added = h * w - int(block.sum())
        if 0 < added <= budget:
            block.fill_(True)
            return added
    return 0


def block_mask(grid: tuple[int, int], num_masked: int, generator: torch.Generator, *,
               min_patches: float = 4, max_patches: float | None = None,
               min_aspect: float = 0.3, max_aspect: float | None = None) -> torch.Tensor:
    """BEiT's block-wise mask of one image: rectangles until `num_masked` patches are masked.

    Each rectangle has an area drawn uniformly from `[min_patches, min(left, max_patches)]`
    (`left` the patches still to mask) and an aspect ratio (height / width) drawn
    log-uniformly from `[min_aspect, max_aspect]`, sides rounded, strictly smaller than the
    grid, at a uniform position. It is kept when it masks at least one new patch and no more
    than that bound; masking stops at `num_masked` or when 10 attempts in a row add nothing,
    so a mask can hold fewer patches than asked (never more).

    Args:
        grid: the image's patch grid (H, W).
        num_masked: the patches to mask, at most.
        generator: a CPU generator, the only source of randomness.
        min_patches: the smallest rectangle area drawn (4).
        max_patches: the largest rectangle area drawn; `0.5 * H * W` when None, as DINOv2's
            `train.py` (BEiT's default is `num_masked`).
        min_aspect: the smallest aspect ratio (0.3).
        max_aspect: the largest aspect ratio; `1 / min_aspect` when None.

    Returns:
        A bool mask `[H, W]`, True where a patch is masked.

    Raises:
        ValueError: for an empty grid, a negative count or an invalid aspect range.
    """
    height, width = grid
    if height < 1 or width < 1:
        raise ValueError(f"grid must be at least 1 x 1, got {grid}")
    if num_masked < 0:
        raise ValueError(f"num_masked must not be negative, got {num_masked}")
    max_aspect = 1 / min_aspect if max_aspect is None else max_aspect
    if not 0 < min_aspect <= max_aspect:
        raise ValueError(f"aspect range must satisfy 0 < min <= max, got "
                         f"({min_aspect}, {max_aspect})")
    max_patches = 0.5 * height * width if max_patches is None else max_patches
    log_aspect = (math.log(min_aspect), math.log(max_aspect))
    mask = torch.zeros(height, width, dtype=torch.bool)
    count = 0
    while count < num_masked:
        added = _add_block(mask, min(num_masked - count, max_patches), generator, min_patches,
                           log_aspect)
        if added == 0:
            break
        count += added
    return mask


def batch_block_masks(grids: list[tuple[int, int]], generator: torch.Generator,
                      mask_probability: float = 0.5,
                      ratio: tuple[float, float] = (0.1, 0.5)) -> list[torch.Tensor]:
    """DINOv2's masks for a batch: some images masked, with stratified ratios.

    `n = int(B * mask_probability)` images are masked. The ratio range is cut into n equal
    strata (`linspace(min, max, n + 1)`); stratum i draws a ratio uniformly within itself and
    its image masks `int(H_i * W_i * ratio)` patches of its own grid with `block_mask`. Which
    images are masked, and with which stratum, is a uniform random assignment: DINOv2 shuffles
    the list of masks, which needs every image to share one grid; assigning the strata to a
    random permutation of the images gives the same distribution for any grids.

    Args:
        grids: the patch grid (H, W) of each image, in batch order.
        generator: a CPU generator, the only source of randomness.
        mask_probability: the fraction of images masked, in [0, 1] (0.5, as DINOv2).
        ratio: (min, max) of the masked fraction of a masked image, 0 <= min <= max < 1
            ((0.1, 0.5), as DINOv2).

    Returns:
        One bool mask `[H_i, W_i]` per image, in batch order; all False for an unmasked image.

    Raises:
        ValueError: if `mask_probability` or `ratio` is out of range.
    """
    if not 0.0 <= mask_probability <= 1.0:
        raise ValueError(f"mask probability must lie in [0, 1], got {mask_probability}")
    low, high = ratio
    if not 0.0 <= low < 1.0 or not 0.0 <= high < 1.0:
        raise ValueError(f"mask ratio must lie in [0, 1), got {ratio}")
    if low > high:
        raise ValueError(f"mask ratio must be (min, max) with min <= max, got {ratio}")
    masked = int(len(grids) * mask_probability)
    bounds = torch.linspace(low, high, masked + 1, dtype=torch.float64).tolist()
    order = torch.randperm(len(grids), generator=generator).tolist()
    draws = _uniforms(generator, masked)
    masks = [torch.zeros(grid, dtype=torch.bool) for grid in grids]
    for stratum, (image, draw) in enumerate(zip(order[:masked], draws, strict=True)):
        share = bounds[stratum] + (bounds[stratum + 1] - bounds[stratum]) * draw
        height, width = grids[image]
        masks[image] = block_mask(grids[image], int(height * width * share), generator)
    return masks
