"""The training loop: an objective, a dataset and a config in; checkpoints and an encoder out.

    trainer = Trainer(objective, ImageFolder(...), TrainConfig(steps=10_000, ...), "runs/a")
    result = trainer.fit(resume=True)      # continues from runs/a's newest checkpoint, if any

The objective (`vlm_vit.pretrain.base.Objective`) owns the loss and its randomness; the
trainer owns optimisation (AdamW, warmup then cosine, clipping, accumulation, mixed
precision), data order, checkpoints and processes (`vlm_vit.train.distributed`).

A run directory ends up holding:

    run_config.json    the merged configuration and the command that ran it
    metrics.csv        one row per step
    checkpoints/       step_XXXXXXXX.pt, the newest `keep_checkpoints`
    objective.pt       the objective's final state dict (not for a sharded plain-encoder
                       objective: its final checkpoint holds it)
    encoder/           the final encoder in the native format (`vlm_vit.load_encoder`)
    adapter/           instead of encoder/ for a LoRA objective: the adapter, in peft's format
    model/             instead of both for an objective with its own `export` (the LLM bridge)

Resuming is exact: a run stopped after any checkpoint and resumed takes the same steps, on
the same batches with the same random draws, as one that never stopped (on the same
hardware and number of processes). Checkpoints carry every process's RNG states, and the
data order and augmentation are functions of (seed, epoch, index), not of the RNG.

The loop below reads top to bottom: lock, checks, setup, resume, `for batch in source`,
checkpoint, export. Each idea is a component it calls: the data source (`vlm_vit.data`),
`step.py` (one optimiser step, and what a non-finite one does), `resume.py` (what a
checkpoint carries), `run_dir.py`, `metrics.py`, `signals.py`, `optim.py` and
`distributed.py` (the one seam for a parallel strategy).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import vlm_vit.train.checkpoint as ckpt
import vlm_vit.train.distributed as distributed
import vlm_vit.train.resume as run_state
import vlm_vit.train.run_dir as outputs
from vlm_vit.data.samples import collate_images
from vlm_vit.data.source import as_source
from vlm_vit.train.config import (
    HARMLESS_CHANGES,
    PRECISIONS,
    NonFiniteLossError,
    NothingTrainedError,
    TrainConfig,
    TrainResult,
)
from vlm_vit.train.distributed import DistributedContext
from vlm_vit.train.metrics import METRICS_NAME, SAMPLES_DIR, TENSORBOARD_DIR, RunReport, Silent
from vlm_vit.train.optim import (
    NO_DECAY_NAMES,
    Optimization,
    build_scheduler,
    learning_rate,
    optimizer_groups,
    parameter_groups,
)
from vlm_vit.train.run_dir import (
    ADAPTER_DIR,
    ENCODER_DIR,
    MODEL_DIR,
    OBJECTIVE_NAME,
    RUN_CONFIG_NAME,
    RUN_OUTPUTS,
    short_listing,
)
from vlm_vit.train.run_export import export_run
from vlm_vit.train.run_lock import RunLock
from vlm_vit.train.signals import StopSignals, ignore_interrupts
from vlm_vit.train.step import Progress, TrainingRun, nothing_trained_message, train_step

# Names defined here before the split by idea, still importable from this module.
__all__ = ["ADAPTER_DIR", "ENCODER_DIR", "METRICS_NAME", "MODEL_DIR", "NO_DECAY_NAMES",
           "OBJECTIVE_NAME", "PRECISIONS", "RUN_CONFIG_NAME", "RUN_OUTPUTS", "SAMPLES_DIR",
           "TENSORBOARD_DIR", "NonFiniteLossError", "NothingTrainedError", "TrainConfig",
           "TrainResult", "Trainer", "build_scheduler", "learning_rate", "optimizer_groups",
           "parameter_groups"]

logger = logging.getLogger(__name__)


class Trainer:
    """Trains an objective on a data source, on one process or under torchrun.

    Args:
        objective: an `Objective`: a module returning `ObjectiveOutput(loss, metrics)` for
            `[B, 3, H, W]` pixels (and `labels=` when the batches carry labels), with the
            encoder it trains as `objective.encoder`. It is moved to the device, and compiled
            in place when `config.compile` is set. An objective with an `export(run_dir)`
            method writes the final result itself (returning its path) instead of
            `objective.pt` and `encoder/`: the LLM bridge writes its whole model so.
        dataset: a `vlm_vit.data.DataSource`, a `ShardStream`, or a map-style dataset. With
            the default collate its items are `[3, H, W]` tensors or `UndecodableImage`
            markers (see `ImageFolder`). A map-style dataset with `set_epoch(epoch)` has it
            called before each epoch's loader starts; for exact resumes its randomness must
            depend only on (epoch, index), as ImageFolder's does.
        config: the training settings.
        run_dir: where checkpoints, metrics and the final encoder go; created if needed.
        collate: turns a list of items into an `ImageBatch`, a pixel tensor, or a tuple
            whose first element is the pixel tensor (default: `collate_images`).
        command: the command line that reproduces the run, for run_config.json (default:
            this process's `sys.argv`).
        progress: show the progress bar (on rank 0).
    """

    def __init__(
        self,
        objective: nn.Module,
        dataset: Any,
        config: TrainConfig,
        run_dir: str | Path,
        *,
        collate: Callable[[list], Any] | None = None,
        command: str | None = None,
        progress: bool = True,
    ) -> None:
        if not isinstance(getattr(objective, "encoder", None), nn.Module):
            raise TypeError(f"{type(objective).__name__} has no `encoder` module; the trainer "
                            "saves objective.encoder at the end")
        self.objective = objective
        self.source = as_source(dataset)
        self.config = config
        self.run_dir = Path(run_dir)
        self.collate = collate or collate_images
        self.command = command if command is not None else " ".join(sys.argv)
        self.progress = progress

    # -- the run ----------------------------------------------------------------------------

    def fit(self, resume: bool = False, overwrite: bool = False) -> TrainResult:
        """Trains for `config.steps` steps in total.

        An earlier run's files (`RUN_OUTPUTS`) are never replaced silently: a fresh run
        needs a `run_dir` without them, and a resume needs a checkpoint unless there are none.

        Args:
            resume: continue from the newest checkpoint in `run_dir`; in an empty `run_dir`,
                or one an attempt of this same run left before its first checkpoint (a
                requeue after a kill), it starts fresh and warns so.
            overwrite: remove an earlier run's files (`RUN_OUTPUTS`) first and start afresh.

        Returns:
            A `TrainResult`.

        Raises:
            RunDirectoryInUse: when another live process is training in `run_dir` (a
                `FileExistsError`, naming its pid).
            NotADirectoryError, FileExistsError, ValueError: as `check_run_dir`, before
                anything is written.
            NonFiniteLossError: after `config.max_bad_steps` non-finite steps in a row.
            ValueError: when the batch does not split over processes and micro-batches, or
                the dataset is smaller than one batch.
        """
        # One run per directory: rank 0 holds an OS lock on it until `fit` returns (the
        # kernel drops it if the process dies first).
        lock = RunLock(self.run_dir) if distributed.launched_rank() == 0 else None
        if lock is not None:
            lock.acquire()  # RunDirectoryInUse, naming the holder's pid
        try:
            self.check_run_dir(resume, overwrite)
            context = distributed.setup(self.config.device)
            flushing = self.config.flush_denormal and context.device.type == "cpu" \
                and torch.set_flush_denormal(True)  # False where the CPU cannot (no SSE3)
            watch = distributed.FailureWatch(context)  # a failing rank stops every rank
            try:
                return self._fit(context, resume, overwrite)
            except Exception as error:
                watch.fail(error)
                raise
            finally:
                watch.close()
                if flushing:
                    torch.set_flush_denormal(False)
                distributed.teardown(context)
        finally:
            if lock is not None:
                lock.release()

    def check_run_dir(self, resume: bool = False, overwrite: bool = False) -> None:
        """Refuses, without writing anything, a `run_dir` that `fit(resume, overwrite)` would
        refuse; `fit` runs it first. A command writes its own files there (`finetune.json`)
        only once this passes, so a refused run leaves the directory as it was.

        Args:
            resume, overwrite: as in `fit`.

        Raises:
            NotADirectoryError: when `run_dir` is a file.
            FileExistsError: when `run_dir` holds an earlier run and neither a checkpoint to
                resume nor `overwrite` says what to do with it (without a checkpoint, a
                resume accepts only the outputs of this same run: its `run_config.json`
                records the same model, training settings and data).
            ValueError: when resuming a run whose `run_config.json` records another encoder
                or objective than this trainer's, naming each setting that differs.
        """
        outputs.check_run_dir(self.run_dir, resume, overwrite, self._recorded_changes)

    def _recorded_changes(self, whole_run: bool) -> list[str] | None:
        """How the run `run_config.json` records differs from this one (None without one):
        its objective and encoder, and with `whole_run` (no checkpoint carries the rest) its
        training settings, those `HARMLESS_CHANGES` aside, and its data."""
        now = outputs.described_model(self.objective)
        if whole_run:
            now["train"] = {name: value for name, value in self.config.to_dict().items()
                            if name not in HARMLESS_CHANGES}
            now["dataset"] = self.source.describe()
        return outputs.recorded_changes(self.run_dir, now)

    def _fit(self, context: DistributedContext, resume: bool, overwrite: bool) -> TrainResult:
        config, objective, source = self.config, self.objective, self.source
        log = logger if context.is_main else Silent()
        # Checks: the batch splits over processes and micro-batches, the source fits it.
        per_rank, _ = distributed.split_batch(config.batch_size, context.world_size,
                                              config.grad_accumulation)
        source.configure(per_rank, self.collate, seed=config.seed, rank=context.rank,
                         world_size=context.world_size, workers=config.num_workers,
                         group_by_length=config.group_by_length)
        found, replaced = outputs.prepare_run_dir(self.run_dir, resume, overwrite, context, log)

        # Setup, then resume: the objective, optimiser and data source where the checkpoint
        # left them.
        objective.to(context.device).train()
        self._set_grad_checkpointing(log)
        distributed.shard(objective, context, config.strategy, precision=config.precision,
                          cpu_offload=config.cpu_offload)  # "fsdp": before the optimiser
        optimization = Optimization.build(objective, config, context.device.type)
        run = TrainingRun(self.run_dir, objective, optimization, source, config, context, log)
        progress, rng_states = Progress(), None
        if found is not None:
            found, progress, rng_states = run_state.restore(run, found)
        elif resume:
            log.warning("--resume: no checkpoint in %s; starting a fresh run%s", self.run_dir,
                        f" (replacing the {short_listing(replaced)} an attempt of it left before "
                        "its first checkpoint)" if replaced else "")
        if context.is_main:
            self._write_run_config(context, resumed_from=found)
        if config.compile:
            objective.compile()  # in place: parameter names (and checkpoints) stay unchanged
        model = distributed.wrap(objective, context, config.strategy)
        run_state.seed_or_restore_rng(rng_states, config, progress.step, context, log)

        # The loop.
        report = RunReport(self.run_dir, config, context, progress=self.progress,
                           step=progress.step, resumed=found is not None,
                           sample_log=config.log_samples and source.names_samples, log=log)
        batches = source.loader(pin_memory=context.device.type == "cuda",
                                worker_init_fn=ignore_interrupts)
        with StopSignals() as signals:
            try:
                while progress.step < config.steps:
                    drawn = next(batches)
                    report.drawn(progress.step + 1, drawn.samples)
                    row, stopping = train_step(run, model, drawn.batch, progress,
                                               signals.requested)
                    progress.epoch, progress.batch_index = source.position()
                    report.stepped(row)
                    if (config.checkpoint_every and progress.step % config.checkpoint_every == 0
                            or progress.step == config.steps or stopping):
                        run_state.save(run, progress)
                    if stopping and progress.step < config.steps:  # else: done anyway
                        report.close()
                        log.warning("stopped by signal %s after step %d: checkpoint %s; "
                                    "continue with --resume", signals.received or "on a peer",
                                    progress.step, ckpt.checkpoint_path(self.run_dir,
                                                                        progress.step))
                        raise KeyboardInterrupt
            finally:
                batches.close()
                report.close()

        # Export.
        return self._finish(progress, context, log)

    def _finish(self, progress: Progress, context: DistributedContext, log: Any) -> TrainResult:
        """Every rank's skipped samples in one summary line, then the export from rank 0."""
        without_image, truncated = 0, []
        for skipped in distributed.all_gather_objects(self.source.skipped(), context):
            without_image += skipped["no_image"]
            truncated += [tuple(entry) for entry in skipped["truncated"]]
        if without_image:
            log.warning("skipped %d shard samples without an image", without_image)
        if not any(math.isfinite(loss) for loss in progress.losses):
            raise NothingTrainedError(nothing_trained_message(progress, self.run_dir))
        export_run(self.objective, self.run_dir, progress.step, context, log)
        return TrainResult(progress.step, list(progress.losses), progress.skipped_steps,
                           progress.undecodable_images, sorted(progress.undecodable_paths),
                           self.run_dir, without_image, truncated)

    # -- pieces -----------------------------------------------------------------------------

    def _set_grad_checkpointing(self, log: Any) -> None:
        # An objective that holds models of other libraries (a Hugging Face LLM) sets them
        # up itself; setting their `gradient_checkpointing` attributes directly would not.
        own = getattr(self.objective, "set_gradient_checkpointing", None)
        if callable(own):
            own(self.config.grad_checkpointing)
            return
        modules = [m for m in self.objective.modules() if hasattr(m, "gradient_checkpointing")]
        for module in modules:
            module.gradient_checkpointing = self.config.grad_checkpointing
        if self.config.grad_checkpointing and not modules:
            log.warning("grad_checkpointing is set, but no module of %s has a "
                        "`gradient_checkpointing` attribute; training without it",
                        type(self.objective).__name__)

    def _write_run_config(self, context: DistributedContext, resumed_from: Path | None) -> None:
        outputs.write_run_config(self.run_dir, {
            "command": self.command,
            "train": self.config.to_dict(),
            **outputs.described_model(self.objective),
            "dataset": self.source.describe(),
            "world_size": context.world_size,
            "device": str(context.device),
            "resumed_from": str(resumed_from) if resumed_from else None,
        })
