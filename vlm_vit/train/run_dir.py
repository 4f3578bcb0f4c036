"""The run directory: what a run writes there, the checks before it starts (one run per
directory is `run_lock.py`), run_config.json and the final export."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import vlm_vit.train.checkpoint as ckpt
import vlm_vit.train.distributed as distributed
from vlm_vit.io.files import atomic_write, read_json
from vlm_vit.io.native import save_native
from vlm_vit.train.distributed import DistributedContext
from vlm_vit.train.metrics import METRICS_NAME, SAMPLES_DIR, TENSORBOARD_DIR

RUN_CONFIG_NAME = "run_config.json"
OBJECTIVE_NAME = "objective.pt"
ENCODER_DIR = "encoder"
ADAPTER_DIR = "adapter"  # a LoRA run saves its adapter here instead of the encoder
MODEL_DIR = "model"  # where an objective's own `export` writes (the LLM bridge's whole model)
# What a run writes into its directory: a fresh run refuses to start over any of these, and
# --overwrite removes exactly these (the caller's own files, such as finetune.json, stay).
RUN_OUTPUTS = (ckpt.CHECKPOINT_DIR, METRICS_NAME, RUN_CONFIG_NAME, ENCODER_DIR, TENSORBOARD_DIR,
               SAMPLES_DIR, OBJECTIVE_NAME, ADAPTER_DIR, MODEL_DIR)


def short_listing(names: list[str], most: int = 4) -> str:
    """The first `most` names joined by commas, and how many more there are."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most
                                      else "")


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool,
                  changes: Callable[[bool], list[str] | None]) -> None:
    """Refuses, without writing anything, a `run_dir` that a run with `resume` and
    `overwrite` must not start in (see `Trainer.check_run_dir`).

    Args:
        run_dir, resume, overwrite: as in `Trainer.fit`.
        changes: `changes(whole_run)` says how the run `run_config.json` records differs
            from this one (see `recorded_changes`).
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise NotADirectoryError(f"{run_dir} is a file, not a run directory; give "
                                 "--out (run_dir) a folder")
    if overwrite:
        return
    entries = [name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    found = ckpt.latest_checkpoint(run_dir)
    if found is not None and not resume:
        raise FileExistsError(f"{run_dir} already holds checkpoints (newest {found}); "
                              "pass --resume (resume=True) to continue that run, "
                              "--overwrite to replace it, or use another run directory")
    recorded = run_dir / RUN_CONFIG_NAME
    if found is None and entries:
        # A requeue of this run killed before its first checkpoint starts it afresh.
        changed = changes(True) if resume else None
        if changed == []:
            return
        what = (f"holds an earlier run's {short_listing(entries)}" if not resume else
                f"has no checkpoint to resume from, but holds an earlier run's "
                f"{short_listing(entries)}" + (f", of another run ({recorded.name} -> now: "
                                          f"{'; '.join(changed)})" if changed else ""))
        raise FileExistsError(f"{run_dir} {what}; pass --overwrite (overwrite=True) "
                              f"to start afresh there, or use another run directory")
    changed = changes(False) if found is not None else None
    if changed:
        raise ValueError(f"{run_dir} was trained with another model than this run's "
                         f"({recorded.name} -> now): {'; '.join(changed)}; resume with the "
                         f"same model and settings, or start afresh with --overwrite")


def recorded_changes(run_dir: Path, now: dict[str, Any]) -> list[str] | None:
    """How the run `run_config.json` records differs from `now` (None without one), part by
    part; a field only one side has (one library version's) is no difference."""
    recorded = run_dir / RUN_CONFIG_NAME
    if not recorded.is_file():
        return None
    saved = read_json(recorded)
    now = json.loads(json.dumps(now, default=str))  # as recorded
    changed = []
    for part, settings in now.items():
        before = saved.get(part)
        if not (isinstance(before, dict) and isinstance(settings, dict)):
            continue
        changed += [f"{part} {key} {before[key]!r} -> {value!r}"
                    for key, value in settings.items()
                    if key in before and before[key] != value]
    return changed


def prepare_run_dir(run_dir: Path, resume: bool, overwrite: bool,
                    context: DistributedContext, log: Any) -> tuple[Path | None, list[str]]:
    """Clears what `check_run_dir` let a fresh start replace (with `overwrite`, or a resume
    without a checkpoint past this run's own outputs), creates the directory and removes
    stale temporaries; every rank waits. Returns the newest checkpoint to resume (None for
    a fresh start) and the names removed."""
    entries = [name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    found = ckpt.latest_checkpoint(run_dir)  # `check_run_dir` accepted what is here
    restart = resume and found is None and bool(entries)
    removed: list[str] = []
    if (overwrite or restart) and entries:
        if context.is_main:
            if overwrite:
                log.warning("--overwrite: removing %s from %s", short_listing(entries), run_dir)
            for path in (run_dir / name for name in entries):
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() \
                    else path.unlink()
        distributed.barrier(context)
        found, removed = None, entries
    if context.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.remove_stale_temporaries(run_dir)
    distributed.barrier(context)  # the directory exists and no rank sees stale temporaries
    return found, (removed if restart else [])


def described_model(objective: nn.Module) -> dict[str, Any]:
    """The objective and encoder settings run_config.json records (a resume must match)."""
    encoder_config = getattr(objective.encoder, "config", None)
    objective_config = getattr(objective, "config", None)
    kind = _unsharded_class(objective)
    return {
        "objective": {
            "type": f"{kind.__module__}.{kind.__qualname__}",
            **({"config": dataclasses.asdict(objective_config)}
               if dataclasses.is_dataclass(objective_config) else {}),
        },
        "encoder": encoder_config.to_dict() if hasattr(encoder_config, "to_dict") else None,
    }


def _unsharded_class(module: nn.Module) -> type:
    """The module's own class: FSDP2 swaps a sharded module's class for a subclass it makes
    (`FSDPToyObjective` of `ToyObjective`)."""
    kind = type(module)
    if kind.__module__.startswith("torch.distributed.fsdp"):
        return next(base for base in kind.__mro__[1:]
                    if not base.__module__.startswith("torch.distributed.fsdp"))
    return kind


def write_run_config(run_dir: Path, run_config: dict[str, Any]) -> None:
    """run_config.json, with the library's and torch's versions added."""
    from vlm_vit import __version__

    run_config = {**run_config,
                  "versions": {"vlm_vit": __version__, "torch": torch.__version__}}
    with atomic_write(run_dir / RUN_CONFIG_NAME, "w") as handle:
        json.dump(run_config, handle, indent=2, default=str)
        handle.write("\n")


def plain_encoder_objective(objective: nn.Module) -> bool:
    """Whether the objective writes only what its `encoder` (a VisionEncoder registered as
    `encoder`) holds besides `objective.pt`: no own `export`, no LoRA adapter. Such an
    objective trained sharded is exported by consolidating its final checkpoint."""
    from vlm_vit.model import VisionEncoder

    encoder = getattr(objective, "encoder", None)
    return (not callable(getattr(objective, "export", None))
            and not hasattr(objective, "peft_config") and isinstance(encoder, VisionEncoder)
            and dict(objective.named_children()).get("encoder") is encoder)


def export(objective: nn.Module, run_dir: Path, log: Any,
           state: dict[str, Any] | None = None) -> None:
    """The final objective state dict and the encoder in the native format, or what the
    objective's own `export(run_dir)` writes.

    Args:
        state: the objective's whole state dict when the live module is sharded (FSDP2
            gathers it onto this rank); the module's own `state_dict()` otherwise. An own
            `export` then receives it as `export(run_dir, state_dict=state)`.
    """
    own = getattr(objective, "export", None)
    if callable(own):
        log.info("saved %s", own(run_dir) if state is None else own(run_dir, state_dict=state))
        return
    gathered, state = state is not None, objective.state_dict() if state is None else state
    with atomic_write(run_dir / OBJECTIVE_NAME, "wb") as handle:
        torch.save(state, handle)
    if hasattr(objective, "peft_config"):  # LoRA: the adapter, in peft's format
        objective.save_pretrained(run_dir / ADAPTER_DIR, state_dict=state)
        log.info("saved the adapter to %s (merge with vlm-vit merge)", run_dir / ADAPTER_DIR)
        return
    encoder = objective.encoder
    if gathered and hasattr(encoder, "save_pretrained") and hasattr(encoder, "config"):
        # The live encoder is sharded: its weights are the gathered state's.
        prefix = next(name for name, module in objective.named_modules()
                      if module is encoder) + "."
        save_native(run_dir / ENCODER_DIR, encoder.config,
                    {name[len(prefix):]: tensor for name, tensor in state.items()
                     if name.startswith(prefix)})
        log.info("saved the encoder to %s", run_dir / ENCODER_DIR)
    elif hasattr(encoder, "save_pretrained"):
        encoder.save_pretrained(run_dir / ENCODER_DIR)
        log.info("saved the encoder to %s", run_dir / ENCODER_DIR)
    else:
        log.warning("%s has no save_pretrained; only %s was written",
                    type(encoder).__name__, run_dir / OBJECTIVE_NAME)
