"""Sharded safetensors checkpoints (`model.safetensors.index.json`), read and written.

The layout is transformers': shards `model-00001-of-00003.safetensors`, ... and an index
`{"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file}}`. Reading goes
shard by shard, keeping each shard's tensors (the model's own, not a copy), so the peak is
the model plus the shard being parsed. A shard is named by a plain relative path inside the
checkpoint's directory: an index that names `../x`, `/x`, a link out of the directory or
anything but a `.safetensors` file is refused, never followed. A directory with a manifest
(`vlm_vit.io.integrity`) has its shards checked against it before they are read.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path, PurePosixPath

import torch

from vlm_vit.io.files import (
    atomic_write,
    read_json,
    resolves_inside,
    write_safetensors,
)
from vlm_vit.io.integrity import verify_files
from vlm_vit.io.tensor_files import read_safetensors

WEIGHTS_NAME = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # as transformers
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "5GB" (10**9), "500MB" or "2GiB" (2**30).

    Raises:
        ValueError: for anything else, or a size below one byte.
    """
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", str(size), re.IGNORECASE)
        if match is None or match.group(2).upper() not in _UNITS:
            raise ValueError(f"shard size {size!r} is not a size like 5GB, 500MB or 2GiB")
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value < 1:
        raise ValueError(f"shard size {size!r} must be at least one byte")
    return value


def allowed_roots(directory: Path) -> list[Path]:
    """Where a shard may resolve to: the directory, and for a Hugging Face cache snapshot
    (`models--org--name/snapshots/<commit>/`, whose files are links into `../../blobs/`)
    that repository's `blobs/` too."""
    root = directory.resolve()
    roots = [root]
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        roots.append((root.parent.parent / "blobs").resolve())
    return roots


def shard_path(directory: Path, name: object, index: Path, tensor: str | None = None) -> Path:
    """`directory / name` for a shard the index names, refusing names that leave it.

    A shard must be a relative `.safetensors` path that stays inside `directory` after
    symbolic links are followed (a Hub snapshot's links into its `blobs/` are allowed).

    Raises:
        ValueError: naming the index, the entry and what is wrong.
    """
    entry = f"weight_map entry {tensor!r} -> {name!r}" if tensor is not None \
        else f"shard {name!r}"
    if not isinstance(name, str) or not name:
        raise ValueError(f"{index}: {entry}: a shard name must be a file name (a string)")
    pure = PurePosixPath(name.replace("\\", "/"))
    if pure.is_absolute() or ".." in pure.parts or re.match(r"^[A-Za-z]:", name):
        raise ValueError(f"{index}: {entry} is outside {directory}; refused")
    if pure.suffix != ".safetensors":
        raise ValueError(f"{index}: {entry} is not a .safetensors file; a shard index names "
                         f"only safetensors shards")
    path = directory / pure
    if not resolves_inside(path, *allowed_roots(directory)):
        raise ValueError(f"{index}: {entry} is a link to {os.path.realpath(path)}, outside "
                         f"{directory}; refused")
    return path


def read_index(directory: str | Path) -> dict[str, list[str]]:
    """A shard index's tensors by shard, every entry checked (`shard_path`).

    The index must be `{"weight_map": {tensor name: shard file}}` (strings to strings;
    `metadata` and other keys are ignored).

    Raises:
        ValueError: naming the index and the entry for anything else.
    """
    directory = Path(directory)
    index = directory / SHARD_INDEX
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: weight_map must be a non-empty object of tensor names "
                         f"to shard file names, got {type(weight_map).__name__} "
                         f"{str(weight_map)[:60]}")
    by_shard: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        shard_path(directory, shard, index, tensor)
        by_shard.setdefault(shard, []).append(tensor)
    return by_shard


def read_sharded(directory: str | Path, verify: bool | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded safetensors checkpoint, read shard by shard.

    Args:
        directory: holds the index and its shards.
        verify: check the shards against the directory's manifest, when it has one (see
            `vlm_vit.io.integrity`; default: on unless `VLM_VIT_VERIFY=0`).

    Raises:
        ValueError: for a malformed index, a shard outside the directory, a shard that does
            not match its manifest hash, or a tensor the index names but its shard lacks,
            each naming the file.
        FileNotFoundError: for a missing shard.
    """
    directory = Path(directory)
    index = directory / SHARD_INDEX
    by_shard = read_index(directory)
    paths = {shard: shard_path(directory, shard, index) for shard in by_shard}
    for shard, path in paths.items():
        if not path.is_file():
            raise FileNotFoundError(f"{index} names the shard {shard!r}, but {path} does not "
                                    f"exist")
    verify_files(directory, paths.values(), verify)  # a wrong index fails below, never silently
    tensors: dict[str, torch.Tensor] = {}
    for shard, names in sorted(by_shard.items()):
        read = read_safetensors(paths[shard])
        missing = sorted(set(names) - read.keys())
        if missing:
            raise ValueError(f"{index} maps {len(missing)} tensor(s) to {shard}, which does "
                             f"not hold them: {', '.join(missing[:5])}")
        tensors.update((name, read[name]) for name in names)
        del read  # tensors of the shard the map does not name are dropped here
    return tensors


def read_weights(directory: str | Path, verify: bool | None = None) -> dict[str, torch.Tensor]:
    """`model.safetensors`, or the shards its index names, from a directory, checked against
    the directory's manifest when it has one (`verify` as in `read_sharded`)."""
    directory = Path(directory)
    if (directory / SHARD_INDEX).is_file():
        return read_sharded(directory, verify)
    weights = directory / WEIGHTS_NAME
    if weights.is_file():
        verify_files(directory, [weights], verify)
    return read_safetensors(weights)


def write_weights(tensors: dict[str, torch.Tensor], directory: str | Path,
                  max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                  metadata: dict[str, str] | None = None) -> list[Path]:
    """Writes `model.safetensors`, or shards and their index when the tensors are larger
    than `max_shard_size`, each file atomically; removes the other layout's stale files.

    Sharding is `huggingface_hub.split_torch_state_dict_into_shards`, as transformers does.

    Returns:
        The weight files written.
    """
    directory = Path(directory)
    limit = parse_size(max_shard_size)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if total <= limit:
        write_safetensors(tensors, directory / WEIGHTS_NAME, metadata)
        _remove_stale(directory, keep=set())  # after: a crash leaves a readable layout
        return [directory / WEIGHTS_NAME]
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(
        tensors, filename_pattern="model{suffix}.safetensors", max_shard_size=limit)
    written = []
    for filename, names in split.filename_to_tensors.items():
        write_safetensors({name: tensors[name] for name in names}, directory / filename,
                          metadata)
        written.append(directory / filename)
    write_index(directory, split.tensor_to_filename, total)
    _remove_stale(directory, keep={path.name for path in written})
    return written


def shard_file_name(number: int, count: int) -> str:
    """The name of shard `number` (1-based) of `count`, as transformers names them."""
    return f"model-{number:05d}-of-{count:05d}.safetensors"


def write_index(directory: str | Path, weight_map: dict[str, str], total_size: int) -> Path:
    """Writes the shards' index (`model.safetensors.index.json`): which file holds each
    tensor, and their total bytes."""
    path = Path(directory) / SHARD_INDEX
    with atomic_write(path, "w") as handle:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, handle,
                  indent=2, sort_keys=True)
    return path


def _remove_stale(directory: Path, keep: set[str]) -> None:
    stale = [directory / WEIGHTS_NAME] if keep else [directory / SHARD_INDEX]
    stale += [p for p in directory.glob("model-*-of-*.safetensors")
              if _SHARD_FILE.match(p.name) and p.name not in keep]
    for path in stale:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
