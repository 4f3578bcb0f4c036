"""LayerScale (Touvron et al., CaiT 2021; used by DINOv2): a learned per-channel scale on a
residual branch, initialised small so each block starts close to the identity."""

from __future__ import annotations

import torch
from torch import nn


class LayerScale(nn.Module):
    """Multiplies the last dimension by a learned vector `gamma` (timm's name).

    Args:
        width: D, the size of the last dimension.
        init_value: the starting value of every entry (DINOv2 uses 1e-5 for ViT-g, 1.0 for
            the distilled models; the checkpoint overwrites it in any case).
    """

    def __init__(self, width: int, init_value: float = 1e-5) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((width,), float(init_value)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Scales `x` `[..., D]` channel by channel (a new tensor; the input is untouched)."""
        return x * self.gamma


def build_layer_scale(width: int, init_value: float | None) -> nn.Module:
    """LayerScale starting at `init_value`, or the identity for None (the paper's block)."""
    return nn.Identity() if init_value is None else LayerScale(width, init_value)
