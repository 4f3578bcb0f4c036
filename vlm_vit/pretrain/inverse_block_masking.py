"""CAPI's inverse block masks (Darcet et al. 2025, section 3.3): one block of patches stays
visible and the rest is masked, `int(N * ratio)` patches (0.65) exactly; the block's aspect
ratio is log-uniform in [min_aspect, 1 / min_aspect] (0.5), clamped so that the block fits
(on a grid too narrow for any of them, the closest that fits),
its position uniform, and it is then rolled across the grid by a uniform shift (so the
visible patches wrap around the edges and every position is seen equally often).

As lightly's `random_inverse_block_mask` (the official `InverseBlockMasking` in
distribution) on a square grid, draw for draw from the same seed; at native resolution each
image's mask lies on its own grid, rows and columns in place of the square's sides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class InverseBlockMask:
    """One image's mask as patch indices (int64, ascending, row-major over its grid).

    Attributes:
        visible: `[N_v]`, the patches the student encodes.
        masked: `[N - N_v]`, the patches whose clusters it predicts.
    """

    visible: torch.Tensor
    masked: torch.Tensor


def inverse_block_mask(grid: tuple[int, int], generator: torch.Generator, *,
                       ratio: float = 0.65, min_aspect: float = 0.5,
                       roll: bool = True) -> InverseBlockMask:
    """One image's mask on its `grid` (see the module docstring)."""
    rows, cols = grid
    patches = rows * cols
    visible_count = patches - int(patches * ratio)
    visible = torch.zeros(patches, dtype=torch.bool)
    if visible_count == patches:
        visible.fill_(True)
    elif visible_count > 0:
        fits = (math.log(visible_count / cols**2), math.log(rows**2 / (visible_count + 1e-5)))
        low = max(math.log(min_aspect), fits[0])
        high = min(math.log(1.0 / min_aspect), fits[1])
        if low > high:  # a narrow grid: no block in the aspect range fits; the closest does
            low = high = fits[0] if fits[0] > high else fits[1]
        aspect = math.exp(float(torch.empty(1).uniform_(low, high, generator=generator)))
        height = min(rows, math.ceil(math.sqrt(visible_count * aspect)))
        width = min(cols, math.ceil(math.sqrt(visible_count / aspect)))
        top = int(torch.randint(0, rows - height + 1, (1,), generator=generator))
        left = int(torch.randint(0, cols - width + 1, (1,), generator=generator))
        block = torch.zeros(rows, cols, dtype=torch.bool)
        block[top:top + height, left:left + width] = True
        visible[block.flatten().nonzero().flatten()[:visible_count]] = True  # row-major
        if roll:
            down = int(torch.randint(0, rows, (1,), generator=generator))
            right = int(torch.randint(0, cols, (1,), generator=generator))
            visible = torch.roll(visible.reshape(rows, cols), shifts=(down, right),
                                 dims=(0, 1)).flatten()
    return InverseBlockMask(visible.nonzero().flatten(), (~visible).nonzero().flatten())


def batch_inverse_block_masks(grids: list[tuple[int, int]], generator: torch.Generator, *,
                              ratio: float = 0.65, min_aspect: float = 0.5,
                              roll: bool = True) -> list[InverseBlockMask]:
    """One mask per image of these `grids`, in order, all drawn from `generator`.

    Raises:
        ValueError: for a ratio outside [0, 1) or a min_aspect outside (0, 1].
    """
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"the mask ratio must lie in [0, 1), got {ratio}")
    if not 0.0 < min_aspect <= 1.0:
        raise ValueError(f"min_aspect must lie in (0, 1], got {min_aspect}")
    return [inverse_block_mask(grid, generator, ratio=ratio, min_aspect=min_aspect, roll=roll)
            for grid in grids]
