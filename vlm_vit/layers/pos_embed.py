"""Position embeddings: resampling a learned table to a new grid (paper section 3.2), cached per
grid, and the fixed 2D sin-cos table (MAE, big_vision)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def resample_pos_embed(
    table: torch.Tensor,
    old_grid: tuple[int, int],
    new_grid: tuple[int, int],
    num_prefix_tokens: int = 0,
    mode: str = "bicubic",
    antialias: bool = True,
) -> torch.Tensor:
    """Resizes a position table to another patch grid by 2D interpolation.

    The prefix entries (the class token's position) are kept as they are. The arithmetic runs
    in float32 whatever the table's dtype, and the result is cast back. The same grid returns
    the table itself, unless `new_grid` is symbolic (`torch.export`): there the resize always
    runs, so the exported program holds no guard on the grid and resizes for any size (the
    resize to the same grid is the identity, exactly).

    Args:
        table: `[1, prefix + rows * cols, D]`.
        old_grid: (rows, cols) the table was made for.
        new_grid: (rows, cols) wanted.
        num_prefix_tokens: entries before the patch entries.
        mode: "bicubic" or "bilinear" (`align_corners=False`, as timm and open_clip).
        antialias: low-pass when shrinking (timm, open_clip); Hugging Face does not.

    Returns:
        `[1, prefix + new_rows * new_cols, D]`.
    """
    expected = num_prefix_tokens + old_grid[0] * old_grid[1]
    if table.ndim != 3 or table.shape[1] != expected:
        raise ValueError(
            f"position table of shape {list(table.shape)} does not fit grid {old_grid} "
            f"with {num_prefix_tokens} prefix tokens (expected [1, {expected}, D])"
        )
    if not is_symbolic(new_grid) and tuple(new_grid) == tuple(old_grid):
        return table
    prefix, patches = table[:, :num_prefix_tokens], table[:, num_prefix_tokens:]
    width = table.shape[-1]
    # (1, rows * cols, D) -> (1, D, rows, cols), the layout F.interpolate resizes
    patches = patches.float().reshape(1, old_grid[0], old_grid[1], width).permute(0, 3, 1, 2)
    patches = F.interpolate(
        patches, size=tuple(new_grid), mode=mode, align_corners=False, antialias=antialias
    )
    patches = patches.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], width)
    return torch.cat([prefix, patches.to(table.dtype)], dim=1)


def resample_pos_embed_cached(
    table: torch.Tensor,
    old_grid: tuple[int, int],
    new_grid: tuple[int, int],
    cache: dict[tuple, torch.Tensor],
    resample=resample_pos_embed,
    **resize,
) -> torch.Tensor:
    """`resample(table, old_grid, new_grid, **resize)` (`resample_pos_embed` unless given),
    cached per grid in `cache` while the table is not being trained.

    The cache notices in-place updates (an optimizer step) through the table's version
    counter, and keeps only entries of the table as it is now. Under `torch.export` the
    resize is traced instead (no cache, no comparison of a symbolic grid with the native
    one), so the program resizes for any grid.

    Returns:
        The table itself for `old_grid`; else the resized table (a cached one is not to be
        changed in place).
    """
    if not is_symbolic(new_grid) and tuple(new_grid) == old_grid:
        return table
    if (torch.is_grad_enabled() and table.requires_grad) or torch.compiler.is_exporting():
        return resample(table, old_grid, new_grid, **resize)
    key = (tuple(new_grid), table.device, table.dtype, table.data_ptr(), table._version)
    cached = cache.get(key)
    if cached is None:
        for stale in [k for k in cache if k[3:] != key[3:]]:
            del cache[stale]
        with torch.no_grad():
            cached = resample(table, old_grid, new_grid, **resize)
        cache[key] = cached
    return cached


def is_symbolic(grid: tuple) -> bool:
    """Whether a grid holds symbolic sizes (`torch.SymInt`: traced by `torch.export` with a
    dynamic height or width). Comparing one with a Python integer would add a guard that
    freezes the exported program to one grid."""
    return any(isinstance(side, torch.SymInt) for side in grid)


def sincos_2d_pos_embed(
    grid: tuple[int, int], width: int, temperature: float = 10000.0
) -> torch.Tensor:
    """The fixed 2D sin-cos table of MAE.

    The first half of the channels encodes the column, the second half the row, in MAE's
    order (its `get_2d_sincos_pos_embed`), so MAE weights keep their meaning.

    Returns:
        `[rows * cols, D]` in float32, row-major over the grid.
    """
    if width % 4:
        raise ValueError(f"width {width} must be divisible by 4 for a 2D sin-cos table")
    rows, cols = grid
    omega = torch.arange(width // 4, dtype=torch.float64) / (width / 4.0)
    omega = 1.0 / temperature**omega  # (D/4,)
    y, x = torch.meshgrid(
        torch.arange(rows, dtype=torch.float64), torch.arange(cols, dtype=torch.float64),
        indexing="ij",
    )

    def encode(pos: torch.Tensor) -> torch.Tensor:
        angles = pos.reshape(-1, 1) * omega.reshape(1, -1)  # (rows * cols, D/4)
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([encode(x), encode(y)], dim=1).float()


def sincos_position_table(grid: tuple[int, int], width: int, num_prefix_tokens: int = 0,
                          device: torch.device | str | None = None) -> torch.Tensor:
    """`sincos_2d_pos_embed` as a position table, `[1, prefix + rows * cols, D]` in float32,
    the prefix entries zero (MAE's class token has no position): the table of
    `EncoderConfig.pos_embed="sincos"`, which AIMv2's native-resolution towers compute for
    every grid (their `[sin_w | cos_w | sin_h | cos_h]` is this layout)."""
    table = sincos_2d_pos_embed(grid, width)
    prefix = table.new_zeros(num_prefix_tokens, width)
    return torch.cat([prefix, table]).unsqueeze(0).to(device)
