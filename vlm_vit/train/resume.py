"""What a checkpoint carries of a run, written and read back: the objective, the optimiser,
the progress, every rank's RNG states and every rank's data-source state.

The checkpoint's "data" entry is the list of every rank's `DataSource.state_dict()`.

Under the "fsdp" strategy the weights and optimiser moments go into a distributed
checkpoint that every rank writes its shards of (`sharded_checkpoint`), and the rest into
its `trainer.pt`; either kind resumes under either strategy and at any number of ranks
(except a "ddp" file into a sharded model).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from torch import nn

import vlm_vit.train.checkpoint as ckpt
import vlm_vit.train.distributed as distributed
import vlm_vit.train.sharded_checkpoint as sharded_checkpoint
from vlm_vit.data.samples import mixed_seed
from vlm_vit.train.config import HARMLESS_CHANGES, TrainConfig
from vlm_vit.train.distributed import DistributedContext
from vlm_vit.train.optim import Optimization
from vlm_vit.train.step import Progress, TrainingRun

# What a resume reads from a checkpoint; one without them is skipped like a corrupt one (a
# distributed checkpoint's weights and optimiser state are in its DCP files instead).
_CHECKPOINT_KEYS = ("progress", "scheduler", "scaler", "rng", "config")
_FILE_KEYS = ("objective", "optimizer")


def save(run: TrainingRun, progress: Progress) -> None:
    """Writes a checkpoint from rank 0, with every rank's RNG and data-source state; all ranks
    wait."""
    run_dir, objective, optimization = run.run_dir, run.objective, run.optimization
    source, config, context = run.source, run.config, run.context
    rng_states = distributed.all_gather_objects(ckpt.rng_state(), context)
    data_states = distributed.all_gather_objects(source.state_dict(), context)
    state = {"step": progress.step, "progress": dataclasses.asdict(progress),
             "rng": rng_states, "config": config.to_dict(), "world_size": context.world_size,
             "data": data_states}
    if config.strategy == "fsdp":
        path = sharded_checkpoint.save(
            ckpt.sharded_checkpoint_path(run_dir, progress.step), objective,
            optimization.optimizer, {**state, "scheduler": optimization.scheduler.state_dict(),
                                     "scaler": optimization.scaler.state_dict()},
            context.rank, context.world_size)
    elif context.is_main:
        path = ckpt.save_checkpoint({**state, "objective": objective.state_dict(),
                                     **optimization.state_dict()},
                                    ckpt.checkpoint_path(run_dir, progress.step))
    if context.is_main:
        removed = ckpt.prune_checkpoints(run_dir, config.keep_checkpoints)
        run.log.info("saved %s%s", path, f" (removed {len(removed)} older)" if removed else "")
    distributed.barrier(context)  # nobody resumes or exits before the file is whole


def restore(run: TrainingRun, found: Path) -> tuple[Path, Progress, list | None]:
    """Loads the newest checkpoint that matches its hash and loads (newer ones that do not are
    reported, moved aside by rank 0, and skipped) into the objective, the optimiser and the
    data source. Returns its path, the progress and the RNG states (set last, by
    `seed_or_restore_rng`); `found` is the checkpoint the run saw at its start."""
    objective, optimization, log = run.objective, run.optimization, run.log
    loaded = ckpt.load_latest_checkpoint(
        run.run_dir, required=_CHECKPOINT_KEYS, move_aside=run.context.is_main, log=log)
    if loaded is None:
        raise FileNotFoundError(f"{found} was removed while the run started")
    found, state = loaded
    _check_resumed_config(state["config"], run.config, log)
    if found.is_dir():
        sharded_checkpoint.load_weights(found, objective, optimization.optimizer)
        optimization.scheduler.load_state_dict(state["scheduler"])
        optimization.scaler.load_state_dict(state["scaler"])
    else:
        _load_file(found, state, objective, optimization)
    progress = Progress(**state["progress"])
    run.source.load_state_dict(data_states(state))
    log.info("resuming from %s at step %d", found, progress.step)
    return found, progress, state["rng"]


def _load_file(path: Path, state: dict[str, Any], objective: nn.Module,
               optimization: Optimization) -> None:
    missing = [key for key in _FILE_KEYS if key not in state]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {', '.join(map(repr, missing))}: not a "
                         "checkpoint of this trainer, or damaged")
    from vlm_vit.train.fsdp import is_sharded

    if is_sharded(objective):
        raise ValueError(f"checkpoint {path} was written by the 'ddp' strategy (one file of "
                         "whole tensors), which a sharded model does not resume from; resume "
                         "it with --strategy ddp, or start afresh with --overwrite")
    objective.load_state_dict(state["objective"])
    optimization.load_state_dict(state)


def data_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """A checkpoint's data-source states, one per rank.

    Fix-up for checkpoints of map-style datasets (folders) written before the data sources
    owned their state (issue 28): they have no "data" entry, and the position is the
    progress's (epoch, batch_index), the same on every rank. Shard streams always wrote theirs.
    """
    if "data" in state:
        return state["data"]
    progress = state["progress"]
    return [{"epoch": progress["epoch"], "batch_index": progress["batch_index"]}]


def seed_or_restore_rng(rng_states: list | None, config: TrainConfig, step: int,
                        context: DistributedContext, log: Any) -> None:
    """Each rank's RNGs from the checkpoint, or seeded (by seed and rank, and on a resume with
    another number of processes by the step too). Called last, so nothing before it (model
    building, DDP) shifts them."""
    if rng_states is not None and len(rng_states) == context.world_size:
        ckpt.set_rng_state(rng_states[context.rank])
        return
    if rng_states is not None:
        log.warning("checkpoint has RNG states for %d processes, this run has %d; "
                    "reseeding (the run continues, not bit-exactly)",
                    len(rng_states), context.world_size)
    ckpt.seed_everything(config.seed + context.rank if rng_states is None
                         else mixed_seed(config.seed, context.rank, step))


def _check_resumed_config(saved: dict[str, Any], config: TrainConfig, log: Any) -> None:
    current = config.to_dict()
    changed = {name: (saved.get(name), value) for name, value in current.items()
               if saved.get(name) != value and name not in HARMLESS_CHANGES}
    if changed:
        log.warning("resuming with a changed config (checkpoint -> now): %s; the run "
                    "will differ from an uninterrupted one",
                    ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
