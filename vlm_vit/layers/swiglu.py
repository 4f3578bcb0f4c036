"""The SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer"): a SiLU-gated hidden
layer, the MLP of Qwen2.5-VL's vision blocks, EVA-02 and many recent towers.

    out = fc2(norm(act(fc1_g(x)) * fc1_x(x))),  act = SiLU (GELU makes it GeGLU)

`norm` is skipped unless one is given: EVA-02 base and large (timm's `scale_mlp`, the
sub-LN of NormFormer) normalise the gated hidden activation before the output projection.

The three Linears carry timm's names (`timm.layers.SwiGLU`): `fc1_g` is the gate
(transformers' `gate_proj`), `fc1_x` the value branch (`up_proj`), `fc2` the output
projection (`down_proj`), `norm` the inner norm (timm's `mlp.norm`). Keeping `fc2` means
the output Linear has the same name as in `Mlp`, so a key map or a LoRA pattern written for
`mlp.fc2` still finds it.
"""

from __future__ import annotations

import torch
from torch import nn


class SwiGLU(nn.Module):
    """Gate, value and output Linears with a SiLU gate.

    Args:
        width: D.
        hidden_width: the gated hidden size (Qwen2.5-VL-7B: 3420 for D = 1280).
        bias: whether the three Linears have biases (Qwen2.5-VL's vision MLP has them).
        act: the gate's activation module; SiLU when None.
        norm: a norm over the hidden width, applied before `fc2`; none when None.
    """

    def __init__(self, width: int, hidden_width: int, bias: bool = True,
                 act: nn.Module | None = None, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.fc1_g = nn.Linear(width, hidden_width, bias=bias)
        self.fc1_x = nn.Linear(width, hidden_width, bias=bias)
        self.act = act if act is not None else nn.SiLU()
        self.norm = norm  # None adds no module, so existing models keep their module tree
        self.fc2 = nn.Linear(hidden_width, width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps `x` `[..., D]` to `[..., D]`."""
        hidden = self.act(self.fc1_g(x)) * self.fc1_x(x)  # (..., hidden_width)
        return self.fc2(hidden if self.norm is None else self.norm(hidden))
