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
    objective.pt       the objective's final state dict
    encoder/           the final encoder in the native format (`vlm_vit.load_encoder`)
    adapter/           instead of encoder/ for a LoRA objective: the adapter, in peft's format
    model/             instead of both for an objective with its own `export` (the LLM bridge)

Resuming is exact: a run stopped after any checkpoint and resumed takes the same steps, on
the same batches with the same random draws, as one that never stopped (on the same
hardware and number of processes). Checkpoints carry every process's RNG states, and the
data order and augmentation are functions of (seed, epoch, index), not of the RNG.

A step whose loss or gradient norm is not finite makes no update but still counts: it
consumes its batch and advances the LR schedule, so the LR stays a function of the step
number. `max_bad_steps` such steps in a row abort the run (fp16 loss-scale overflows,
which the scaler handles, are skipped without counting towards that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import vlm_vit.train.checkpoint as ckpt
import vlm_vit.train.distributed as distributed
from vlm_vit.files import atomic_write
from vlm_vit.train.config import (
    _HARMLESS_CHANGES,
    PRECISIONS,
    NonFiniteLossError,
    NothingTrainedError,
    TrainConfig,
    TrainResult,
)
from vlm_vit.train.data import (
    UndecodableImage,
    collate_images,
    describe_dataset,
    mixed_seed,
)
from vlm_vit.train.distributed import DistributedContext
from vlm_vit.train.metrics import METRICS_NAME, TENSORBOARD_DIR, _MetricsLog, _Silent
from vlm_vit.train.optim import (
    NO_DECAY_NAMES,
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
    _listing,
)
from vlm_vit.train.run_lock import RunLock
from vlm_vit.train.signals import _ignore_interrupts
from vlm_vit.train.step import (
    _newest_checkpoint,
    _nothing_trained,
    _Progress,
    _scalar_loss,
    _unpack,
)
from vlm_vit.train.tar_shards import SAMPLES_DIR, SampleLog, ShardStream, StreamState

# Names defined here before the split by idea, still importable from this module.
__all__ = ["ADAPTER_DIR", "ENCODER_DIR", "METRICS_NAME", "MODEL_DIR", "NO_DECAY_NAMES",
           "OBJECTIVE_NAME", "PRECISIONS", "RUN_CONFIG_NAME", "RUN_OUTPUTS", "SAMPLES_DIR",
           "TENSORBOARD_DIR", "NonFiniteLossError", "NothingTrainedError", "TrainConfig",
           "TrainResult", "Trainer", "build_scheduler", "learning_rate", "optimizer_groups",
           "parameter_groups"]

logger = logging.getLogger(__name__)

# What a resume reads from a checkpoint; one without them is skipped like a corrupt one.
_CHECKPOINT_KEYS = ("progress", "objective", "optimizer", "scheduler", "scaler", "rng",
                    "config")


class Trainer:
    """Trains an objective on a dataset, on one process or under torchrun.

    Args:
        objective: an `Objective`: a module returning `ObjectiveOutput(loss, metrics)` for
            `[B, 3, H, W]` pixels (and `labels=` when the batches carry labels), with the
            encoder it trains as `objective.encoder`. It is moved to the device, and compiled
            in place when `config.compile` is set. An objective with an `export(run_dir)`
            method writes the final result itself (returning its path) instead of
            `objective.pt` and `encoder/`: the LLM bridge writes its whole model so.
        dataset: a map-style dataset. With the default collate its items are `[3, H, W]`
            tensors or `UndecodableImage` markers (see `ImageFolder`). If it has
            `set_epoch(epoch)`, that is called before each epoch's loader starts. For exact
            resumes its randomness must depend only on (epoch, index), as ImageFolder's does.
        config: the training settings.
        run_dir: where checkpoints, metrics and the final encoder go; created if needed.
        collate: turns a list of items into an `ImageBatch`, a pixel tensor, or a tuple
            whose first element is the pixel tensor (default: `collate_images`).
        command: the command line that reproduces the run, for run_config.json (default:
            this process's `sys.argv`).
        progress_bar: show the progress bar (on rank 0).
    """

    def __init__(
        self,
        objective: nn.Module,
        dataset: torch.utils.data.Dataset,
        config: TrainConfig,
        run_dir: str | Path,
        *,
        collate: Callable[[list], Any] | None = None,
        command: str | None = None,
        progress_bar: bool = True,
    ) -> None:
        if not isinstance(getattr(objective, "encoder", None), nn.Module):
            raise TypeError(f"{type(objective).__name__} has no `encoder` module; the trainer "
                            "saves objective.encoder at the end")
        self.objective = objective
        self.dataset = dataset
        self.config = config
        self.run_dir = Path(run_dir)
        self.collate = collate or collate_images
        self.command = command if command is not None else " ".join(sys.argv)
        self.progress_bar = progress_bar
        self._stop_signal: str | None = None  # the signal that asked the run to stop
        self._stopping = False  # every rank agreed to stop after this step

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
            try:
                return self._fit(context, resume, overwrite)
            finally:
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
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise NotADirectoryError(f"{self.run_dir} is a file, not a run directory; give "
                                     "--out (run_dir) a folder")
        if overwrite:
            return
        entries = [name for name in RUN_OUTPUTS if (self.run_dir / name).exists()]
        found = ckpt.latest_checkpoint(self.run_dir)
        if found is not None and not resume:
            raise FileExistsError(f"{self.run_dir} already holds checkpoints (newest {found}); "
                                  "pass --resume (resume=True) to continue that run, "
                                  "--overwrite to replace it, or use another run directory")
        recorded = self.run_dir / RUN_CONFIG_NAME
        if found is None and entries:
            # A requeue of this run killed before its first checkpoint starts it afresh.
            changed = self._recorded_changes(whole_run=True) if resume else None
            if changed == []:
                return
            what = (f"holds an earlier run's {_listing(entries)}" if not resume else
                    f"has no checkpoint to resume from, but holds an earlier run's "
                    f"{_listing(entries)}" + (f", of another run ({recorded.name} -> now: "
                                              f"{'; '.join(changed)})" if changed else ""))
            raise FileExistsError(f"{self.run_dir} {what}; pass --overwrite (overwrite=True) "
                                  f"to start afresh there, or use another run directory")
        changed = self._recorded_changes(whole_run=False) if found is not None else None
        if changed:
            raise ValueError(f"{self.run_dir} was trained with another model than this run's "
                             f"({recorded.name} -> now): {'; '.join(changed)}; resume with the "
                             f"same model and settings, or start afresh with --overwrite")

    def _recorded_changes(self, whole_run: bool) -> list[str] | None:
        """How the run `run_config.json` records differs from this one (None without one):
        its objective and encoder, and with `whole_run` (no checkpoint carries the rest) its
        training settings, those `_HARMLESS_CHANGES` aside, and its data."""
        recorded = self.run_dir / RUN_CONFIG_NAME
        if not recorded.is_file():
            return None
        from vlm_vit.files import read_json

        saved = read_json(recorded)
        now = self._described_model()
        if whole_run:
            now["train"] = {name: value for name, value in self.config.to_dict().items()
                            if name not in _HARMLESS_CHANGES}
            now["dataset"] = describe_dataset(self.dataset)
        now = json.loads(json.dumps(now, default=str))  # as recorded
        changed = []
        for part, settings in now.items():
            before = saved.get(part)
            if not (isinstance(before, dict) and isinstance(settings, dict)):
                continue
            # A field only one side has (one library version's) is no difference.
            changed += [f"{part} {key} {before[key]!r} -> {value!r}"
                        for key, value in settings.items()
                        if key in before and before[key] != value]
        return changed

    def _fit(self, context: DistributedContext, resume: bool, overwrite: bool) -> TrainResult:
        config, objective = self.config, self.objective
        log = logger if context.is_main else _Silent()
        distributed.split_batch(config.batch_size, context.world_size, config.grad_accumulation)
        streaming = isinstance(self.dataset, ShardStream)
        steps_per_epoch = None if streaming else distributed.batches_per_epoch(
            len(self.dataset), config.batch_size)

        if config.group_by_length and streaming:
            raise ValueError("group_by_length needs a map-style dataset with `lengths`; a "
                             "shard stream has none")
        if config.group_by_length and getattr(self.dataset, "lengths", None) is None:
            raise ValueError(f"group_by_length needs a dataset with `lengths`; "
                             f"{type(self.dataset).__name__} has none")
        entries = [name for name in RUN_OUTPUTS if (self.run_dir / name).exists()]
        found = ckpt.latest_checkpoint(self.run_dir)  # `check_run_dir` accepted what is here
        # Without a checkpoint, `check_run_dir` let a resume past only this run's own outputs.
        restart = resume and found is None and bool(entries)
        if (overwrite or restart) and entries:
            if context.is_main:
                if overwrite:
                    log.warning("--overwrite: removing %s from %s", _listing(entries),
                                self.run_dir)
                for path in (self.run_dir / name for name in entries):
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() \
                        else path.unlink()
            distributed.barrier(context)
            found = None
        if context.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.remove_stale_temporaries(self.run_dir)
        distributed.barrier(context)  # the directory exists and no rank sees stale temporaries

        objective.to(context.device).train()
        self._set_grad_checkpointing(log)
        optimizer = torch.optim.AdamW(optimizer_groups(objective, config),
                                      lr=config.lr, betas=config.betas)
        scheduler = build_scheduler(optimizer, config)
        scaler = torch.amp.GradScaler(context.device.type, enabled=config.precision == "fp16")
        progress = _Progress()
        rng_states = data_states = None
        if found is not None:
            # The newest checkpoint that matches its hash and loads; newer ones that do not
            # are reported (WARNING), moved aside by rank 0, and skipped.
            loaded = ckpt.load_latest_checkpoint(
                self.run_dir, required=_CHECKPOINT_KEYS, move_aside=context.is_main, log=log)
            if loaded is None:
                raise FileNotFoundError(f"{found} was removed while the run started")
            found, state = loaded
            data_states = state.get("data")
            self._check_resumed_config(state["config"], log)
            objective.load_state_dict(state["objective"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            scaler.load_state_dict(state["scaler"])
            progress = _Progress(**state["progress"])
            rng_states = state["rng"]
            log.info("resuming from %s at step %d", found, progress.step)
        elif resume:
            log.warning("--resume: no checkpoint in %s; starting a fresh run%s", self.run_dir,
                        f" (replacing the {_listing(entries)} an attempt of it left before "
                        "its first checkpoint)" if restart else "")
        if context.is_main:
            self._write_run_config(context, resumed_from=found)

        model = objective
        if config.compile:
            model.compile()  # in place: parameter names (and checkpoints) stay unchanged
        model = distributed.wrap(model, context)

        # The RNGs are set last, so nothing above (model building, DDP) shifts them.
        if rng_states is not None and len(rng_states) == context.world_size:
            ckpt.set_rng_state(rng_states[context.rank])
        else:
            if rng_states is not None:
                log.warning("checkpoint has RNG states for %d processes, this run has %d; "
                            "reseeding (the run continues, not bit-exactly)",
                            len(rng_states), context.world_size)
            ckpt.seed_everything(config.seed + context.rank if rng_states is None
                                 else mixed_seed(config.seed, context.rank, progress.step))

        metrics = _MetricsLog(self.run_dir, progress.step if found else None) \
            if context.is_main else None
        stream_state = self._configure_stream(context, data_states) if streaming else None
        samples_log = SampleLog(self.run_dir, context.rank, progress.step if found else None) \
            if streaming and config.log_samples else None
        from tqdm import tqdm

        bar = tqdm(total=config.steps, initial=progress.step,
                   disable=not (context.is_main and self.progress_bar),
                   desc="train", dynamic_ncols=True)
        handlers = self._catch_signals()
        # Log lines go through the bar's writer, so a warning never lands glued to it.
        from tqdm.contrib.logging import logging_redirect_tqdm

        redirect = contextlib.ExitStack()
        if context.is_main and self.progress_bar:
            redirect.enter_context(logging_redirect_tqdm())
        try:
            while progress.step < config.steps:
                batches = (self._stream_loader(stream_state, context) if streaming
                           else self._loader(progress.epoch, progress.batch_index, context))
                for batch in batches:
                    if streaming:  # a StreamBatch: where this rank's stream stands after it
                        stream_state.advance(batch)
                        if samples_log is not None:
                            samples_log.write(progress.step + 1, batch.samples)
                        batch = batch.batch
                    row = self._step(model, batch, optimizer, scheduler, scaler, context,
                                     progress, log)
                    if streaming:
                        progress.epoch, progress.batch_index = (stream_state.epoch(),
                                                                stream_state.batches)
                    else:
                        progress.batch_index += 1
                        if progress.batch_index == steps_per_epoch:
                            progress.epoch, progress.batch_index = progress.epoch + 1, 0
                    if metrics is not None:
                        metrics.write(row)
                    bar.update(1)
                    bar.set_postfix(loss=f"{row['loss']:.4g}", lr=f"{row['lr']:.3g}",
                                    img_s=f"{row['images_per_s']:.1f}", refresh=False)
                    if progress.step % config.log_every == 0:
                        log.info("step %d/%d  loss %.4f  lr %.3g  grad norm %.3g  %.1f img/s",
                                 progress.step, config.steps, row["loss"], row["lr"],
                                 row["grad_norm"], row["images_per_s"])
                    if (config.checkpoint_every and progress.step % config.checkpoint_every == 0
                            or progress.step == config.steps or self._stopping):
                        self._save(optimizer, scheduler, scaler, progress, context, log,
                                   stream_state)
                    if self._stopping and progress.step < config.steps:  # else: done anyway
                        bar.close()
                        log.warning("stopped by signal %s after step %d: checkpoint %s; "
                                    "continue with --resume", self._stop_signal or "on a peer",
                                    progress.step, ckpt.checkpoint_path(self.run_dir,
                                                                        progress.step))
                        raise KeyboardInterrupt
                    if progress.step >= config.steps:
                        break
        finally:
            bar.close()
            if metrics is not None:
                metrics.close()
            if samples_log is not None:
                samples_log.close()
            self._restore_signals(handlers)
            redirect.close()

        without_image, truncated = 0, []
        if streaming:  # every rank's counts, for the result and one summary line
            for rank_state in distributed.all_gather_objects(stream_state.to_dict(), context):
                without_image += rank_state["no_image"]
                truncated += [tuple(t) for t in rank_state["truncated"]]
            if without_image:
                log.warning("skipped %d shard samples without an image", without_image)
        if not any(math.isfinite(loss) for loss in progress.losses):
            raise NothingTrainedError(_nothing_trained(progress, self.run_dir))
        if context.is_main:
            self._export(log)
        distributed.barrier(context)
        return TrainResult(progress.step, list(progress.losses), progress.skipped_steps,
                           progress.undecodable_images, sorted(progress.undecodable_paths),
                           self.run_dir, without_image, truncated)

    # -- one step ---------------------------------------------------------------------------

    def _step(
        self,
        model: nn.Module,
        batch: Any,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler,
        context: DistributedContext,
        progress: _Progress,
        log: Any,
    ) -> dict[str, float]:
        """Forward, backward, clip and update on one global batch; returns the metrics row.

        `model` is the objective as called (DDP-wrapped under torchrun); `progress` is
        advanced by one step.
        """
        config = self.config
        started = time.perf_counter()
        images, undecodable, labels = _unpack(batch)
        lr = optimizer.param_groups[0]["lr"]  # the LR this step uses
        count = len(images)
        # A rank without a single image cannot join the gradient all-reduce, so such a step
        # is skipped on every rank.
        fewest = int(distributed.all_reduce(torch.tensor([count], dtype=torch.float64),
                                            context, "min").item())
        rank_loss = torch.zeros((), dtype=torch.float64)
        objective_metrics: dict[str, float] = {}
        if fewest > 0:
            images = images.to(context.device, non_blocking=True)
            # Micro-batches hold ~equal shares; each loss is weighted by its share, so the
            # accumulated gradient is that of the mean loss over the whole batch.
            pieces = images.tensor_split(min(config.grad_accumulation, count))
            # Labelled batches (fine-tuning) hand each micro-batch its labels.
            label_pieces = (labels.to(context.device).tensor_split(len(pieces))
                            if labels is not None else [None] * len(pieces))
            amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.precision)
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
                    objective_metrics[name] = objective_metrics.get(name, 0.0) \
                        + float(value) * weight

        # (loss summed over ranks, images, undecodable, ranks asked to stop) in one
        # all-reduce, so every rank agrees on stopping after this step.
        totals = distributed.all_reduce(
            torch.stack([rank_loss, torch.tensor(float(count), dtype=torch.float64),
                         torch.tensor(float(len(undecodable)), dtype=torch.float64),
                         torch.tensor(float(self._stop_signal is not None),
                                      dtype=torch.float64)]),
            context)
        self._stopping = bool(totals[3] > 0)
        loss_value = totals[0].item() / context.world_size
        if totals[2] > 0:
            self._record_undecodable(undecodable, context, progress, log)

        grad_norm, updated = math.nan, False
        if fewest > 0:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            parameters = [p for p in self.objective.parameters() if p.grad is not None]
            max_norm = config.grad_clip if config.grad_clip > 0 else math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm).item()
            finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
            if finite:
                scaler.step(optimizer)
                progress.bad_streak, updated = 0, True
            else:
                self._record_bad_step(loss_value, grad_norm, progress, log)
            scaler.update()
        else:
            loss_value = math.nan
            progress.skipped_steps += 1
            log.warning("step %d: no decodable image in a batch; skipping the update",
                        progress.step + 1)
        # The schedule advances on skipped steps too: the LR stays a function of the step
        # number and the step count still matches the batches drawn. (torch warns when that
        # happens before the optimizer's first step; here it is meant.)
        with warnings.catch_warnings():
            if not updated:
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler")
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        progress.step += 1
        progress.losses.append(loss_value)

        if progress.bad_streak >= config.max_bad_steps:
            raise NonFiniteLossError(
                f"{progress.bad_streak} consecutive steps (up to step {progress.step}) had a "
                f"non-finite loss or gradient norm (last: loss {loss_value}, grad norm "
                f"{grad_norm}); giving up. {_newest_checkpoint(self.run_dir)} Lower the lr, add "
                "warmup, use bf16 instead of fp16, or check the data."
            )
        seconds = time.perf_counter() - started
        row = {"step": progress.step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
               "images_per_s": totals[1].item() / max(seconds, 1e-9), "skipped": int(not updated)}
        for name, value in objective_metrics.items():  # rank 0's; never over the trainer's
            row.setdefault(name, value)
        return row

    def _record_bad_step(self, loss: float, grad_norm: float, progress: _Progress,
                         log: Any) -> None:
        progress.skipped_steps += 1
        if self.config.precision == "fp16" and math.isfinite(loss):
            # An overflow in the scaled fp16 gradients is routine: the scaler lowers its
            # scale and the next step usually succeeds. It does not count towards aborting.
            log.info("step %d: fp16 gradient overflow; skipping the update and lowering the "
                     "loss scale", progress.step + 1)
            return
        progress.bad_streak += 1
        log.warning("step %d: loss %s, gradient norm %s is not finite; skipping the update "
                    "(%d in a row, abort at %d)", progress.step + 1, loss, grad_norm,
                    progress.bad_streak, self.config.max_bad_steps)

    def _record_undecodable(self, undecodable: list[UndecodableImage],
                            context: DistributedContext, progress: _Progress, log: Any) -> None:
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

    # -- pieces -----------------------------------------------------------------------------

    def _loader(self, epoch: int, start_batch: int,
                context: DistributedContext) -> torch.utils.data.DataLoader:
        """This rank's batches of `epoch` from `start_batch` on."""
        config = self.config
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)  # workers start afresh per loader and copy this
        sampler = distributed.GlobalBatchSampler(
            len(self.dataset), config.batch_size, seed=config.seed, epoch=epoch,
            start_batch=start_batch, rank=context.rank, world_size=context.world_size,
            lengths=self.dataset.lengths if config.group_by_length else None)
        # The loader draws its workers' base seed from this generator; without one it would
        # draw from the global RNG, which the objective's draws must not depend on.
        generator = torch.Generator().manual_seed(mixed_seed(config.seed, epoch, context.rank))
        return torch.utils.data.DataLoader(
            self.dataset, batch_sampler=sampler, collate_fn=self.collate,
            num_workers=config.num_workers, pin_memory=context.device.type == "cuda",
            generator=generator, worker_init_fn=_ignore_interrupts if config.num_workers else None)

    def _configure_stream(self, context: DistributedContext,
                          saved: list[dict] | None) -> StreamState:
        """This rank's shard stream, fresh or where the checkpoint left it."""
        if saved is not None and len(saved) != context.world_size:
            raise ValueError(f"the checkpoint's shard stream was read by {len(saved)} "
                             f"processes, this run has {context.world_size}: resume with "
                             f"{len(saved)} (or start afresh with --overwrite)")
        per_rank, _ = distributed.split_batch(self.config.batch_size, context.world_size,
                                              self.config.grad_accumulation)
        return self.dataset.configure(
            per_rank, self.collate, rank=context.rank, world_size=context.world_size,
            workers=self.config.num_workers,
            state=saved[context.rank] if saved is not None else None)

    def _stream_loader(self, state: StreamState, context: DistributedContext):
        """This rank's endless `StreamBatch`es from where `state` stands."""
        generator = torch.Generator().manual_seed(
            mixed_seed(self.config.seed, state.batches, context.rank))
        return self.dataset.loader(
            generator=generator, worker_init_fn=_ignore_interrupts,
            pin_memory=context.device.type == "cuda")

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

    def _catch_signals(self) -> dict:
        """SIGINT and SIGTERM finish the current step, checkpoint it and stop (a second
        signal stops at once); returns the handlers to restore. Only the main thread can
        take signals, so elsewhere nothing changes."""
        self._stop_signal, self._stopping = None, False
        if threading.current_thread() is not threading.main_thread():
            return {}

        def request_stop(number, frame):
            if self._stop_signal is not None:  # asked twice: stop now, as Python would
                self._restore_signals(handlers)
                raise KeyboardInterrupt
            self._stop_signal = signal.Signals(number).name
            logger.warning("%s: finishing step, then saving a checkpoint (again to stop now)",
                           self._stop_signal)

        handlers = {number: signal.signal(number, request_stop)
                    for number in (signal.SIGINT, signal.SIGTERM)}
        return handlers

    @staticmethod
    def _restore_signals(handlers: dict) -> None:
        for number, handler in handlers.items():
            signal.signal(number, handler)

    def _save(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler,
        progress: _Progress,
        context: DistributedContext,
        log: Any,
        stream_state: StreamState | None = None,
    ) -> None:
        """Writes a checkpoint from rank 0, with every rank's RNG state (and shard stream
        position); all ranks wait."""
        rng_states = distributed.all_gather_objects(ckpt.rng_state(), context)
        data_states = None if stream_state is None else distributed.all_gather_objects(
            stream_state.to_dict(), context)
        if context.is_main:
            path = ckpt.save_checkpoint({
                "step": progress.step,
                "progress": dataclasses.asdict(progress),
                "objective": self.objective.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "rng": rng_states,
                "config": self.config.to_dict(),
                "world_size": context.world_size,
                **({"data": data_states} if data_states is not None else {}),
            }, ckpt.checkpoint_path(self.run_dir, progress.step))
            removed = ckpt.prune_checkpoints(self.run_dir, self.config.keep_checkpoints)
            log.info("saved %s%s", path, f" (removed {len(removed)} older)" if removed else "")
        distributed.barrier(context)  # nobody resumes or exits before the file is whole

    def _check_resumed_config(self, saved: dict[str, Any], log: Any) -> None:
        current = self.config.to_dict()
        changed = {name: (saved.get(name), value) for name, value in current.items()
                   if saved.get(name) != value and name not in _HARMLESS_CHANGES}
        if changed:
            log.warning("resuming with a changed config (checkpoint -> now): %s; the run "
                        "will differ from an uninterrupted one",
                        ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))

    def _described_model(self) -> dict[str, Any]:
        """The objective and encoder settings run_config.json records (a resume must match)."""
        encoder_config = getattr(self.objective.encoder, "config", None)
        objective_config = getattr(self.objective, "config", None)
        return {
            "objective": {
                "type": f"{type(self.objective).__module__}.{type(self.objective).__qualname__}",
                **({"config": dataclasses.asdict(objective_config)}
                   if dataclasses.is_dataclass(objective_config) else {}),
            },
            "encoder": encoder_config.to_dict() if hasattr(encoder_config, "to_dict") else None,
        }

    def _write_run_config(self, context: DistributedContext, resumed_from: Path | None) -> None:
        from vlm_vit import __version__

        run_config = {
            "command": self.command,
            "train": self.config.to_dict(),
            **self._described_model(),
            "dataset": describe_dataset(self.dataset),
            "world_size": context.world_size,
            "device": str(context.device),
            "resumed_from": str(resumed_from) if resumed_from else None,
            "versions": {"vlm_vit": __version__, "torch": torch.__version__},
        }
        with atomic_write(self.run_dir / RUN_CONFIG_NAME, "w") as handle:
            json.dump(run_config, handle, indent=2, default=str)
            handle.write("\n")

    def _export(self, log: Any) -> None:
        """The final objective state dict and the encoder in the native format, or what the
        objective's own `export(run_dir)` writes."""
        export = getattr(self.objective, "export", None)
        if callable(export):
            log.info("saved %s", export(self.run_dir))
            return
        with atomic_write(self.run_dir / OBJECTIVE_NAME, "wb") as handle:
            torch.save(self.objective.state_dict(), handle)
        if hasattr(self.objective, "peft_config"):  # LoRA: the adapter, in peft's format
            self.objective.save_pretrained(self.run_dir / ADAPTER_DIR)
            log.info("saved the adapter to %s (merge with vlm-vit merge)",
                     self.run_dir / ADAPTER_DIR)
            return
        encoder = self.objective.encoder
        if hasattr(encoder, "save_pretrained"):
            encoder.save_pretrained(self.run_dir / ENCODER_DIR)
            log.info("saved the encoder to %s", self.run_dir / ENCODER_DIR)
        else:
            log.warning("%s has no save_pretrained; only %s was written",
                        type(encoder).__name__, self.run_dir / OBJECTIVE_NAME)


