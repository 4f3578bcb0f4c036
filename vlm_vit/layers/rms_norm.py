"""RMSNorm (Zhang and Sennrich 2019): LayerNorm without the mean subtraction and the bias,
the norm of Qwen2-VL's and Qwen2.5-VL's vision blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension.

    The statistics run in float32 whatever the input dtype, and the normalised values are cast
    back to the input dtype before the weight multiplies them, as Qwen2-VL's `Qwen2RMSNorm`
    does (a bfloat16 input therefore meets the weight in bfloat16).

    Args:
        width: D.
        eps: added to the mean square (1e-6 in the Qwen vision towers).
    """

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalises `x` `[..., D]`; returns the same shape."""
        if x.dtype == torch.float32:  # the same arithmetic, one fused kernel
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        inverse_rms = torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * (x32 * inverse_rms).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
