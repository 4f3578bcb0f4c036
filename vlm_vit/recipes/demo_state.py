"""The demo's run folder: what it was run with (`demo.json`), whether a rerun may use it, and
each fine-tuning run's accuracy as it finishes, so `vlm-vit demo --resume` continues a demo
that was stopped (pretraining from its newest checkpoint, fine-tuning with the runs not yet
recorded) and a rerun without `--resume` never deletes an earlier one."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

# The demo's arms: fine-tuning from random initialisation, and after each pretraining
# objective. Here, not in `demo.py`, so `vlm-vit demo --help` needs no torch.
ARMS = ("scratch", "mpp", "mae", "ibot", "ijepa", "capi")
# The demo's schedule (see docs/demo.md); `--quick`'s. The default takes about 8 minutes on
# two CPU cores (docs/install.md).
DEFAULTS = {"arms": ("scratch", "mae"), "steps": 800, "layer_decay": 1.0, "seeds": 3}
QUICK = {"steps": 400, "seeds": 1}
# `--sweep`: the fine-tuning trials every arm gets alike, each scored at SWEEP_LABELS labels
# per class of the labelled pool on the validation split (never the held-out half).
SWEEP_GRID = {"lr": (3e-4, 1e-3, 3e-3), "steps": (250, 1000)}
SWEEP_LABELS = 10
# Each arm's fine-tuning recipe as `vlm-vit demo --arms all --sweep` chose it at the default
# settings (docs/demo.md): what a run without --sweep uses.
RECIPES = {"scratch": {"lr": 3e-4, "steps": 1000}, "mpp": {"lr": 1e-3, "steps": 1000},
           "mae": {"lr": 3e-3, "steps": 1000}, "ibot": {"lr": 3e-3, "steps": 1000},
           "ijepa": {"lr": 3e-3, "steps": 1000}, "capi": {"lr": 3e-3, "steps": 1000}}

STATE_NAME = "demo.json"
# What an earlier demo leaves in its folder besides the cached digits (`data/`,
# `pretrain_images/`): removed by --overwrite, and proof of a run where demo.json is missing.
RUN_ENTRIES = ("runs", "encoders", "report.json", "loss.png", "label_efficiency.png",
               "run", "encoder")  # the last two: where earlier demos wrote theirs
# The arguments that change a demo's numbers: a resume must keep every one.
SETTINGS = ("arms", "sweep", "batch_size", "width", "depth", "patch_size", "layer_decay", "labels",
            "shots", "eval_on", "images_per_class", "seed")


@dataclass
class DemoData:
    """The digits and their splits (row indices into `files`), as `demo_splits` gives them;
    `scored` is `test` or `validation` (--eval-on)."""

    files: list[Path]
    labels: np.ndarray
    classes: list[str]
    train: np.ndarray
    pool: np.ndarray
    validation: np.ndarray
    test: np.ndarray
    scored: np.ndarray
    fewest: int  # images of the pool's smallest class: what "all" labels per class means


def settings(args: argparse.Namespace, schedule: dict) -> dict[str, Any]:
    """The demo's settings: those arguments and the schedule (the preset's or the flags')."""
    chosen = {name: getattr(args, name) for name in SETTINGS if name != "arms"}
    chosen.update({name: schedule[name] for name in ("arms", "steps", "seeds", "recipes")})
    return chosen


def open_run(out: Path, chosen: dict[str, Any], command: str, *, resume: bool,
             overwrite: bool) -> dict[str, float]:
    """Checks `out` for this demo and records it there; returns the fine-tuning accuracies
    already recorded (empty unless resuming).

    Raises:
        ValueError: `out` holds a demo run and neither `resume` nor `overwrite` says what to
            do with it, or `resume` with settings other than the run's (naming them).
    """
    from vlm_vit.io.files import read_json

    if resume and overwrite:
        raise ValueError("--resume continues a demo and --overwrite starts afresh: pass one")
    state = out / STATE_NAME
    recorded = read_json(state) if state.is_file() else None
    earlier = recorded is not None or any((out / name).exists() for name in RUN_ENTRIES)
    if earlier and not (resume or overwrite):
        what = f" ({recorded['command']})" if recorded and recorded.get("command") else ""
        raise ValueError(f"--out {out} holds a demo run{what}: continue it with --resume, "
                         "start afresh with --overwrite, or choose another --out")
    if resume and recorded is None and earlier:
        raise ValueError(f"--resume: {out} holds demo outputs but no {STATE_NAME} to resume "
                         "from; start afresh with --overwrite")
    results: dict[str, float] = {}
    if resume and recorded is not None:
        changed = sorted(name for name in chosen
                         if recorded.get("settings", {}).get(name) != _plain(chosen[name]))
        if changed:
            raise ValueError(f"--resume: {out} was run with other settings ("
                             + ", ".join(f"{name} {recorded['settings'].get(name)!r} -> "
                                         f"{chosen[name]!r}" for name in changed[:6])
                             + "); rerun with them, or start afresh with --overwrite")
        results = {str(key): float(value)
                   for key, value in recorded.get("finetune_accuracy", {}).items()}
    elif resume:
        logger.warning("--resume: no demo run in %s; starting a fresh one", out)
    if overwrite:
        for name in RUN_ENTRIES:
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
    _write(out, {"command": command, "settings": _plain(chosen),
                 "finetune_accuracy": results})
    return results


def record(out: Path, key: str, accuracy: float) -> None:
    """Adds one finished fine-tuning run's accuracy to `demo.json`."""
    from vlm_vit.io.files import read_json

    state = read_json(out / STATE_NAME)
    state.setdefault("finetune_accuracy", {})[key] = accuracy
    _write(out, state)


def job_key(labels: str, arm: str, seed: int) -> str:
    return f"{labels}/{arm}/{seed}"


def trial_key(arm: str, lr: float, steps: int) -> str:
    """A `--sweep` trial's key in `demo.json`."""
    return f"sweep/{arm}/{lr:g}/{steps}"


def _write(out: Path, state: dict) -> None:
    from vlm_vit.io.files import atomic_write

    out.mkdir(parents=True, exist_ok=True)
    with atomic_write(out / STATE_NAME, "w") as handle:
        json.dump(state, handle, indent=2)


def _plain(value: Any) -> Any:
    """As JSON gives it back (tuples as lists)."""
    return json.loads(json.dumps(value))
