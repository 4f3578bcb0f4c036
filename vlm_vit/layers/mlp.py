"""The two-layer MLP of every block (paper eq. 3) and its activations."""

from __future__ import annotations

import torch
from torch import nn


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): OpenAI CLIP's approximation, which its weights were trained with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS = {
    "gelu": lambda: nn.GELU(),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),  # flax's default, used by the JAX code
    "quick_gelu": QuickGELU,
}


def build_activation(name: str) -> nn.Module:
    """The activation module named `name` (see `EncoderConfig.act`)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()


class Mlp(nn.Module):
    """Linear, activation, Linear."""

    def __init__(self, width: int, hidden_width: int, act: str = "gelu") -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden_width)
        self.act = build_activation(act)
        self.fc2 = nn.Linear(hidden_width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
