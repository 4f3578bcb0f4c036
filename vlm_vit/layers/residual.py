"""The residual connection of eqs. 2 and 3, summed in place when nothing records it."""

from __future__ import annotations

import torch


def add_residual(x: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """x + update. When autograd is not recording, the sum goes into `update` (a sublayer's
    fresh output, which nothing else holds): the same numbers, one `[B, T, D]` buffer fewer;
    `x` itself is never changed, since `hidden_states` may hold it."""
    if (torch.is_grad_enabled() and (x.requires_grad or update.requires_grad)) \
            or update.shape != x.shape or update.dtype != torch.result_type(x, update):
        return x + update
    return update.add_(x)
