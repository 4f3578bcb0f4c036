"""Resizing a position table to the square of the grid's longer side, then keeping its
top-left corner (NVIDIA's RADIO, Ranzinger et al. 2024; timm's `naflexvit_*_radio_*` with
`pos_embed_ar_preserving=True`): RADIO stores one table for a 2048-pixel square (128 x 128
patches) and reads an image of R x C patches from that table resized bilinearly, without
antialias, to L x L with L = max(R, C), its first R rows and C columns. Every image so sees
the table at one scale per longer side, whatever its aspect ratio; `pos_embed.resample_pos_embed`
stretches the table to R x C instead.

The C-RADIOv3-B and -H checkpoints resize with `align_corners=True`, the others with
`align_corners=False` (timm's `_RADIO_ALIGN_CORNERS`): `EncoderConfig.pos_resize_mode`
"bilinear_corners_square_crop" and "bilinear_square_crop" select them, and
`pos_resize_sampled.resize_position_table` resizes for every mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_vit.layers.pos_embed import is_symbolic

# our mode -> F.interpolate's align_corners
SQUARE_CROP_MODES = {"bilinear_square_crop": False, "bilinear_corners_square_crop": True}


def square_crop_position_table(
    table: torch.Tensor,
    old_grid: tuple[int, int],
    new_grid: tuple[int, int],
    num_prefix_tokens: int = 0,
    mode: str = "bilinear_square_crop",
    antialias: bool = False,
) -> torch.Tensor:
    """The table resized bilinearly to the square of `new_grid`'s longer side, its top-left
    `new_grid` kept (float32 arithmetic, prefix entries kept, the table itself for its own
    grid unless `new_grid` is symbolic).

    Args:
        table: `[1, prefix + rows * cols, D]`.
        old_grid, new_grid: (rows, cols) the table was made for, and wanted.
        num_prefix_tokens: entries before the patch entries.
        mode: a key of `SQUARE_CROP_MODES`.
        antialias: low-pass when shrinking (RADIO does not).

    Returns:
        `[1, prefix + new_rows * new_cols, D]`, row-major over `new_grid`.
    """
    if table.ndim != 3 or table.shape[1] != num_prefix_tokens + old_grid[0] * old_grid[1]:
        raise ValueError(f"position table of shape {list(table.shape)} does not fit grid "
                         f"{old_grid} with {num_prefix_tokens} prefix tokens")
    if not is_symbolic(new_grid) and tuple(new_grid) == tuple(old_grid):
        return table
    rows, cols = new_grid
    side = torch.sym_max(rows, cols)
    prefix, patches = table[:, :num_prefix_tokens], table[:, num_prefix_tokens:]
    width = table.shape[-1]
    # (1, rows * cols, D) -> (1, D, rows, cols), the layout F.interpolate resizes
    patches = patches.float().reshape(1, *old_grid, width).permute(0, 3, 1, 2)
    patches = F.interpolate(patches, size=(side, side), mode="bilinear",
                            align_corners=SQUARE_CROP_MODES[mode], antialias=antialias)
    patches = patches[:, :, :rows, :cols].permute(0, 2, 3, 1).reshape(1, rows * cols, width)
    return torch.cat([prefix, patches.to(table.dtype)], dim=1)
