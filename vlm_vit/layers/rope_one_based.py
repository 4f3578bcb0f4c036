"""Perception Encoder's RoPE coordinates (Bolya et al. 2025, arXiv 2504.13181; timm's `Eva`
with `rope_grid_offset=1.`, `RotaryEmbeddingCat`).

PE's tower puts its class token at (0, 0) of the RoPE grid and the patches after it, counted
from 1: patch (i, j) turns at (i + 1, j + 1). A turn of 0 is no turn, so the class token is
left alone, as `Rope2D` leaves every prefix token. With a reference grid (timm's
`ref_feat_shape`, PE's pretraining grid) every image's positions are scaled to span it,
(i + 1) / rows * ref_rows, in the float32 operations of timm's `_build_grid` (the offset is
added before the scaling), for each image's own grid. The frequencies and the channel layout
are `Rope2D`'s; only the positions differ from its "index" kind.
"""

from __future__ import annotations

import torch

from vlm_vit.layers.rope_2d import Rope2D, grid_positions
from vlm_vit.layers.rope_2d import build_rope as build_indexed_rope


class OneBasedRope2D(Rope2D):
    """`Rope2D` with patch positions counted from 1 (see the module docstring).

    Args:
        head_dim, theta, frequencies, reference_grid: as `Rope2D`.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, frequencies: str = "shared",
                 reference_grid: tuple[int, int] | None = None) -> None:
        super().__init__(head_dim, theta, frequencies, reference_grid, positions="index")

    def positions(self, grid: tuple[int, int],
                  device: torch.device | str | None = None) -> torch.Tensor:
        """(row + 1, col + 1) of every patch of `grid`, row-major, scaled to the reference
        grid if there is one; float32 `[rows * cols, 2]`."""
        positions = grid_positions(grid, device=device).float() + 1.0  # timm: arange + offset
        if self.reference_grid is None:
            return positions
        size = torch.tensor(grid, dtype=torch.float32, device=positions.device)
        reference = torch.tensor(self.reference_grid, dtype=torch.float32,
                                 device=positions.device)
        return positions / size * reference  # timm's t / feat_shape * ref_feat_shape

    def extra_repr(self) -> str:
        return super().extra_repr() + ", positions=one_based"


def build_rope(head_dim: int, theta: float | None, frequencies: str = "shared",
               reference_grid: tuple[int, int] | None = None,
               positions: str = "index") -> Rope2D | None:
    """The encoder's 2D RoPE (`EncoderConfig.rope_positions` "one_based" here, the others
    `rope_2d.build_rope`'s); None when `theta` is None."""
    if theta is not None and positions == "one_based":
        return OneBasedRope2D(head_dim, theta, frequencies, reference_grid)
    return build_indexed_rope(head_dim, theta, frequencies, reference_grid, positions)
