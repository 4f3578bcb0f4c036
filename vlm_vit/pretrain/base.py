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

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

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


def images_grids_masks(pixel_values: Any, patch_size: int, masks: Sequence[Any] | None,
                       draw: Callable[[list[tuple[int, int]]], list[Any]]
                       ) -> tuple[list[torch.Tensor], list[tuple[int, int]], list[Any]]:
    """A batch (stacked `[B, C, H, W]` or a list of `[C, H_i, W_i]`) as a list of images, their
    patch grids, and one mask each: `masks` when given, else `draw(grids)`.

    Raises:
        ValueError: for masks other than one per image.
    """
    images = list(pixel_values)
    grids = [(image.shape[-2] // patch_size, image.shape[-1] // patch_size) for image in images]
    masks = draw(grids) if masks is None else list(masks)
    if len(masks) != len(images):
        raise ValueError(f"{len(masks)} masks for {len(images)} images")
    return images, grids, masks


@torch.no_grad()
def ema_update(teacher: Iterable[torch.Tensor], student: Iterable[torch.Tensor],
               momentum: float) -> None:
    """teacher <- momentum * teacher + (1 - momentum) * student, parameter by parameter."""
    torch._foreach_lerp_(list(teacher), list(student), 1.0 - momentum)


class EMATeacher(nn.Module):
    """An objective whose teacher modules (`teacher_modules`, named attributes) an EMA moves:
    `train()` as `nn.Module.train`, but the teacher always in eval mode (no dropout or
    stochastic depth in its targets)."""

    teacher_modules: tuple[str, ...] = ("encoder",)

    def train(self, mode: bool = True) -> EMATeacher:
        super().train(mode)
        for name in self.teacher_modules:
            getattr(self, name).eval()
        return self


def mask_generator() -> torch.Generator:
    """A generator for one batch's masks, seeded from the process RNG (which checkpoints
    hold, so a resume draws the same masks)."""
    return torch.Generator().manual_seed(int(torch.randint(0, 2**62, (), dtype=torch.long)))
