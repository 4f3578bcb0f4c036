"""Temporal patch embedding (Qwen2-VL's `PatchEmbed`; ViViT's "tubelet embedding", Arnab et
al. 2021): a linear map of each T x P x P tube of a clip, a Conv3d with kernel = stride.

An image is a clip of one frame repeated T times (Qwen2-VL's processor tiles it so), and on
such a clip the Conv3d is the 2D patch embedding with the kernel summed over time:
sum_t W[:, :, t] * x = (sum_t W[:, :, t]) * x. `forward` computes images that way (T times
fewer multiplications), `forward_clip` computes clips with the Conv3d itself.

From 2D weights: `inflate_patch_kernel` spreads a 2D kernel evenly over the T frames
(W / T each), so an image gives the 2D embedding exactly (W / 2 + W / 2 = W in binary floating
point) and a clip the average of its frames' embeddings. Qwen2-VL's trained kernels are not
spread evenly; their image embedding is the sum over time, as above.

GLM-4V (GLM-V team 2025) normalises each tube embedding (its `post_conv_layernorm`, an
RMSNorm) before the positions are added: `norm`, as `PatchEmbed`'s for AIMv2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def inflate_patch_kernel(weight: torch.Tensor, temporal_patch_size: int) -> torch.Tensor:
    """A 2D patch kernel `[D, C, P, P]` as a Conv3d kernel `[D, C, T, P, P]` (W / T per frame)."""
    frames = weight[:, :, None].expand(-1, -1, temporal_patch_size, -1, -1)
    return frames / temporal_patch_size


class TemporalPatchEmbed(nn.Module):
    """Embeds T x P x P tubes of clips, and images as clips of a repeated frame.

    Args:
        patch_size: P.
        in_channels: C.
        width: D.
        temporal_patch_size: T, frames per tube (2 in Qwen2-VL and Qwen2.5-VL).
        bias: whether the map has a bias (Qwen2-VL's has none).
        norm: a norm over each embedding (GLM-4V's RMSNorm); none when None.
    """

    def __init__(
        self, patch_size: int, in_channels: int, width: int, temporal_patch_size: int = 2,
        bias: bool = False, norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if temporal_patch_size < 1:
            raise ValueError(f"temporal patch size must be at least 1, got {temporal_patch_size}")
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.temporal_patch_size = temporal_patch_size
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, width, kernel, stride=kernel, bias=bias)
        self.norm = norm  # None adds no module, so existing models keep their module tree

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid (rows, cols), by `PatchEmbed.grid`'s rule (not imported from there:
        `patch_embed.py` builds this module), or a ValueError naming the bad side."""
        p = self.patch_size
        if height % p or width % p or height <= 0 or width <= 0:
            raise ValueError(
                f"image size {height}x{width} is not a positive multiple of patch size {p}"
            )
        return height // p, width // p

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Embeds images `[B, C, H, W]`, each as a clip of itself repeated T times.

        Returns:
            Patch embeddings `[B, N, D]`, row-major over the grid, and the grid (rows, cols):
            the contract of `PatchEmbed`, so either can be the encoder's patch embedding.
        """
        if pixel_values.ndim != 4 or pixel_values.shape[1] != self.in_channels:
            raise ValueError(
                f"pixel_values must be [B, {self.in_channels}, H, W], "
                f"got shape {list(pixel_values.shape)}"
            )
        grid = self.grid(pixel_values.shape[2], pixel_values.shape[3])
        weight = self.proj.weight.sum(dim=2)  # (D, C, P, P): the T frames of a repeated image
        x = F.conv2d(pixel_values.to(weight.dtype), weight, self.proj.bias,
                     stride=self.patch_size)  # (B, D, rows, cols)
        x = x.flatten(2).transpose(1, 2)  # (B, N, D)
        return (x if self.norm is None else self.norm(x)), grid

    def forward_clip(self, clip: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Embeds clips `[B, C, frames, H, W]`, frames a multiple of T.

        Returns:
            Tube embeddings `[B, t * rows * cols, D]`, ordered by time, then row-major over
            the grid, and the grid (t, rows, cols) with t = frames / T.
        """
        if clip.ndim != 5 or clip.shape[1] != self.in_channels:
            raise ValueError(
                f"a clip must be [B, {self.in_channels}, frames, H, W], "
                f"got shape {list(clip.shape)}"
            )
        frames = clip.shape[2]
        if frames % self.temporal_patch_size:
            raise ValueError(
                f"a clip of {frames} frames is not a multiple of the temporal patch size "
                f"{self.temporal_patch_size} (repeat the last frame to pad it, as Qwen2-VL's "
                "processor does)"
            )
        rows, cols = self.grid(clip.shape[3], clip.shape[4])
        x = self.proj(clip.to(self.proj.weight.dtype))  # (B, D, t, rows, cols)
        x = x.flatten(2).transpose(1, 2)  # (B, t * N, D)
        return (x if self.norm is None else self.norm(x)), \
            (frames // self.temporal_patch_size, rows, cols)
