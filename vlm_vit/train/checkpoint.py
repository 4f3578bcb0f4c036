"""Training checkpoints: written atomically, hashed, read without unpickling code.

A checkpoint is one `torch.save` file of tensors and plain containers (dicts, lists, ints,
floats, strings), so `torch.load(weights_only=True)` reads it. Files are written to a
temporary name in the same directory and renamed, so a kill at any moment leaves every
`step_*.pt` whole. Its sha256, taken as it is written, is written beside it (`sha256sum`'s
format, atomically too) before that rename, so the hash exists whenever the checkpoint does,
and loading checks it (`vlm_vit.io.integrity`; `verify=False` or `VLM_VIT_VERIFY=0` skips that).
A checkpoint without its sidecar is not one this module wrote whole: refused when verifying.

    run_dir/checkpoints/step_00000004.pt
    run_dir/checkpoints/step_00000004.pt.sha256

The "fsdp" strategy writes directories instead (`step_00000004/`, see
`vlm_vit.train.sharded_checkpoint`): every file in one has its sidecar (all checked on
load, whatever their names; none may be a link), and `trainer.pt` in it is a checkpoint of
the kind above holding all but the weights and optimiser moments.
Both kinds are listed, pruned and resumed from alike.

The newest usable checkpoint is the one to resume from (`load_latest_checkpoint`): a newer
one that fails its hash or cannot be read is reported, moved aside (`.corrupt`) and skipped.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import random
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlm_vit.io.files import atomic_write
from vlm_vit.io.integrity import (
    SIDECAR_SUFFIX,
    VERIFY_ENV,
    IntegrityError,
    plain_file,
    sidecar_path,
    verify_enabled,
    verify_sidecar,
    write_sidecar,
)

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
CORRUPT_SUFFIX = ".corrupt"  # an unusable checkpoint moved aside on resume
FORMAT_VERSION = 1  # bump when the layout of the saved dict changes
_NAME = re.compile(r"^step_(\d+)(\.pt)?$")  # a file, or a distributed checkpoint's directory
TRAINER_STATE = "trainer.pt"  # in a distributed checkpoint: all but the weights and moments
DCP_METADATA = ".metadata"  # in a distributed checkpoint: DCP's index of the shards


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """Where the checkpoint taken after `step` optimizer steps lives."""
    return Path(run_dir) / CHECKPOINT_DIR / f"step_{step:08d}.pt"


def sharded_checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """Where the distributed checkpoint (a directory) taken after `step` steps lives."""
    return Path(run_dir) / CHECKPOINT_DIR / f"step_{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Every complete checkpoint in `run_dir` as (step, path), oldest first: files, and
    distributed checkpoints' directories."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)  # temporaries start with "." and end in ".tmp"
        if match and (path.is_file() if match.group(2) else path.is_dir()):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path, *, usable: bool = False) -> Path | None:
    """The newest complete checkpoint in `run_dir`, or None when there is none.

    Args:
        run_dir: the run directory.
        usable: return the newest one that loads and matches its hash instead (reading
            each, newest first; those skipped are logged at WARNING level, and nothing is
            moved); a ValueError when there are checkpoints but none is usable.
    """
    if usable:
        loaded = load_latest_checkpoint(run_dir)
        return loaded[0] if loaded else None
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def load_latest_checkpoint(
    run_dir: str | Path, *, verify: bool | None = None, required: tuple[str, ...] = (),
    move_aside: bool = False, log: Any = logger,
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that matches its hash and loads, and its state.

    Newer ones that fail (a hash mismatch, an unreadable file, a missing `required` key)
    are reported at WARNING level, naming each and why; the previous one is tried next.

    Args:
        run_dir: the run directory.
        verify: as in `load_checkpoint`.
        required: keys the state must hold.
        move_aside: rename the unusable checkpoints newer than the one used to
            `<name>.corrupt` (with their sidecars), so they are neither resumed from again
            nor counted as the newest when older checkpoints are pruned.
        log: where the warnings go.

    Returns:
        (path, state), or None when `run_dir` holds no checkpoint.

    Raises:
        ValueError: when there are checkpoints but none is usable, naming each and why.
    """
    found = list_checkpoints(run_dir)
    failed: list[tuple[Path, str]] = []
    for _, path in reversed(found):
        try:
            state = load_checkpoint(path, verify=verify)
            missing = [key for key in required if key not in state]
            if missing:
                raise ValueError(f"checkpoint {path} lacks {', '.join(map(repr, missing))}: "
                                 f"not a checkpoint of this trainer, or damaged")
        except (ValueError, OSError) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            if str(path) not in reason:
                reason = f"checkpoint {path} is unusable: {reason}"
            log.warning("%s; trying the previous checkpoint", reason)
            failed.append((path, reason))
            continue
        if failed:
            moved = [_move_aside(bad) for bad, _ in failed] if move_aside else []
            log.warning("resuming from %s instead of the newest checkpoint%s, which %s "
                        "unusable%s", path, "s" if len(failed) > 1 else "",
                        "are" if len(failed) > 1 else "is",
                        f" (moved aside to {', '.join(str(m) for m in moved)})" if moved else "")
        return path, state
    if failed:
        directory = Path(run_dir) / CHECKPOINT_DIR
        reasons = "; ".join(f"{path.name}: {reason}" for path, reason in failed)
        raise ValueError(f"none of the {len(failed)} checkpoints in {directory} is usable "
                         f"({reasons}); pass --overwrite (overwrite=True) to start afresh, "
                         f"or use another run directory")
    return None


def _move_aside(path: Path) -> Path:
    """Renames an unusable checkpoint (and its sidecar) to `<name>.corrupt`, or
    `<name>.corrupt.N` when an earlier one was moved aside under that name."""
    suffix, number = CORRUPT_SUFFIX, 1
    while path.with_name(path.name + suffix).exists():
        suffix, number = f"{CORRUPT_SUFFIX}.{number}", number + 1
    aside = path.with_name(path.name + suffix)
    try:
        path.replace(aside)
        sidecar = sidecar_path(path)
        if sidecar.is_file():
            sidecar.replace(sidecar_path(aside))
    except FileNotFoundError:  # another process moved it first
        pass
    return aside


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Writes `state` to `path` through a temporary file and a rename.

    Args:
        state: tensors and plain containers only (see the module docstring).
        path: the final name; its directory is created if needed.

    Returns:
        The path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sidecar_path(path).unlink(missing_ok=True)  # never a stale hash beside a new file
    with atomic_write(path, "wb") as handle:
        hashing = _HashingWriter(handle)
        torch.save({"format_version": FORMAT_VERSION, **state}, hashing)
        # Before the rename: a kill between the two leaves a hash without its checkpoint
        # (harmless), never a checkpoint without its hash.
        write_sidecar(path, hashing.digest.hexdigest())
    return path


class _HashingWriter:
    """A binary file that hashes what is written through it (torch.save writes in order)."""

    def __init__(self, file) -> None:
        self.file, self.digest = file, hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def load_checkpoint(path: str | Path, verify: bool | None = None) -> dict[str, Any]:
    """Reads a checkpoint written by `save_checkpoint`, onto the CPU.

    Args:
        path: the checkpoint.
        verify: check it against its `.sha256` sidecar first, where there is one (default:
            on, unless the environment sets `VLM_VIT_VERIFY=0`).

    Raises:
        FileNotFoundError: when `path` is missing.
        ValueError: naming the file when it is corrupt (`vlm_vit.io.integrity.IntegrityError`
            when it fails its hash or has none), holds code to unpickle, or has another
            format version.
    """
    path = Path(path)
    if path.is_dir():
        return _load_directory(path, verify)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist or is not a file")
    if verify_enabled(verify) and not sidecar_path(path).is_file():
        raise IntegrityError(
            f"checkpoint {path} has no {sidecar_path(path).name}: it was not written whole by "
            f"this trainer (or its hash was deleted), so its content cannot be trusted; pass "
            f"verify=False (or set {VERIFY_ENV}=0) to load it unchecked")
    verify_sidecar(path, verify)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(f"checkpoint {path} holds objects other than tensors and plain "
                         f"containers: {str(error).splitlines()[0]}") from error
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as error:
        raise ValueError(f"checkpoint {path} is truncated or corrupt: {error}") from error
    except Exception as error:  # damaged bytes surface as any parser error (UnicodeDecodeError...)
        raise ValueError(f"checkpoint {path} is corrupt: {type(error).__name__}: "
                         f"{str(error)[:200]}") from error
    version = state.get("format_version") if isinstance(state, dict) else None
    if version != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format_version {version!r}, expected "
                         f"{FORMAT_VERSION}")
    return state


def _load_directory(path: Path, verify: bool | None) -> dict[str, Any]:
    """A distributed checkpoint's `trainer.pt`, after checking every file in the directory
    against its hash (the weights are read later, into the model, by DCP, whose reader
    refuses any file its metadata names that is not one of this directory's plain files).

    Every file, whatever its name: DCP reads whichever files `.metadata` names, so a file
    left unhashed would be one the metadata could point at. Its sidecar must record its
    own name too, so files swapped together with their sidecars are refused.
    """
    if path.is_symlink():
        raise ValueError(f"checkpoint {path} is a symbolic link: a run's checkpoints must be "
                         "its own, not links to elsewhere; refusing it")
    if not (path / DCP_METADATA).is_file() or not (path / TRAINER_STATE).is_file():
        raise ValueError(f"checkpoint {path} lacks {DCP_METADATA} or {TRAINER_STATE}: not a "
                         "whole distributed checkpoint")
    for name in (DCP_METADATA, TRAINER_STATE):
        plain_file(path, name, f"checkpoint {path}")
    if verify_enabled(verify):
        for file in sorted(path.iterdir()):
            if file.name.endswith(SIDECAR_SUFFIX) and file.with_suffix("").exists():
                continue  # a hash, checked with its file
            plain_file(path, file.name, f"checkpoint {path}")
            if not sidecar_path(file).is_file():
                raise IntegrityError(f"checkpoint file {file} has no {sidecar_path(file).name}"
                                     ": it was not written whole by this trainer")
            verify_sidecar(file, True)
    return load_checkpoint(path / TRAINER_STATE, verify)


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[Path]:
    """Deletes all but the newest `keep` checkpoints (none when `keep` is 0).

    Returns:
        The deleted paths.
    """
    found = list_checkpoints(run_dir)
    doomed = [path for _, path in found[:-keep]] if keep > 0 else []
    for path in doomed:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            continue
        path.unlink(missing_ok=True)
        sidecar_path(path).unlink(missing_ok=True)
    return doomed


def remove_stale_temporaries(run_dir: str | Path) -> list[Path]:
    """Deletes temporaries a killed process left (a kill -9 skips `atomic_write`'s cleanup),
    and hashes whose checkpoint a kill kept from being renamed into place.

    Returns:
        The deleted paths.
    """
    directory = Path(run_dir) / CHECKPOINT_DIR
    stale = sorted(directory.glob(".step_*.tmp")) if directory.is_dir() else []
    stale += [sidecar for sidecar in sorted(directory.glob("step_*.pt.sha256"))
              if not sidecar.with_suffix("").exists()]
    for path in stale:
        if path.is_dir():  # a distributed checkpoint's unfinished directory
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if stale:
        logger.info("removed %d unfinished checkpoint file(s) in %s", len(stale), directory)
    return stale


# -- random number generators ---------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Every random number generator's state, as tensors and plain values.

    Covers Python's `random`, numpy's global generator, torch's CPU generator and, when
    CUDA is initialised, every CUDA device's generator.
    """
    version, keys, gauss = random.getstate()
    name, np_keys, position, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "keys": torch.tensor(keys, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(np_keys.astype(np.int64)),
                  "position": int(position), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores what `rng_state` returned.

    A CUDA state is restored when the device count matches; otherwise it is skipped with a
    warning (the run continues, but not bit-exactly).
    """
    python = state["python"]
    random.setstate((python["version"], tuple(int(k) for k in python["keys"].tolist()),
                     python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["name"], numpy["keys"].numpy().astype(np.uint32),
                         numpy["position"], numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            logger.warning("checkpoint has CUDA RNG states for %d devices, this machine has "
                           "%d; not restoring them", len(cuda), torch.cuda.device_count())


def seed_everything(seed: int) -> None:
    """Seeds Python's `random`, numpy's global generator and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
