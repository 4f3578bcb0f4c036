"""What a training objective is, for the trainer: a module that turns a batch of pixels into
a loss.

    objective = MaskedPatchPrediction(encoder, ...)      # or MaskedAutoencoder, or your own
    out = objective(pixel_values)                         # ObjectiveOutput
    out.loss.backward()

The objective owns its randomness (masks), its head or decoder, and the encoder it trains
(`objective.encoder`); the trainer owns optimisation, data, checkpoints and processes.

An objective may also define `after_optimizer_step(step, steps, optimizer)`: the trainer
calls it after each optimiser step that changed the weights (`step` counts from 0 up to
`steps`), for what the objective updates itself, such as an EMA teacher and the schedules
of the next step (`vlm_vit.pretrain.ibot`). What it keeps in parameters and buffers is
checkpointed with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@dataclass
class ObjectiveOutput:
    """One step's result.

    Attributes:
        loss: a scalar to minimise (float32).
        metrics: further numbers to log, as Python floats (e.g. accuracy on masked patches).
    """

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Objective(Protocol):
    """A training objective (see the module docstring)."""

    encoder: nn.Module

    def __call__(self, pixel_values: torch.Tensor) -> ObjectiveOutput: ...
