"""One optimiser step: the run's progress, the batch's parts and the loss."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import vlm_vit.train.checkpoint as ckpt
from vlm_vit.train.data import ImageBatch, UndecodableImage
from vlm_vit.train.run_dir import _listing


@dataclass
class _Progress:
    """Everything about the run's position that a checkpoint carries besides the modules."""

    step: int = 0
    epoch: int = 0
    batch_index: int = 0  # the next batch to draw within `epoch`
    losses: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    bad_streak: int = 0  # consecutive non-finite steps, for max_bad_steps
    undecodable_images: int = 0
    undecodable_paths: list[str] = field(default_factory=list)



def _nothing_trained(progress: _Progress, run_dir: Path) -> str:
    """Why a run whose every step was skipped exports nothing."""
    undecodable = (f"{len(progress.undecodable_paths)} undecodable image files "
                   f"({_listing(sorted(progress.undecodable_paths))})" if progress.undecodable_paths
                   else "no undecodable image")
    return (f"no step of the {progress.step} trained: every batch was skipped ({undecodable}; "
            f"a step without a decodable image, or with a non-finite loss, makes no update), so "
            f"no encoder was exported to {run_dir}; check the data")


def _newest_checkpoint(run_dir: Path) -> str:
    found = ckpt.latest_checkpoint(run_dir)
    return f"The newest checkpoint is {found}." if found else "No checkpoint was written yet."


def _unpack(batch: Any) -> tuple[torch.Tensor, list[UndecodableImage], torch.Tensor | None]:
    """Pixels `[B, 3, H, W]`, dropped files and labels `[B]` (or None) from whatever the collate
    function returned."""
    if isinstance(batch, ImageBatch):
        return batch.pixel_values, batch.undecodable, batch.labels
    if isinstance(batch, torch.Tensor):
        return batch, [], None
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        labels = batch[1] if len(batch) > 1 and isinstance(batch[1], torch.Tensor) else None
        return batch[0], [], labels  # (pixels, labels, ...)
    raise TypeError(f"the collate function returned a {type(batch).__name__}; expected an "
                    "ImageBatch, a pixel tensor, or a tuple starting with one")


def _scalar_loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"the objective must return an ObjectiveOutput with a scalar loss, "
                         f"got {shape}")
    return loss.reshape(()).float()  # float32 even under autocast
