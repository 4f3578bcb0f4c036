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

Every file has its sha256 and name beside it, written by the rank that wrote the file;
`load_checkpoint` checks every file of the directory, whatever its name, before anything is
read. The directory is written under a temporary name and renamed by rank 0 once every
rank's files and hashes are whole, so a kill at any moment leaves the previous checkpoint the
newest usable one.

DCP's `.metadata` is a pickle. `_MetadataUnpickler` resolves only the names DCP's metadata is
made of (`_metadata_global`: the classes defined in DCP's metadata module, `_StorageInfo`,
dtypes, `torch.Size`, layouts by name, `PosixPath`) and refuses every other one (a function,
a module, another module's class, a dotted name) before importing or calling it: unpickling
builds DCP's dataclasses and runs nothing else. Every file the metadata names must be a plain
name of the checkpoint directory, a regular file, not a link (`read_metadata`).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import pickle
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit.io.integrity import SIDECAR_SUFFIX, plain_file, write_sidecar
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
    sharded or whole, at this run's number of ranks. Every rank calls it for a sharded
    objective; a whole one is read by the calling process alone, whatever process group
    exists.

    Raises:
        ValueError: metadata that is not DCP's (`UnsafeMetadataError`), names a file that is
            not one of the directory's own, or a file DCP fails to read, naming it.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    state: dict[str, Any] = {"model": objective.state_dict()}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(objective, optimizer)
    # A whole model (DDP's, or rank 0's copy after an FSDP2 run) is read by this process
    # alone: a collective here would wait for ranks that never call it, where the caller's
    # process group outlives the run.
    _load(path, state, no_dist=not (_initialized() and _holds_shards(objective)))
    objective.load_state_dict(state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(objective, optimizer, state["optim"])


def _holds_shards(module: nn.Module) -> bool:
    """Whether any of `module`'s parameters is a DTensor (FSDP2 sharded it)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in module.parameters())


def tensor_shapes(path: str | Path, prefix: str = "model.") -> dict[str, tuple[torch.Size,
                                                                                torch.dtype]]:
    """Every saved tensor under `prefix` (its name without it): its whole shape and dtype."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(path)
    return {name[len(prefix):]: (entry.size, entry.properties.dtype)
            for name, entry in metadata.state_dict_metadata.items()
            if name.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}


def load_tensors(path: str | Path, shapes: dict[str, tuple[torch.Size, torch.dtype]],
                 prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The whole tensors `shapes` names (as `tensor_shapes` gives them), read from a
    checkpoint directory by this process alone, and nothing else."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    state = {"model": {name: torch.empty(shape, dtype=dtype)
                       for name, (shape, dtype) in shapes.items()}}
    if prefix != "model.":
        raise ValueError(f"only the model's tensors can be read by name, not {prefix!r}")
    _load(path, state, no_dist=True, planner=DefaultLoadPlanner(allow_partial_load=True))
    return state["model"]


def _load(path: str | Path, state: dict[str, Any], **options: Any) -> None:
    """`dcp.load` of `state` from `path` through `reader`. DCP reports a failure to read as
    a `CheckpointException`, a BaseException that `except Exception` lets through: here it
    is a ValueError of one line naming the checkpoint, the file and why."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    storage = reader(path)
    try:
        with _one_process_meant():
            dcp.load(state, storage_reader=storage, **options)
    except CheckpointException as error:
        rank = min(error.failures)  # the first failing rank, and its exception
        cause = error.failures[rank][0]
        where = f"reading {storage.reading}" if storage.reading and rank == _rank() else \
            f"rank {rank} reading its files"
        reason = " ".join(f"{type(cause).__name__}: {cause}".split())
        raise ValueError(f"checkpoint {path}: {where} failed: {reason[:_REASON_CHARS]}; the "
                         "file is damaged, or from another checkpoint") from error


def reader(path: str | Path):
    """A DCP reader of `path` whose metadata, read at once, holds only DCP's metadata classes
    (`_MetadataUnpickler`) and names only plain files of `path`, none a link.

    Raises:
        ValueError: naming the metadata file and what it holds or names that is refused.
    """
    from torch.distributed.checkpoint import FileSystemReader

    metadata = read_metadata(path)

    class _Reader(FileSystemReader):
        reading: str | None = None  # the file read last, to name in an error

        def read_metadata(self, *args: Any, **kwargs: Any):
            # Only `.metadata`, read above: rank-local metadata (`__<rank>.metadata`, which
            # DCP looks for when the global one fails) is never written by `save`.
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def _slice_file(self, file, storage_info):  # DCP's own, called for every item read
            self.reading = storage_info.relative_path
            return super()._slice_file(file, storage_info)

    return _Reader(os.fspath(path))


def read_metadata(path: str | Path):
    """A checkpoint directory's DCP metadata (`Metadata`), read with `_MetadataUnpickler`,
    every storage file it names checked to be a plain file of the directory (`plain_file`),
    not a hash and not transformed (`save` writes none)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    file = plain_file(path, METADATA, f"checkpoint {path}")
    named_by = f"distributed checkpoint metadata {file}"
    with open(file, "rb") as handle:
        try:
            metadata = _MetadataUnpickler(handle, named_by).load()
        except UnsafeMetadataError:
            raise
        except Exception as error:  # damaged bytes surface as any parser's error
            raise ValueError(f"{named_by} is corrupt: {type(error).__name__}: "
                             f"{str(error)[:_REASON_CHARS]}") from error
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(metadata, Metadata) or not isinstance(storage, dict) or \
            not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError(f"{named_by} holds a {type(metadata).__name__} whose storage_data is "
                         f"a {type(storage).__name__}, not DCP's Metadata of a file system "
                         "checkpoint")
    names = set()
    for index, info in storage.items():
        if not isinstance(info, _StorageInfo) or info.transform_descriptors:
            raise ValueError(f"{named_by}: the storage entry of {str(index)[:200]} is "
                             f"{str(info)[:200]}, not a file's place (transforms: none)")
        names.add(info.relative_path)
    for name in sorted(names, key=str):
        if isinstance(name, str) and name.endswith(SIDECAR_SUFFIX):
            raise ValueError(f"{named_by} names the hash {name[:200]!r} as a storage file")
        plain_file(path, name, named_by)
    if not isinstance(metadata.storage_meta, StorageMeta):
        metadata.storage_meta = StorageMeta()
    return metadata


class UnsafeMetadataError(pickle.UnpicklingError, ValueError):
    """DCP metadata naming something that is not part of DCP's metadata (a function, a
    module, another module's class): refused before it is called."""


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_REASON_CHARS = 300  # an underlying error's message, bounded in ours


def _metadata_global(module: str, name: str) -> Any:
    """What DCP's metadata may name: the classes (dataclasses, enums) defined in DCP's
    metadata module, `_StorageInfo`, torch dtypes and `torch.Size`, the function that maps a
    layout's name to it, and `PosixPath` (`StorageMeta.checkpoint_id`). Listed from the
    metadata torch 2.14.1 writes (FSDP2 at two ranks and whole tensors, five dtypes). None for
    anything else, and for every dotted name (protocol 4 resolves `a.b` through `a`'s
    imports: `metadata` holds `os`)."""
    import torch.distributed.checkpoint.metadata as metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if not name.isidentifier():
        return None
    if module == _METADATA_MODULE:
        found = vars(metadata).get(name)
        return found if isinstance(found, type) and found.__module__ == module else None
    if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
        return vars(torch)[name]
    return {("torch", "Size"): torch.Size,
            # torch.layout pickles as `_get_layout("torch.strided")`: a lookup of layouts.
            ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
            ("pathlib", "PosixPath"): pathlib.PosixPath,
            ("pathlib._local", "PosixPath"): pathlib.PosixPath,  # as Python 3.13 pickles it
            }.get((module, name))


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: only what `_metadata_global` allows; anything else is refused
    before it is looked up, so nothing named is imported or called."""

    def __init__(self, file: Any, named_by: str) -> None:
        super().__init__(file)
        self.named_by = named_by

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_global(module, name)
        if found is None:
            raise UnsafeMetadataError(
                f"{self.named_by} names {module[:100]}.{name[:100]}, which is not part of "
                "DCP's metadata; refusing to load it")
        return found


@contextlib.contextmanager
def _one_process_meant() -> Iterator[None]:
    """Holds back DCP's warning that it runs in one process: here that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if _initialized() else 0


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
