"""One optimiser step on one global batch, and the run's progress it advances.

A step whose loss or gradient norm is not finite makes no update but still counts: it
consumes its batch and advances the LR schedule, so the LR stays a function of the step
number. `max_bad_steps` such steps in a row abort the run (fp16 loss-scale overflows, which
the scaler handles, are skipped without counting towards that).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import vlm_vit.train.checkpoint as ckpt
import vlm_vit.train.distributed as distributed
from vlm_vit.data.samples import ImageBatch, UndecodableImage
from vlm_vit.data.source import DataSource
from vlm_vit.train.config import NonFiniteLossError, TrainConfig
from vlm_vit.train.distributed import DistributedContext
from vlm_vit.train.fsdp import local_number, zero_frozen_gradients
from vlm_vit.train.optim import Optimization
from vlm_vit.train.run_dir import short_listing


@dataclass
class Progress:
    """Everything about the run's position that a checkpoint carries besides the modules."""

    step: int = 0
    epoch: int = 0
    batch_index: int = 0  # the next batch to draw within `epoch`
    losses: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    bad_streak: int = 0  # consecutive non-finite steps, for max_bad_steps
    undecodable_images: int = 0
    undecodable_paths: list[str] = field(default_factory=list)


@dataclass
class TrainingRun:
    """What the loop's helpers (`train_step`, `resume.save`, `resume.restore`) share for the
    whole run; `Trainer` builds it once the optimiser exists.

    Attributes:
        run_dir: where checkpoints, metrics and the result go.
        objective: the objective itself (checkpointed; its gradients are clipped), not the
            DDP wrapper the loop calls.
        optimization: the optimiser, its LR schedule and its loss scaler.
        source: this rank's data source.
        config: the training settings.
        context: this process's rank, world size and device.
        log: the module's logger on rank 0, `Silent` on the others.
    """

    run_dir: Path
    objective: nn.Module
    optimization: Optimization
    source: DataSource
    config: TrainConfig
    context: DistributedContext
    log: Any


def train_step(run: TrainingRun, model: nn.Module, batch: Any, progress: Progress,
               stop_requested: Callable[[], bool]) -> tuple[dict[str, float], bool]:
    """Forward, backward, clip and update on one global batch.

    Args:
        run: the run's objective, optimiser, settings and processes (its `run_dir` is named
            in the error when the run gives up).
        model: the objective as called (DDP-wrapped under torchrun).
        batch: this rank's share, as the collate function made it.
        progress: advanced by one step.
        stop_requested: whether this rank has been asked to stop (a signal), asked after
            the forward and backward passes, so a signal during them stops after this step.

    Returns:
        The metrics row, and whether every rank agreed to stop after this step.

    Raises:
        NonFiniteLossError: after `config.max_bad_steps` non-finite steps in a row.
    """
    started = time.perf_counter()
    config, context, log = run.config, run.context, run.log
    images, undecodable, labels = _unpack(batch)
    lr = run.optimization.optimizer.param_groups[0]["lr"]  # the LR this step uses
    count = len(images)
    # A rank without a single image cannot join the gradient all-reduce, so such a step
    # is skipped on every rank.
    fewest = int(distributed.all_reduce(torch.tensor([count], dtype=torch.float64),
                                        context, "min").item())
    # Every rank runs as many micro-batches (collectives) as the rank with the fewest images.
    rank_loss, objective_metrics = (
        _forward_backward(model, images, labels, run, min(config.grad_accumulation, fewest))
        if fewest > 0 else (torch.zeros((), dtype=torch.float64), {}))
    # (loss summed over ranks, images, undecodable, ranks asked to stop) in one
    # all-reduce, so every rank agrees on stopping after this step.
    totals = distributed.all_reduce(torch.tensor(
        [rank_loss.item(), float(count), float(len(undecodable)), float(stop_requested())],
        dtype=torch.float64), context)
    loss_value = totals[0].item() / context.world_size
    if totals[2] > 0:
        _record_undecodable(undecodable, context, progress, log)
    grad_norm, updated = math.nan, False
    if fewest > 0:
        grad_norm, updated = _update(run, loss_value, progress)
    else:
        loss_value = math.nan
        progress.skipped_steps += 1
        log.warning("step %d: no decodable image in a batch; skipping the update",
                    progress.step + 1)
    _advance(run.optimization, updated, progress, loss_value)
    if progress.bad_streak >= config.max_bad_steps:
        raise NonFiniteLossError(
            f"{progress.bad_streak} consecutive steps (up to step {progress.step}) had a "
            f"non-finite loss or gradient norm (last: loss {loss_value}, grad norm "
            f"{grad_norm}); giving up. {_newest_checkpoint(run.run_dir)} Lower the lr, add "
            "warmup, use bf16 instead of fp16, or check the data."
        )
    seconds = time.perf_counter() - started
    row = {"step": progress.step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
           "images_per_s": totals[1].item() / max(seconds, 1e-9), "skipped": int(not updated)}
    for name, value in objective_metrics.items():  # rank 0's; never over the trainer's
        row.setdefault(name, value)
    return row, bool(totals[3] > 0)


def _forward_backward(model: nn.Module, images: torch.Tensor, labels: torch.Tensor | None,
                      run: TrainingRun, sections: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Accumulates the gradient of the batch's mean loss over `sections` micro-batches (the
    same number on every rank); returns the loss (a float64 scalar on the CPU) and the
    objective's metrics, both batch means."""
    config, context, scaler = run.config, run.context, run.optimization.scaler
    count = len(images)
    images = images.to(context.device, non_blocking=True)
    # Micro-batches hold ~equal shares; each loss is weighted by its share, so the
    # accumulated gradient is that of the mean loss over the whole batch.
    pieces = images.tensor_split(sections)
    # Labelled batches (fine-tuning) hand each micro-batch its labels.
    label_pieces = (labels.to(context.device).tensor_split(len(pieces))
                    if labels is not None else [None] * len(pieces))
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.precision)
    rank_loss = torch.zeros((), dtype=torch.float64)
    objective_metrics: dict[str, float] = {}
    for index, piece in enumerate(pieces):
        last = index == len(pieces) - 1
        autocast = (torch.autocast(context.device.type, dtype=amp_dtype) if amp_dtype
                    else contextlib.nullcontext())
        with contextlib.nullcontext() if last else distributed.no_sync(model):
            with autocast:
                output = (model(piece) if label_pieces[index] is None
                          else model(piece, labels=label_pieces[index]))
            loss = _scalar_loss(output)
            weight = len(piece) / count
            scaler.scale(loss * weight).backward()
        rank_loss += loss.detach().double().cpu() * weight
        for name, value in output.metrics.items():
            objective_metrics[name] = objective_metrics.get(name, 0.0) + float(value) * weight
    return rank_loss, objective_metrics


def _update(run: TrainingRun, loss: float, progress: Progress) -> tuple[float, bool]:
    """Clips the true (unscaled) gradients and steps the optimiser when the loss and the
    gradient norm are finite; returns the norm and whether the weights changed."""
    objective, optimization, config = run.objective, run.optimization, run.config
    scaler = optimization.scaler
    scaler.unscale_(optimization.optimizer)  # clip the true gradients, not the scaled ones
    zero_frozen_gradients(objective)  # what a hook does for whole parameters, for FSDP2's shards
    parameters = [p for p in objective.parameters() if p.grad is not None]
    max_norm = config.grad_clip if config.grad_clip > 0 else math.inf
    # A DTensor under FSDP2, whose full value is the norm over every rank's shards.
    grad_norm = local_number(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
    updated = math.isfinite(loss) and math.isfinite(grad_norm)
    if updated:
        scaler.step(optimization.optimizer)
        progress.bad_streak = 0
        # What the objective updates itself once its weights moved (an EMA teacher, the
        # schedules of the next step): `after_optimizer_step(step, steps, optimizer)`.
        after = getattr(objective, "after_optimizer_step", None)
        if after is not None:
            after(progress.step, config.steps, optimization.optimizer)
    else:
        _record_bad_step(loss, grad_norm, config, progress, run.log)
    scaler.update()
    return grad_norm, updated


def _advance(optimization: Optimization, updated: bool, progress: Progress,
             loss: float) -> None:
    """Advances the schedule and the step count, updated or not."""
    # The schedule advances on skipped steps too: the LR stays a function of the step
    # number and the step count still matches the batches drawn. (torch warns when that
    # happens before the optimizer's first step; here it is meant.)
    with warnings.catch_warnings():
        if not updated:
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler")
        optimization.scheduler.step()
    optimization.optimizer.zero_grad(set_to_none=True)
    progress.step += 1
    progress.losses.append(loss)


def _record_bad_step(loss: float, grad_norm: float, config: TrainConfig, progress: Progress,
                     log: Any) -> None:
    progress.skipped_steps += 1
    if config.precision == "fp16" and math.isfinite(loss):
        # An overflow in the scaled fp16 gradients is routine: the scaler lowers its
        # scale and the next step usually succeeds. It does not count towards aborting.
        log.info("step %d: fp16 gradient overflow; skipping the update and lowering the "
                 "loss scale", progress.step + 1)
        return
    progress.bad_streak += 1
    log.warning("step %d: loss %s, gradient norm %s is not finite; skipping the update "
                "(%d in a row, abort at %d)", progress.step + 1, loss, grad_norm,
                progress.bad_streak, config.max_bad_steps)


def _record_undecodable(undecodable: list[UndecodableImage], context: DistributedContext,
                        progress: Progress, log: Any) -> None:
    everyone = [bad for rank in distributed.all_gather_objects(undecodable, context)
                for bad in rank]
    progress.undecodable_images += len(everyone)
    known = set(progress.undecodable_paths)
    for bad in everyone:
        if bad.path not in known:
            known.add(bad.path)
            progress.undecodable_paths.append(bad.path)
            log.warning("skipping %s (%s)", bad.path, bad.reason)
        else:
            log.debug("skipping %s again", bad.path)


def nothing_trained_message(progress: Progress, run_dir: Path) -> str:
    """Why a run whose every step was skipped exports nothing."""
    paths = progress.undecodable_paths
    undecodable = (f"{len(paths)} undecodable image files ({short_listing(sorted(paths))})"
                   if paths else "no undecodable image")
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
