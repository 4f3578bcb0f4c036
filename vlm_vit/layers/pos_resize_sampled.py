"""Sampling a position table at each patch's centre with `F.grid_sample` (GLM-4V's vision tower,
GLM-V team 2025): transformers' `Glm4vVisionEmbeddings` reads its square learned table for
every image bicubically, with `grid_sample(mode="bicubic", align_corners=False,
padding_mode="border")` at the normalised centre ((j + 0.5) / cols) * 2 - 1 of column j (rows
alike), even on the table's own grid.

That is the function of `F.interpolate(mode="bicubic", align_corners=False)` without
antialias (half-pixel centres, Keys' a = -0.75, edge taps clamped), but the sample points are
rounded differently on the way (normalised, then unnormalised): on a 24 x 24 table read at
100 rows the two differ by 1e-6 of the table's scale, and at its own grid `grid_sample` does
not return the table exactly. `sample_position_table` computes GLM-4V's arithmetic itself,
so a converted tower adds the same positions.

`EncoderConfig.pos_resize_mode="bicubic_grid_sample"` selects it; `resize_position_table`
resizes for every mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_vit.layers.pos_resize_corners import resample_position_table
from vlm_vit.layers.pos_resize_square_crop import SQUARE_CROP_MODES, square_crop_position_table

SAMPLED_MODES = ("bicubic_grid_sample",)  # the pos_resize_modes computed here


def sample_position_table(
    table: torch.Tensor,
    old_grid: tuple[int, int],
    new_grid: tuple[int, int],
    num_prefix_tokens: int = 0,
) -> torch.Tensor:
    """The table read bicubically at the centre of each patch of `new_grid`, as GLM-4V does
    (float32 arithmetic, prefix entries kept, sampled on the table's own grid too).

    Args:
        table: `[1, prefix + rows * cols, D]`.
        old_grid, new_grid: (rows, cols) the table was made for, and wanted.
        num_prefix_tokens: entries before the patch entries.

    Returns:
        `[1, prefix + new_rows * new_cols, D]`, row-major over `new_grid`.
    """
    if table.ndim != 3 or table.shape[1] != num_prefix_tokens + old_grid[0] * old_grid[1]:
        raise ValueError(f"position table of shape {list(table.shape)} does not fit grid "
                         f"{old_grid} with {num_prefix_tokens} prefix tokens")
    prefix, patches = table[:, :num_prefix_tokens], table[:, num_prefix_tokens:]
    width = table.shape[-1]
    # (1, rows * cols, D) -> (1, D, rows, cols), the layout grid_sample reads
    patches = patches.float().reshape(1, *old_grid, width).permute(0, 3, 1, 2)
    rows, cols = new_grid
    row, col = torch.meshgrid(torch.arange(rows, device=table.device),
                              torch.arange(cols, device=table.device), indexing="ij")
    # GLM-4V's sample points, operation for operation: x is the column, y the row
    sides = torch.tensor([float(cols), float(rows)], device=table.device)
    centres = torch.stack((col.flatten(), row.flatten()), dim=-1)  # (N, 2) integer (x, y)
    points = ((centres + 0.5) / sides) * 2 - 1  # in [-1, 1], pixel centres
    sampled = F.grid_sample(patches, points[None, :, None], mode="bicubic",
                            align_corners=False, padding_mode="border")  # (1, D, N, 1)
    sampled = sampled[0, :, :, 0].transpose(0, 1)[None]  # (1, N, D)
    return torch.cat([prefix, sampled.to(table.dtype)], dim=1)


def resize_position_table(
    table: torch.Tensor,
    old_grid: tuple[int, int],
    new_grid: tuple[int, int],
    num_prefix_tokens: int = 0,
    mode: str = "bicubic",
    antialias: bool = True,
) -> torch.Tensor:
    """`resample_position_table` for every `pos_resize_mode`: a mode of `SAMPLED_MODES` is
    `sample_position_table` (antialias does not apply), one of `SQUARE_CROP_MODES`
    `square_crop_position_table` (RADIO's), the others as there."""
    if mode in SAMPLED_MODES:
        return sample_position_table(table, old_grid, new_grid, num_prefix_tokens)
    if mode in SQUARE_CROP_MODES:
        return square_crop_position_table(table, old_grid, new_grid, num_prefix_tokens, mode,
                                          antialias)
    return resample_position_table(table, old_grid, new_grid, num_prefix_tokens, mode,
                                   antialias)
