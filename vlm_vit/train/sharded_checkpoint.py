"""Distributed checkpoints (`torch.distributed.checkpoint`, DCP), for the "fsdp" strategy:
every rank writes its own shards, and a resume reads them at any number of ranks.

    run_dir/checkpoints/step_00000004/
        .metadata, .metadata.sha256                 what is where (rank 0 writes it)
        __0_0.distcp, __0_0.distcp.sha256           rank 0's shards of the weights and moments
        __1_0.distcp, __1_0.distcp.sha256           rank 1's
        trainer.pt, trainer.pt.sha256               progress, schedule, RNG and data states

The weights and AdamW's moments are saved as the model holds them (sharded DTensors under
FSDP2, whole tensors otherwise) under "model.<name>" and "optim.<...>"; DCP maps them onto
whatever layout the loading run has, so a checkpoint written by 2 ranks resumes on 1, 3 or 8.
`trainer.pt` is an ordinary checkpoint (`vlm_vit.train.checkpoint.save_checkpoint`) of
the rest; `vlm_vit.train.checkpoint.load_checkpoint` reads it, after checking every file.

Every file has its sha256 beside it, written by the rank that wrote the file, and is checked
before anything is read. The directory is written under a temporary name and renamed by rank
0 once every rank's files and hashes are whole, so a kill at any moment leaves the previous
checkpoint the newest usable one. DCP's `.metadata` is a pickle: it is read with an unpickler
that accepts only DCP's own metadata classes, never code.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit.integrity import write_sidecar
from vlm_vit.train.checkpoint import DCP_METADATA as METADATA
from vlm_vit.train.checkpoint import TRAINER_STATE, save_checkpoint


def save(path: str | Path, objective: nn.Module, optimizer: torch.optim.Optimizer,
         trainer_state: dict[str, Any], rank: int, world_size: int) -> Path:
    """Writes a checkpoint directory; every rank calls it (it holds collectives).

    Args:
        path: the final directory (`step_XXXXXXXX`); replaced if it exists.
        objective: sharded or whole.
        optimizer: its state is saved by parameter name.
        trainer_state: tensors and plain containers for `trainer.pt` (written by rank 0).
        rank, world_size: this process's place.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    if rank == 0:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
    _barrier(world_size)
    state = {"model": objective.state_dict(),
             "optim": get_optimizer_state_dict(objective, optimizer)}
    with _one_process_meant():
        dcp.save(state, checkpoint_id=temporary, no_dist=world_size == 1)
    for written in sorted(temporary.glob(f"__{rank}_*.distcp")):
        write_sidecar(written)
    if rank == 0:
        write_sidecar(temporary / METADATA)
    _barrier(world_size)
    if rank == 0:
        save_checkpoint(trainer_state, temporary / TRAINER_STATE)
        if path.exists():
            shutil.rmtree(path)
        temporary.rename(path)
        _sync_directory(path.parent)
    _barrier(world_size)
    return path


def load_weights(path: str | Path, objective: nn.Module,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
    """Loads a checkpoint directory's weights (and optimiser state) into `objective`,
    sharded or whole, at this run's number of ranks; every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    state: dict[str, Any] = {"model": objective.state_dict()}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(objective, optimizer)
    with _one_process_meant():
        dcp.load(state, storage_reader=reader(path), no_dist=not _initialized())
    objective.load_state_dict(state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(objective, optimizer, state["optim"])


def tensor_shapes(path: str | Path, prefix: str = "model.") -> dict[str, tuple[torch.Size,
                                                                                torch.dtype]]:
    """Every saved tensor under `prefix` (its name without it): its whole shape and dtype."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = reader(path).read_metadata()
    return {name[len(prefix):]: (entry.size, entry.properties.dtype)
            for name, entry in metadata.state_dict_metadata.items()
            if name.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}


def load_tensors(path: str | Path, shapes: dict[str, tuple[torch.Size, torch.dtype]],
                 prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The whole tensors `shapes` names (as `tensor_shapes` gives them), read from a
    checkpoint directory by this process alone, and nothing else."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    state = {"model": {name: torch.empty(shape, dtype=dtype)
                       for name, (shape, dtype) in shapes.items()}}
    if prefix != "model.":
        raise ValueError(f"only the model's tensors can be read by name, not {prefix!r}")
    with _one_process_meant():
        dcp.load(state, storage_reader=reader(path), no_dist=True,
                 planner=DefaultLoadPlanner(allow_partial_load=True))
    return state["model"]


def reader(path: str | Path):
    """A DCP reader of `path` whose metadata unpickler accepts only DCP's metadata classes."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            rank = kwargs.get("rank")
            with open(Path(self.path) / (METADATA if rank is None else f"__{rank}{METADATA}"),
                      "rb") as handle:
                metadata = _MetadataUnpickler(handle).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _Reader(os.fspath(path))


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: its own classes, dtypes, sizes and paths; anything else (a
    function, a class of another module) is refused."""

    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path"),
                ("collections", "OrderedDict"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED or module == "torch.distributed.checkpoint.metadata":
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"distributed checkpoint metadata names {module}.{name}, "
                                     "which is not part of DCP's metadata; refusing to load it")


@contextlib.contextmanager
def _one_process_meant() -> Iterator[None]:
    """Holds back DCP's warning that it runs in one process: here that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def _sync_directory(directory: Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
