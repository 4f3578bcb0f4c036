"""Safe, loud file helpers: atomic writes and directories, bounded JSON; every error names
the file. (Image folders are listed by `vlm_vit.data.listing`.)

Nothing here unpickles: the weight readers (`vlm_vit.io.tensor_files`, re-exported here) read
safetensors and `.npz` arrays by their headers, checked against the file's size before
anything is allocated, and JSON is bounded in size and nesting (`MAX_JSON_BYTES`,
`MAX_JSON_DEPTH`).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

# The weight-file readers live in vlm_vit.io.tensor_files; their names stay readable here.
from vlm_vit.io.tensor_files import MAX_NPZ_INFLATION as MAX_NPZ_INFLATION
from vlm_vit.io.tensor_files import MAX_SAFETENSORS_HEADER_BYTES as MAX_SAFETENSORS_HEADER_BYTES
from vlm_vit.io.tensor_files import SAFETENSORS_DTYPE_BITS as SAFETENSORS_DTYPE_BITS
from vlm_vit.io.tensor_files import check_safetensors_header as check_safetensors_header
from vlm_vit.io.tensor_files import read_npz as read_npz
from vlm_vit.io.tensor_files import read_safetensors as read_safetensors

logger = logging.getLogger(__name__)

# A JSON config larger than this is refused unread; Gemma's tokenizer.json, among the largest
# JSON files a model repository holds, is 34 MB.
MAX_JSON_BYTES = 64_000_000
# Deeper nesting is refused: no config nests past a handful of levels, and Python's parser
# raises RecursionError near 1000.
MAX_JSON_DEPTH = 200


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


# The previous model's own entries in a folder a save replaces: dropped even where the new
# save did not write them (its old shards and index). Every other entry the new save did not
# write (the user's own files and folders) is carried over; what it wrote always wins.
MODEL_FILES = ("*.safetensors", "*.json")
# Entries where the folder's copy wins over the new save's: the model card, as a user's own
# card is never replaced (`vlm_vit.io.card.write_card`).
KEPT_FILES = ("README.md",)
# Any of these at the top of a folder marks it as a model's (ours, a converted one, the LLM
# bridge's, another library's): a save may replace it. A non-empty folder holding none of
# them is the user's own, and a save refuses it rather than replace its .json files.
MODEL_MARKERS = ("config.json", "manifest.json", "multimodal_config.json",
                 "processor_config.json", "preprocessor_config.json", "classifier.json")
_FILLING: set[Path] = set()  # temporary folders an atomic_directory of this process fills
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two paths in one step (Linux `renameat2(RENAME_EXCHANGE)`); False where the
    system or file system cannot, so the caller falls back to two renames."""
    import ctypes
    import errno

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _leftovers(path: Path) -> list[tuple[Path, str]]:
    """(folder, kind) of the hidden `.NAME.PID.*.{tmp,new,old}` folders that dead writers of
    `path` left beside it; kind is "tmp" (half-written), "new" (written, not yet in place)
    or "old" (the folder it was replacing)."""
    found = []
    for entry in path.parent.glob(f".{glob.escape(path.name)}.*"):
        parts = entry.name[len(path.name) + 2:].split(".")
        if len(parts) < 2 or parts[-1] not in ("tmp", "new", "old") or not parts[0].isdigit():
            continue
        if entry.is_dir() and not _alive(int(parts[0])):
            found.append((entry, parts[-1]))
    return found


def recover_directory(path: str | Path) -> Path:
    """Repairs what a writer killed inside `atomic_directory(path)` left: where `path` is
    gone, the new folder it had finished is put in place (else the old one it was replacing
    is put back); then the dead writers' hidden folders are removed. Saves and loads call
    it first. Returns `path`.

    Raises:
        FileNotFoundError: when `path` is missing and a hidden copy could not be moved back
            (read-only file system), naming the copy to use.
    """
    path = Path(path)
    leftovers = _leftovers(path) if path.parent.is_dir() else []
    if not path.exists():
        for kind in ("new", "old"):
            candidates = sorted(folder for folder, found in leftovers if found == kind)
            if candidates:
                try:
                    os.replace(candidates[-1], path)
                except OSError as error:
                    raise FileNotFoundError(
                        f"{path} is missing: a save was interrupted, and its "
                        f"{'finished' if kind == 'new' else 'previous'} copy {candidates[-1]} "
                        f"could not be moved back ({error}); load that folder instead") from None
                logger.warning("%s: an interrupted save left it missing; restored %s copy %s",
                               path, "its finished" if kind == "new" else "the previous",
                               candidates[-1].name)
                leftovers = _leftovers(path)
                break
    for folder, _ in leftovers:
        shutil.rmtree(folder, ignore_errors=True)
    return path


def _carry_over(old: Path, new: Path, replaces: tuple[str, ...]) -> None:
    """Hard-links (or copies) into `new` the entries of `old` that the new save did not
    write, except the previous model's own (`replaces`); what `new` holds always wins, but
    for `KEPT_FILES` (a user's card)."""
    import fnmatch

    def matches(name: str, patterns: tuple[str, ...]) -> bool:
        return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)

    for entry in old.iterdir():
        target = new / entry.name
        written = target.exists() or target.is_symlink()
        if matches(entry.name, KEPT_FILES) and written:
            _remove(target)
        elif written or matches(entry.name, replaces):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, target)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _link_or_copy(source, destination) -> None:
    try:
        os.link(source, destination, follow_symlinks=False)
    except OSError:
        shutil.copy2(source, destination, follow_symlinks=False)


@contextlib.contextmanager
def atomic_directory(path: str | Path, *, replaces: tuple[str, ...] = MODEL_FILES
                     ) -> Iterator[Path]:
    """Yields a temporary folder beside `path` to fill; on success it becomes `path`.

    Every multi-file save goes through here, so a reader sees the old folder or the new
    one, never a mix (B's config with A's weights):

    - the new folder is filled under a hidden name (`.NAME.PID.*.tmp`), then renamed
      `.NAME.PID.new` once complete;
    - the new folder always wins: of the existing folder, only the entries the new save did
      not write are carried over (by hard links), and not those `replaces` names, the
      previous model's own files (its old shards, a sub-model the new save lacks); only a
      `README.md` the folder holds wins over the new one (a user's card is never replaced);
    - the two folders are swapped in one step where the system can (Linux
      `renameat2(RENAME_EXCHANGE)`), else the old one is renamed `.NAME.PID.old` first; a
      writer killed between those renames leaves `path` missing, and `recover_directory`
      (run by the next save or load) puts the finished or the old folder back.

    Nested calls compose: a save inside another's temporary folder (a tower saving its
    encoder) writes straight into it.

    Args:
        path: the folder to write.
        replaces: `fnmatch` patterns of top-level names that belong to the model `path`
            held: dropped where the new save did not write them (a saver whose models have
            sub-folders or optional parts names those too, e.g. `(*MODEL_FILES, "tower")`).

    Raises:
        ValueError: for a folder no save may replace (`check_replaceable`): a link, a file,
            or a user's non-empty folder that holds no model.
    """
    path = Path(path)
    if path.resolve() in _FILLING or path.parent.resolve() in _FILLING:
        path.mkdir(parents=True, exist_ok=True)
        yield path  # the outer atomic_directory makes it appear at once
        return
    check_replaceable(path)
    path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_directory(path)
    temp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.",
                                 suffix=".tmp"))
    filling = temp
    _FILLING.add(filling)
    old = None
    try:
        yield temp
        os.chmod(temp, 0o777 & ~_umask())  # mkdtemp makes 0700; give the usual permissions
        if path.is_dir():
            _carry_over(path, temp, replaces)
        finished = temp.with_name(temp.name.removesuffix(".tmp") + ".new")
        os.replace(temp, finished)
        temp = finished
        if path.exists() and _exchange(finished, path):
            shutil.rmtree(finished, ignore_errors=True)  # it now holds the old folder
            return
        if path.exists():
            old = finished.with_name(finished.name.removesuffix(".new") + ".old")
            os.replace(path, old)
        os.replace(finished, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if old is not None and old.exists() and not path.exists():
            os.replace(old, path)  # an error (not a kill) between the renames: roll back
        shutil.rmtree(temp, ignore_errors=True)
        raise
    finally:
        _FILLING.discard(filling)


def check_replaceable(path: str | Path) -> None:
    """Refuses a folder a save must not replace: a symbolic link (the save would replace the
    link's target, somewhere else), a file, or a folder that holds no model (no
    `MODEL_MARKERS` entry) but other files (the user's own, whose .json and .safetensors a
    save would drop). A missing folder, one holding only a card (`KEPT_FILES`, never
    replaced) or hidden entries, or a model's, may be written.

    Raises:
        ValueError: naming the folder and why.
    """
    path = Path(path)
    if path.is_symlink():
        raise ValueError(f"{path} is a symbolic link (to {os.readlink(path)}); vlm-vit never "
                         "writes through a link to another place: name the real folder")
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file, not a folder; write the model to a folder")
    own = [entry for entry in path.iterdir() if entry.name not in KEPT_FILES
           and not entry.name.startswith(".")] if path.is_dir() else []
    if own and not any((path / marker).is_file() for marker in MODEL_MARKERS):
        raise ValueError(f"{path} holds files but no model (no config.json, manifest.json or "
                         "other model config); "
                         "saving into it would replace its .json and .safetensors files: "
                         "write to a new or empty folder")


def resolves_inside(path: str | Path, *roots: Path) -> bool:
    """Whether `path`, symbolic links followed, lies inside one of `roots` (resolved): how a
    path named by a data file, an index or a cache is kept inside its folder. A link loop or
    an unreadable folder counts as outside."""
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError):
        return False
    return any(resolved.is_relative_to(root) for root in roots)


def read_json(path: str | Path, max_bytes: int | None = None) -> dict[str, Any]:
    """Reads a JSON object, naming `path` when it is missing, malformed or hostile.

    Args:
        path: the file.
        max_bytes: refuse larger files before reading them (default `MAX_JSON_BYTES`).

    Raises:
        FileNotFoundError: when `path` is missing.
        ValueError: for invalid JSON, a file over `max_bytes`, nesting deeper than
            `MAX_JSON_DEPTH`, or anything but an object at the top.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist or is not a file")
    limit = MAX_JSON_BYTES if max_bytes is None else max_bytes
    size = path.stat().st_size
    if size > limit:
        raise ValueError(f"{path} is {size / 1e6:.1f} MB, over the {limit / 1e6:.0f} MB a JSON "
                         f"config may be; refused")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    except RecursionError:
        raise ValueError(f"{path} is nested too deeply to parse (more than "
                         f"{MAX_JSON_DEPTH} levels of arrays and objects); refused") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, found {type(data).__name__}")
    if _nesting_exceeds(data, MAX_JSON_DEPTH):
        raise ValueError(f"{path} is nested more than {MAX_JSON_DEPTH} levels of arrays and "
                         f"objects deep; refused")
    return data


def _nesting_exceeds(data: Any, limit: int) -> bool:
    """Whether lists and dicts nest more than `limit` deep (iterative: no recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return False


def write_safetensors(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Writes tensors to a safetensors file atomically."""
    from safetensors.torch import save

    tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    data = save(tensors, metadata={"format": "pt", **(metadata or {})})
    with atomic_write(path, "wb") as handle:
        handle.write(data)
