"""DINOv3's RoPE coordinates (Siméoni et al. 2025, the `RopePositionEmbedding` of
facebookresearch/dinov3; transformers' `DINOv3ViTRopePositionEmbedding`, timm's
`RotaryEmbeddingDinoV3`).

Each patch sits at its centre, normalised over its image's own grid and mapped to [-1, 1]:
row i of R at 2 (i + 0.5) / R - 1, and the same for columns, so every grid spans the same
square whatever its size. The angles are 2 pi x coordinate x frequency (the frequencies are
periods in turns, theta^(4j/head_dim)); returning the coordinates already multiplied by 2 pi
lets `rope_2d.Rope2D` turn them exactly as it turns patch indices, rows in the first quarter
of each rotation half and columns in the second ("shared" frequencies).

transformers and timm also shift, jitter and rescale the coordinates at random while
training (`pos_embed_rescale`, `rope_rescale_coords`); at inference they use these ones.
"""

from __future__ import annotations

import math

import torch


def centered_positions(grid: tuple[int, int],
                       device: torch.device | str | None = None) -> torch.Tensor:
    """The (row, col) RoPE position of every patch of `grid`, row-major, in radians per unit
    frequency: 2 pi x (2 (index + 0.5) / side - 1); float32 `[rows * cols, 2]`.

    The operations are transformers' `get_patches_center_coordinates` in the same order.
    """
    rows, cols = grid
    row = torch.arange(0.5, rows, dtype=torch.float32, device=device) / rows  # (R,) in (0, 1)
    col = torch.arange(0.5, cols, dtype=torch.float32, device=device) / cols  # (C,)
    coords = torch.stack(torch.meshgrid(row, col, indexing="ij"), dim=-1).flatten(0, 1)
    return 2 * math.pi * (2.0 * coords - 1.0)  # (R * C, 2), [-1, 1] in turns
