"""Safe, loud file helpers: atomic writes, and readers that name the file in every error.

Nothing here unpickles: weights are read with safetensors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

logger = logging.getLogger(__name__)

# File suffixes read as images when a folder is searched.
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp",
                            ".ppm", ".pgm", ".pbm"})


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """Opens a temporary file beside `path` and moves it onto `path` only on success.

    A crash half-way leaves the old file (or none), never a truncated one.
    """
    path = Path(path)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, mode) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yields a temporary folder beside `path` to fill; on success it replaces `path`.

    A crash half-way leaves the old folder (or none), never a half-written one. An existing
    folder is moved aside first and removed only once the new one is in place.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield temp
        os.chmod(temp, 0o777 & ~_umask())  # mkdtemp makes 0700; give the usual permissions
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.{os.getpid()}.old")
            os.replace(path, old)
        os.replace(temp, path)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def read_json(path: str | Path) -> dict[str, Any]:
    """Reads a JSON object, naming `path` when it is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist or is not a file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Reads every tensor of a safetensors file, naming `path` when it is missing or broken."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist or is not a file")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{path} is not a readable safetensors file: {error}") from error


def write_safetensors(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Writes tensors to a safetensors file atomically."""
    from safetensors.torch import save

    tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    data = save(tensors, metadata={"format": "pt", **(metadata or {})})
    with atomic_write(path, "wb") as handle:
        handle.write(data)


def image_files(folder: str | Path) -> list[Path]:
    """Every image file under `folder`, recursively, sorted; hidden entries (`.x`, such as
    macOS's `._photo.jpg`) are skipped. Empty when there is none."""
    folder = Path(folder)
    return sorted(
        p for p in folder.rglob("*")
        if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def class_folders(root: str | Path) -> tuple[list[Path], list[int], list[str]]:
    """The images of a folder with one sub-folder per class (searched recursively).

    Hidden entries are skipped; files directly in `root` are ignored (a warning says so).

    Returns:
        The image files (by class, then path), their class indices, and the sorted class
        names.

    Raises:
        FileNotFoundError, NotADirectoryError: for a missing `root` or a file.
        ValueError: for fewer than 2 class folders, or a class folder without images.
    """
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"data folder {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"data folder {root} is not a folder")
    entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    loose = [p for p in entries if p.is_file()]
    if loose:
        logger.warning("ignoring %d files directly in %s: images must sit in one folder per "
                       "class", len(loose), root)
    classes = [p.name for p in entries if p.is_dir()]
    if len(classes) < 2:
        raise ValueError(f"data folder {root} needs one sub-folder per class and at least 2 "
                         f"classes; found {len(classes)} ({', '.join(classes) or 'none'})")
    files: list[Path] = []
    labels: list[int] = []
    for index, name in enumerate(classes):
        found = image_files(root / name)
        if not found:
            raise ValueError(f"class folder {root / name} holds no image files "
                             f"({', '.join(sorted(IMAGE_SUFFIXES))})")
        files.extend(found)
        labels.extend([index] * len(found))
    return files, labels, classes
