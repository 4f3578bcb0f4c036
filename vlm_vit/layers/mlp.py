"""The two-layer MLP of every block (paper eq. 3) and its activations."""

from __future__ import annotations

import torch
from torch import nn

from vlm_vit.layers.norm import build_norm
from vlm_vit.layers.swiglu import SwiGLU


class GELU(nn.GELU):
    """`nn.GELU` that can also overwrite its input (`forward_inplace`), for the MLP."""

    def forward_inplace(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.gelu_(x, approximate=self.approximate)


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): OpenAI CLIP's approximation, which its weights were trained with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)

    def forward_inplace(self, x: torch.Tensor) -> torch.Tensor:
        """The same numbers with one temporary instead of three."""
        return x.mul_(torch.sigmoid_(1.702 * x))


_ACTIVATIONS = {
    "gelu": lambda: GELU(),
    "gelu_tanh": lambda: GELU(approximate="tanh"),  # flax's default, used by the JAX code
    "quick_gelu": QuickGELU,
    "silu": nn.SiLU,  # the gate of SwiGLU
}


def build_activation(name: str) -> nn.Module:
    """The activation module named `name` (see `EncoderConfig.act`)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()


class Mlp(nn.Module):
    """Linear, activation, Linear.

    When autograd is not recording (inference), the activation overwrites fc1's output, which
    nothing else holds: the same numbers without a second `[B, T, hidden]` buffer, whose fresh
    pages cost a CPU as much as the activation itself.
    """

    def __init__(self, width: int, hidden_width: int, act: str = "gelu") -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden_width)
        self.act = build_activation(act)
        self.fc2 = nn.Linear(hidden_width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(x)  # (B, T, hidden)
        inplace = getattr(self.act, "forward_inplace", None)
        if inplace is None or (torch.is_grad_enabled() and hidden.requires_grad):
            return self.fc2(self.act(hidden))
        return self.fc2(inplace(hidden))


def build_mlp(kind: str, width: int, hidden_width: int, act: str = "gelu",
              inner_norm: str | None = None, norm_eps: float = 1e-6) -> nn.Module:
    """The block's MLP by `EncoderConfig.mlp`: "mlp" (`Mlp`: fc1, act, fc2) or "swiglu"
    (`SwiGLU`: fc1_g, fc1_x, fc2, gated by `act`).

    Args:
        inner_norm: for "swiglu", the norm (`build_norm`'s name, with `norm_eps`) of the
            hidden activation before fc2 (`EncoderConfig.mlp_norm`); None for none.

    Raises:
        ValueError: for an unknown kind or activation, or an inner norm without SwiGLU.
    """
    if inner_norm is not None and kind != "swiglu":
        raise ValueError(f"an inner MLP norm ({inner_norm!r}) needs the swiglu MLP, got {kind!r}")
    if kind == "mlp":
        return Mlp(width, hidden_width, act=act)
    if kind == "swiglu":
        norm = None if inner_norm is None else build_norm(inner_norm, hidden_width, norm_eps)
        return SwiGLU(width, hidden_width, act=build_activation(act), norm=norm)
    raise ValueError(f"unknown MLP {kind!r}; known: mlp, swiglu")
