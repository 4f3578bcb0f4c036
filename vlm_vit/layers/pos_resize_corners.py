"""Resizing a position table with its corners aligned (Qwen3-VL's vision tower, Bai et al.
2025): transformers' `Qwen3VLVisionModel` resamples its square learned table to each image's
grid bilinearly with `align_corners=True` (`fast_pos_embed_interpolate`, now
`vision_utils.get_vision_interpolation_indices_and_weights`), so the table's first and last
entries land on the grid's first and last patches: row i of R reads the table at
i (S - 1) / (R - 1) of its S rows. `pos_embed.resample_pos_embed` samples at half-pixel
centres instead (`align_corners=False`: timm, open_clip, the paper's section 3.2), which
moves every row but the middle one.

`EncoderConfig.pos_resize_mode="bilinear_corners"` selects it; `resample_position_table`
resizes for every mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_vit.layers.pos_embed import is_symbolic, resample_pos_embed

CORNER_MODES = {"bilinear_corners": "bilinear"}  # our mode -> F.interpolate's, corners aligned


def resample_position_table(
    table: torch.Tensor,
    old_grid: tuple[int, int],
    new_grid: tuple[int, int],
    num_prefix_tokens: int = 0,
    mode: str = "bicubic",
    antialias: bool = True,
) -> torch.Tensor:
    """`resample_pos_embed` for every `pos_resize_mode`: a mode of `CORNER_MODES` aligns the
    corners (float32 arithmetic, prefix entries kept, the table itself for the same grid
    unless `new_grid` is symbolic), the others are `resample_pos_embed`'s.

    Args:
        table: `[1, prefix + rows * cols, D]`.
        old_grid, new_grid: (rows, cols) the table was made for, and wanted.
        num_prefix_tokens: entries before the patch entries.
        mode: "bicubic", "bilinear" or "bilinear_corners".
        antialias: low-pass when shrinking (Qwen3-VL does not).

    Returns:
        `[1, prefix + new_rows * new_cols, D]`.
    """
    if mode not in CORNER_MODES:
        return resample_pos_embed(table, old_grid, new_grid, num_prefix_tokens, mode, antialias)
    if table.ndim != 3 or table.shape[1] != num_prefix_tokens + old_grid[0] * old_grid[1]:
        raise ValueError(f"position table of shape {list(table.shape)} does not fit grid "
                         f"{old_grid} with {num_prefix_tokens} prefix tokens")
    if not is_symbolic(new_grid) and tuple(new_grid) == tuple(old_grid):
        return table
    prefix, patches = table[:, :num_prefix_tokens], table[:, num_prefix_tokens:]
    width = table.shape[-1]
    # (1, rows * cols, D) -> (1, D, rows, cols), the layout F.interpolate resizes
    patches = patches.float().reshape(1, *old_grid, width).permute(0, 3, 1, 2)
    patches = F.interpolate(patches, size=tuple(new_grid), mode=CORNER_MODES[mode],
                            align_corners=True, antialias=antialias)
    patches = patches.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], width)
    return torch.cat([prefix, patches.to(table.dtype)], dim=1)
