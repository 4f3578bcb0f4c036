"""The residual connection of eqs. 2 and 3."""

from __future__ import annotations

import torch


def add_residual(x: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """x + update, in a fresh tensor.

    Never in place, not even when autograd is off: `update` is a sublayer's output, which a
    user's forward hook on `attn` or `mlp` may keep, and `x` may be held by `hidden_states`.
    Summing into either would change what they hold; the encode benchmark measured no cost.
    """
    return x + update
