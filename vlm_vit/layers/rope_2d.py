"""2D rotary position embedding for vision (axial RoPE; Su et al. 2021, as Qwen2-VL's vision
tower applies it): q and k are rotated by angles that grow with each token's row and column,
so their dot product, the attention logit, depends only on the offset between two patches.

The head dimension is split in two halves that `rotate_half` pairs up (channel i with
i + head_dim/2); within each half the first quarter of the channels turns with the row and the
second quarter with the column. The frequencies come in two layouts (`Rope2D(frequencies=)`):

- "shared" (Qwen2-VL, Qwen2.5-VL): both axes turn at the head_dim/4 frequencies
  theta^(-4j/head_dim) (`Qwen2VLVisionRotaryEmbedding`);
- "alternating" (Pixtral): of the head_dim/2 frequencies theta^(-2i/head_dim), rows take the
  even ones and columns the odd ones (`PixtralVisionRotaryEmbedding`'s `inv_freq[0::2]`,
  `inv_freq[1::2]`), so the columns turn slower by theta^(-2/head_dim).

Neither is EVA-02's interleaved pairing, so these weights need no permutation.

Positions are patch indices, or, with a reference grid (`Rope2D(reference_grid=)`, EVA-02's
`ref_feat_shape`: its pretraining grid), indices scaled so that each image's grid spans the
reference one: row i of R rows at i / R * ref_rows, the same float32 operations as timm's
`build_rotary_pos_embed`, for every image's own grid (as timm's Eva with `dynamic_img_size`).
Or, DINOv3's (`Rope2D(positions="centered")`), each patch's centre normalised to [-1, 1] over
the image's grid, in turns (`rope_centered.centered_positions`).

Token order: a tower with a 2x2 patch merger (Qwen2-VL's `spatial_merge_size`) lists its
patches window by window (the four patches of each 2x2 window together, windows row-major),
so the merger can take four neighbouring tokens at a time. `merge_window_order` gives that
order; `grid_positions(grid, merge_size)` gives each token's (row, col) in it.
"""

from __future__ import annotations

import torch
from torch import nn

from vlm_vit.layers.rope_centered import centered_positions

POSITIONS = ("index", "centered")


def merge_window_order(grid: tuple[int, int], merge_size: int) -> torch.Tensor:
    """Where each token of the merge-window order lies in the row-major order.

    Args:
        grid: (rows, cols) of patches.
        merge_size: the merger's window side (1: row-major, the plain ViT order).

    Returns:
        `[rows * cols]` int64: `tokens_row_major[:, order]` are the tokens in merge-window order.

    Raises:
        ValueError: when a side of the grid is not a multiple of `merge_size`.
    """
    rows, cols = grid
    if merge_size < 1 or rows % merge_size or cols % merge_size:
        raise ValueError(
            f"patch grid {rows}x{cols} is not divisible into {merge_size}x{merge_size} merge "
            "windows: each side must be a multiple of the merge size"
        )
    m = merge_size
    index = torch.arange(rows * cols).reshape(rows // m, m, cols // m, m)
    # (window row, row in window, window col, col in window) -> windows first, then inside
    return index.permute(0, 2, 1, 3).flatten()


def grid_positions(grid: tuple[int, int], merge_size: int = 1,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """(row, col) of every patch, in row-major order or, with `merge_size` > 1, in the
    merge-window order; `[rows * cols, 2]` int64 on `device`."""
    rows, cols = grid
    row, col = torch.meshgrid(torch.arange(rows, device=device),
                              torch.arange(cols, device=device), indexing="ij")
    positions = torch.stack([row.flatten(), col.flatten()], dim=-1)  # (N, 2), row-major
    if merge_size == 1:
        return positions
    return positions[merge_window_order(grid, merge_size).to(positions.device)]


class Rope2D(nn.Module):
    """The angles of axial 2D RoPE, as cosines and sines per token.

    Holds no parameters and no buffers, so adding it to a model changes no checkpoint; the
    frequencies are computed in float32 on each call (a few numbers), on the positions' device,
    so neither a meta-device build nor a cast of the model to bfloat16 touches them.

    Args:
        head_dim: channels per head; a multiple of 4 (a quarter per axis and rotation half).
        theta: the frequency base (10000 in Qwen2-VL, Qwen2.5-VL and Pixtral).
        frequencies: "shared" or "alternating" (see the module docstring).
        reference_grid: (rows, cols) every image's positions are scaled to span, or None for
            patch indices (see the module docstring).
        positions: "index" (patch indices, scaled to `reference_grid` if given) or
            "centered" (DINOv3's patch centres in [-1, 1], in turns).

    Raises:
        ValueError: when `head_dim` is not a positive multiple of 4, or for another layout.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, frequencies: str = "shared",
                 reference_grid: tuple[int, int] | None = None,
                 positions: str = "index") -> None:
        super().__init__()
        if head_dim <= 0 or head_dim % 4:
            raise ValueError(
                f"2D RoPE needs a head dimension divisible by 4 (a quarter each for rows and "
                f"columns in both rotation halves), got head_dim {head_dim}"
            )
        if frequencies not in ("shared", "alternating"):
            raise ValueError(f"RoPE frequencies {frequencies!r} are not shared or alternating")
        if positions not in POSITIONS or (positions == "centered" and reference_grid):
            raise ValueError(f"RoPE positions {positions!r} are not index or centered (the "
                             "latter without a reference grid)")
        self.position_kind = positions
        self.head_dim, self.theta, self.frequencies = head_dim, theta, frequencies
        self.reference_grid = None if reference_grid is None else tuple(reference_grid)

    def inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The frequencies of rows and columns, float32 `[2, head_dim/4]`."""
        head_dim = self.head_dim
        if self.frequencies == "shared":
            exponents = torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device=device)
            return (1.0 / self.theta ** (exponents / (head_dim // 2))).expand(2, -1)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        return (1.0 / self.theta**exponents).reshape(-1, 2).T  # (2, hd/4): even, odd

    def positions(self, grid: tuple[int, int],
                  device: torch.device | str | None = None) -> torch.Tensor:
        """(row, col) of every patch of `grid`, row-major, as RoPE turns them: int64 patch
        indices, or float32 ones scaled to the reference grid (index / grid * reference), or
        float32 patch centres (`centered_positions`); `[rows * cols, 2]`."""
        if self.position_kind == "centered":
            return centered_positions(grid, device=device)
        positions = grid_positions(grid, device=device)
        if self.reference_grid is None:
            return positions
        size = torch.tensor(grid, dtype=torch.float32, device=positions.device)
        reference = torch.tensor(self.reference_grid, dtype=torch.float32,
                                 device=positions.device)
        return positions.float() / size * reference  # timm's t / feat_shape * ref_feat_shape

    def forward(
        self, positions: torch.Tensor, num_prefix_tokens: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cosines and sines for tokens at `positions`.

        Args:
            positions: `[N, 2]` (row, col) per token (`grid_positions`, or several images'
                concatenated for a packed sequence).
            num_prefix_tokens: rows of identity rotation (cos 1, sin 0) put first, for a class
                or register token, which has no place on the grid.

        Returns:
            cos, sin: float32 `[prefix + N, head_dim]`.
        """
        # (N, 2, 1) * (2, hd/4) -> (N, 2, hd/4) -> (N, hd/2): row angles, then column angles
        angles = (positions[..., None].float() * self.inv_freq(positions.device)).flatten(-2)
        angles = torch.cat([angles, angles], dim=-1)  # (N, hd): the same for both halves
        cos, sin = angles.cos(), angles.sin()
        if num_prefix_tokens:
            cos = torch.cat([cos.new_ones(num_prefix_tokens, self.head_dim), cos])
            sin = torch.cat([sin.new_zeros(num_prefix_tokens, self.head_dim), sin])
        return cos, sin

    def for_grids(self, grids: list[tuple[int, int]] | tuple[tuple[int, int], ...],
                  num_prefix_tokens: int = 0, device: torch.device | str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cosines and sines for images laid end to end, each `[prefix, row-major patches]`
        (the encoder's token order): `[sum(prefix + rows * cols), head_dim]` each. Every
        image counts its rows and columns from 0 (scaled to the reference grid, if any, from
        its own grid), so packing mixed sizes changes no angle.

        Raises:
            ValueError: for no grids (a caller that did not say where its tokens lie).
        """
        if not grids:
            raise ValueError("2D RoPE needs each image's patch grid (grids=[(rows, cols), ...])")
        parts = [self(self.positions(grid, device=device), num_prefix_tokens)
                 for grid in grids]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([cos for cos, _ in parts]), torch.cat([sin for _, sin in parts])

    def extra_repr(self) -> str:
        reference = "" if self.reference_grid is None else \
            f", reference_grid={self.reference_grid}"
        centered = ", positions=centered" if self.position_kind == "centered" else ""
        return f"head_dim={self.head_dim}, theta={self.theta}, frequencies={self.frequencies}" \
            + reference + centered


def build_rope(head_dim: int, theta: float | None, frequencies: str = "shared",
               reference_grid: tuple[int, int] | None = None,
               positions: str = "index") -> Rope2D | None:
    """The encoder's 2D RoPE (`EncoderConfig.rope_theta`, `rope_frequencies`,
    `rope_reference_grid`, `rope_positions`); None when `theta` is None."""
    return None if theta is None else Rope2D(head_dim, theta, frequencies, reference_grid,
                                             positions)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates q or k: x * cos + rotate_half(x) * sin, in float32, cast back to x's dtype.

    Args:
        x: `[..., head_dim]`, e.g. `[B, heads, T, head_dim]` (then cos `[T, head_dim]`
            broadcasts as it is) or packed `[T, heads, head_dim]` (pass `cos[:, None]`).
        cos, sin: from `Rope2D`, broadcastable to x.
    """
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)  # channel i pairs with i + head_dim/2
    return (x32 * cos + rotated * sin).to(x.dtype)
