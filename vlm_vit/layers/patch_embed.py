"""Patch embedding (paper eq. 1): a linear map of each flattened P x P patch.

A convolution with kernel = stride = P computes exactly that map, faster. `build_patch_embed`
picks it or the hybrid's ResNet features (`hybrid_stem.py`, paper section 3.1). AIMv2 (Fini et
al. 2025) normalises each patch embedding before the positions are added: timm's
`patch_embed.norm` (`EncoderConfig.patch_norm`); GLM-4V does so after its Conv3d.
"""

from __future__ import annotations

import torch
from torch import nn

from vlm_vit.layers.hybrid_stem import HybridPatchEmbed
from vlm_vit.layers.temporal_patch_embed import TemporalPatchEmbed


class PatchEmbed(nn.Module):
    """Splits an image into non-overlapping patches and embeds each one.

    Args:
        patch_size: P.
        in_channels: C.
        width: D.
        bias: whether the map has a bias (CLIP's has none).
        norm: a norm over each patch embedding (AIMv2's RMSNorm); none when None.
    """

    def __init__(self, patch_size: int, in_channels: int, width: int, bias: bool = True,
                 norm: nn.Module | None = None) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.proj = nn.Conv2d(in_channels, width, patch_size, stride=patch_size, bias=bias)
        self.norm = norm  # None adds no module, so existing models keep their module tree

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid (rows, cols) of an image, or a ValueError naming the bad side."""
        p = self.patch_size
        if height % p or width % p or height <= 0 or width <= 0:
            raise ValueError(
                f"image size {height}x{width} is not a positive multiple of patch size {p}"
            )
        return height // p, width // p

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Embeds the patches of `pixel_values` `[B, C, H, W]`.

        Returns:
            Patch embeddings `[B, N, D]`, row-major over the grid, and the grid (rows, cols).
        """
        if pixel_values.ndim != 4 or pixel_values.shape[1] != self.in_channels:
            raise ValueError(
                f"pixel_values must be [B, {self.in_channels}, H, W], "
                f"got shape {list(pixel_values.shape)}"
            )
        grid = self.grid(pixel_values.shape[2], pixel_values.shape[3])
        x = self.proj(pixel_values.to(self.proj.weight.dtype))  # (B, D, rows, cols)
        x = x.flatten(2).transpose(1, 2)  # (B, N, D)
        return (x if self.norm is None else self.norm(x)), grid


def build_patch_embed(patch_size: int, in_channels: int, width: int, bias: bool = True,
                      hybrid_layers: tuple[int, ...] | None = None,
                      temporal_patch_size: int | None = None,
                      norm: nn.Module | None = None) -> nn.Module:
    """The encoder's patch embedding: `PatchEmbed`; with `hybrid_layers` the hybrid's
    ResNet of those stages and a 1x1 projection (`HybridPatchEmbed`, whose stride must be
    `patch_size`); with `temporal_patch_size` a Conv3d over that many frames
    (`TemporalPatchEmbed`, images as a repeated frame). Each returns `[B, N, D]` and the grid.
    `norm` (not the hybrid's) normalises each patch embedding.

    Raises:
        ValueError: for a hybrid whose stride is not `patch_size`, or a norm with the hybrid.
    """
    if norm is not None and hybrid_layers is not None:
        raise ValueError("a patch norm needs the Conv2d or Conv3d patch embedding (not the "
                         "hybrid's)")
    if temporal_patch_size is not None:
        return TemporalPatchEmbed(patch_size, in_channels, width, temporal_patch_size, bias,
                                  norm=norm)
    if hybrid_layers is None:
        return PatchEmbed(patch_size, in_channels, width, bias=bias, norm=norm)
    embed = HybridPatchEmbed(width, hybrid_layers, in_channels, bias=bias)
    if embed.patch_size != patch_size:
        raise ValueError(f"hybrid_layers {tuple(hybrid_layers)} make a ResNet of stride "
                         f"{embed.patch_size}, not the patch size {patch_size}")
    return embed
