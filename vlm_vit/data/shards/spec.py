"""Shard specs: a brace pattern, a glob, a list, a directory of `.tar` files or a URL, and the
`dataset.json` index `vlm-vit shards` writes beside its shards."""

from __future__ import annotations

import glob
import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlm_vit.optional import require

logger = logging.getLogger(__name__)

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
URL_PREFIXES = ("pipe:", "http://", "https://", "s3://", "gs://", "ais://", "file:")
DATASET_INDEX = "dataset.json"  # written by `vlm-vit shards` beside its shards
DATASET_FORMAT, DATASET_VERSION = "vlm-vit-shards", 1  # its "format" and "version"
# The most shards a spec may expand to, checked from the pattern before expanding it (1M
# shards of 1,000 samples is a billion; `{000000000..999999999}` would exhaust memory).
MAX_SHARDS = 1_000_000
# What `vlm-vit shards` leaves in its folder when killed: a shard or the index being written.
WRITER_LEFTOVER = re.compile(r"\.(\d{5,}\.tar|dataset\.json\..*)\.tmp")


# -- shard specs ------------------------------------------------------------------------------

def _is_url(text: str) -> bool:
    return text.startswith(URL_PREFIXES)


def is_shard_spec(data: Any) -> bool:
    """Whether `--data` names tar shards rather than a folder of images: a list, a URL, a
    brace pattern, a glob or path ending in a shard suffix, or a folder of tars without
    images."""
    if isinstance(data, (list, tuple)):
        return True
    text = str(data)
    if _is_url(text) or ("{" in text and ".." in text):
        return True
    if text.endswith(SHARD_SUFFIXES):
        return True
    path = Path(text)
    if path.is_dir():
        from vlm_vit.data.listing import image_files

        return bool(_tars_in(path)) and not image_files(path)
    return False


def _tars_in(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.iterdir()
                  if p.is_file() and p.name.endswith(SHARD_SUFFIXES))


def expand_shards(spec: str | Path | Sequence[str | Path]) -> list[str]:
    """The shard URLs of a spec, in order.

    Raises:
        FileNotFoundError: for a local shard that does not exist, or a glob or folder that
            matches none.
        ValueError: for an empty spec, or a brace pattern that may name more than
            `MAX_SHARDS` shards.
    """
    if isinstance(spec, (list, tuple)):
        urls = [url for item in spec for url in expand_shards(item)]
    else:
        text = str(spec)
        if _is_url(text):
            urls = _brace_expanded(text)
        elif Path(text).is_dir():
            urls = _tars_in(Path(text))
            if not urls:
                raise FileNotFoundError(f"folder {text} holds no tar shards "
                                        f"({', '.join(SHARD_SUFFIXES)})")
        elif any(c in text for c in "*?["):
            urls = sorted(u for u in glob.glob(text) if u.endswith(SHARD_SUFFIXES))
            if not urls:
                raise FileNotFoundError(f"no tar shards match {text}")
        else:
            urls = _brace_expanded(text)
            missing = [u for u in urls if not Path(u).is_file()]
            if missing:
                raise FileNotFoundError(
                    f"shard {missing[0]} does not exist" + (
                        f" ({len(missing)} of the {len(urls)} shards of {text} are missing)"
                        if len(urls) > 1 else ""))
    if not urls:
        raise ValueError(f"shard spec {spec!r} names no shard")
    return urls


_INT_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?")
_CHAR_RANGE = re.compile(r"[A-Za-z]\.\.[A-Za-z](?:\.\.-?\d+)?")


def _brace_expanded(text: str) -> list[str]:
    """`braceexpand(text)` as a list, refused first when the pattern may name more than
    `MAX_SHARDS` shards (braceexpand builds every range whole before it yields a name)."""
    bound = _expansion_bound(text)
    if bound > MAX_SHARDS:
        raise ValueError(f"shard spec {text!r} names up to {bound:,} shards, more than the "
                         f"{MAX_SHARDS:,} a spec may (MAX_SHARDS); check its brace ranges")
    return list(require("braceexpand", "train", "reading tar shards").braceexpand(text))


def _expansion_bound(pattern: str) -> int:
    """An upper bound on the names `braceexpand(pattern)` gives: the product, over every
    brace group, of its size (a range's length; a list's items)."""
    bound, opened, position = 1, [], 0  # opened: [start, commas] per unclosed brace
    while position < len(pattern):
        char = pattern[position]
        if char == "\\":  # braceexpand's escape: the next character is literal
            position += 1
        elif char == "{":
            opened.append([position, 0])
        elif char == "," and opened:
            opened[-1][1] += 1
        elif char == "}" and opened:
            start, commas = opened.pop()
            bound *= _group_size(pattern[start + 1:position], commas)
        position += 1
    return bound


def _group_size(inside: str, commas: int) -> int:
    """How many alternatives one brace group `{inside}` has (at most, when nested)."""
    numbers = _INT_RANGE.fullmatch(inside)
    if numbers is not None:
        first, last, step = numbers.groups()
        return abs(int(last) - int(first)) // max(int(step or 1), 1) + 1
    if _CHAR_RANGE.fullmatch(inside):
        return 52  # at most the letters of both cases
    return commas + 1


def read_dataset_index(shards: Sequence[str]) -> dict[str, Any] | None:
    """The `dataset.json` that `vlm-vit shards` wrote beside local shards, or None.

    A folder that `vlm-vit shards` did not finish is named in a warning, with what is
    missing: the shard or index it was writing when it stopped, or the shards its index
    lists that are not there.

    Raises:
        ValueError: naming the file and the field, for an index whose `classes` or `shards`
            is malformed.
    """
    if not shards or _is_url(shards[0]):
        return None
    folder = Path(shards[0]).parent
    path = folder / DATASET_INDEX
    _warn_if_unfinished(folder, path)
    if not path.is_file():
        return None
    from vlm_vit.io.files import read_json

    index = read_json(path)
    if index.get("format") != DATASET_FORMAT:
        return None
    _check_index(index, path)
    missing = [shard["name"] for shard in index.get("shards", [])
               if not (folder / shard["name"]).is_file()]
    if missing:
        logger.warning("%s lists %d shards missing from %s (%s%s): their samples are not read",
                       path, len(missing), folder, ", ".join(missing[:5]),
                       ", ..." if len(missing) > 5 else "")
    return index


def _warn_if_unfinished(folder: Path, index: Path) -> None:
    """Warns when `folder` holds what a killed `vlm-vit shards` leaves (`WRITER_LEFTOVER`)."""
    leftovers = sorted(entry.name for entry in folder.iterdir()
                       if WRITER_LEFTOVER.fullmatch(entry.name))
    if leftovers:
        logger.warning("%s holds %s, left by a `vlm-vit shards` that did not finish, and %s: "
                       "the shards it had still to write are missing (run it again with "
                       "--overwrite)", folder, ", ".join(leftovers),
                       "an older dataset.json" if index.is_file() else "no dataset.json")


def _check_index(index: dict[str, Any], path: Path) -> None:
    """Refuses a `dataset.json` whose fields that readers use have the wrong shape."""
    classes, shards = index.get("classes"), index.get("shards", [])
    if classes is not None and not (isinstance(classes, list)
                                    and all(isinstance(name, str) for name in classes)):
        raise ValueError(f"{path}: 'classes' must be a list of class names or null, got "
                         f"{json.dumps(classes)[:80]}")
    if not (isinstance(shards, list) and all(
            isinstance(shard, dict) and isinstance(shard.get("name"), str) for shard in shards)):
        raise ValueError(f"{path}: 'shards' must be a list of objects with a 'name', got "
                         f"{json.dumps(shards)[:80]}")

