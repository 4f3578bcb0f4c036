"""Writing an image folder (plain, by class, with captions or LLaVA records) as WebDataset
tar shards, with a `dataset.json` index that names every shard and every skipped file.

The image bytes are copied as they are, never re-encoded, once they decode as the readers
decode them. Each shard appears under its name only once complete, and `dataset.json` is
written last, so a folder with one is whole.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import vlm_vit.data.shards.reader as reader
from vlm_vit.data.folders import read_caption_lines
from vlm_vit.data.listing import IMAGE_SUFFIXES, class_folders, image_files
from vlm_vit.data.shards.reader import escape_name
from vlm_vit.data.shards.spec import DATASET_FORMAT, DATASET_VERSION, WRITER_LEFTOVER
from vlm_vit.data.shards.spec import DATASET_INDEX as INDEX
from vlm_vit.io.files import atomic_write, resolves_inside
from vlm_vit.optional import require
from vlm_vit.processor import ImageLoadError, ImageProcessor, ImageTooLargeError

logger = logging.getLogger(__name__)

# What an earlier run leaves in its folder: shards, and the temporaries in WRITER_LEFTOVER.
_SHARD = re.compile(r"\d{5,}\.tar")
# Decodes each image as training and encoding will (their default pixel bound), so what PIL
# fails on in any way is skipped here rather than written.
_DECODER = ImageProcessor()
# A records file's image that resolves outside the image folder (a `..`, an absolute path, a
# link out) is a bad record, skipped with this reason: it must not copy other files.
OUTSIDE = "image outside the image folder"
# json's C scanner recurses once per [ or {: a file of brackets is an error, not a traceback.
_TOO_DEEP = "is nested too deeply to read (JSON arrays or objects inside one another)"


@dataclass(frozen=True)
class _Sample:
    """One sample before its image is read: what goes beside the image bytes."""

    path: Path | None  # the image file; None for a text-only LLaVA record
    relative: str | None  # `path` as written in the sample's json, relative to the root
    fields: dict[str, bytes]  # extra entries, e.g. {"cls": b"3"}
    meta: dict[str, Any]  # the sample's json object, less "path"
    folder: Path | None = None  # named by a records file: the (resolved) folder it must be in


def write_shards(
    root: str | Path,
    out: str | Path,
    *,
    per_shard: int = 1000,
    classes: bool = False,
    captions: str | Path | None = None,
    llava: str | Path | None = None,
    shuffle: bool = True,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Writes the images under `root` to `out/00000.tar`, `out/00001.tar`, ... and
    `out/dataset.json`.

    A sample holds `__key__` (its index over the dataset, 9 digits), the image bytes under
    the file's lowercased suffix (`jpg`, `png`, ...), `cls` (the class index as decimal text)
    with `classes`, `txt` (the caption) with `captions`, and always a `json` object: the
    image's `path` relative to `root`, plus `class`, `caption` (and `prompt`, if given) or the
    whole LLaVA record. A text-only LLaVA record (no "image") has only its json. An image
    that does not decode (`ImageProcessor.load`, whatever PIL raised), is over its pixel bound
    or is missing, or a captions or LLaVA image that resolves outside `root`, is skipped with
    a warning and listed in the index.

    Args:
        root: the image folder (searched recursively), or the folder the records' image
            paths are relative to.
        out: the output folder, not `root` nor inside it; it must be missing or empty unless
            `overwrite`.
        per_shard: the most samples in one shard.
        classes: read `root`'s sub-folders as classes (see `vlm_vit.data.listing.class_folders`).
        captions: a JSON Lines file of `{"image": relative path, "caption": text}`.
        llava: a LLaVA JSON file (an array of records, or one record per line).
        shuffle: shuffle the samples with `seed` (else: sorted, or in the file's order).
        seed: the shuffle's seed.
        overwrite: replace the shards and index an earlier run left in `out` (other files
            are kept).
        progress: show a progress bar.

    Returns:
        The content of `dataset.json`: format, version, kind, classes, samples, skipped,
        shards and seed.

    Raises:
        FileNotFoundError, NotADirectoryError: for a missing `root`, captions or LLaVA file,
            or an `out` that is a file.
        ValueError: for conflicting options, an `out` inside `root`, no images, or a
            malformed captions or LLaVA file (naming the file and line or record).
        FileExistsError: for an `out` that holds files, without `overwrite`.
    """
    root, out = Path(root), Path(out)
    _check_arguments(root, out, per_shard, classes, captions, llava)
    kind, samples, class_names = _listed_samples(root, classes, captions, llava)
    if shuffle:
        random.Random(seed).shuffle(samples)

    created = _prepare_output(out, overwrite)
    skipped: list[dict[str, str]] = []
    try:
        shards = _write(samples, out, per_shard, skipped, progress)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()  # only when still empty: shards already renamed are kept
        raise
    if not shards:
        if created:
            out.rmdir()
        raise ValueError(f"none of the {len(samples)} images of {root} could be read (first: "
                         f"{skipped[0]['path']}: {skipped[0]['reason']})")
    index = {"format": DATASET_FORMAT, "version": DATASET_VERSION, "kind": kind,
             "classes": class_names,
             "samples": sum(shard["samples"] for shard in shards), "skipped": skipped,
             "shards": shards, "seed": seed if shuffle else None}
    with atomic_write(out / INDEX, "wb") as handle:
        handle.write((json.dumps(index, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
    return index


def _check_arguments(root: Path, out: Path, per_shard: int, classes: bool,
                     captions: str | Path | None, llava: str | Path | None) -> None:
    """Refuses `write_shards`'s conflicting options and folders before anything is read."""
    if per_shard < 1:
        raise ValueError(f"per-shard must be at least 1, got {per_shard}")
    if captions is not None and llava is not None:
        raise ValueError("give captions or LLaVA records, not both")
    if classes and (captions is not None or llava is not None):
        raise ValueError("classes come from sub-folders; they do not combine with captions or "
                         "LLaVA records")
    if not root.exists():
        raise FileNotFoundError(f"image folder {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"image folder {root} is not a folder")
    if resolves_inside(out, root.resolve()):  # shards among the images, deleted by --overwrite
        where = "is" if out.resolve() == root.resolve() else "is inside"
        raise ValueError(f"output folder {out} {where} the image folder {root}; write the "
                         f"shards elsewhere")


def _listed_samples(root: Path, classes: bool, captions: str | Path | None,
                    llava: str | Path | None) -> tuple[str, list[_Sample], list[str] | None]:
    """The dataset's kind, its samples in sorted (or the file's) order, and its class names
    (None unless `classes`)."""
    class_names = None
    if classes:
        kind = "classes"
        files, labels, class_names = class_folders(root)
        for name in class_names:  # the index lists them: refused before anything is written
            if not _is_utf8(name):
                raise ValueError(f"class folder {escape_name(name)} of {root} is not named in "
                                 f"UTF-8; rename it")
        samples = [_Sample(path, path.relative_to(root).as_posix(),
                           {"cls": str(label).encode("ascii")}, {"class": class_names[label]})
                   for path, label in zip(files, labels, strict=True)]
    elif captions is not None:
        kind, samples = "captions", _read_captions(Path(captions), root)
    elif llava is not None:
        kind, samples = "llava", _read_llava(Path(llava), root)
    else:
        kind = "images"
        files = image_files(root)
        if not files:
            raise ValueError(f"image folder {root} holds no image files "
                             f"({', '.join(sorted(IMAGE_SUFFIXES))})")
        samples = [_Sample(path, path.relative_to(root).as_posix(), {}, {}) for path in files]
    return kind, samples, class_names


def _read_captions(path: Path, root: Path) -> list[_Sample]:
    """The captions file's lines (`vlm_vit.data.folders.read_caption_lines`) as samples; a
    missing image, or one outside `root`, is not an error here: writing skips it."""
    folder = root.resolve()
    samples = []
    for where, row in read_caption_lines(path):
        _check_encodable(row, where)
        meta = {"caption": row["caption"]}
        if "prompt" in row:
            meta["prompt"] = row["prompt"]
        samples.append(_Sample(root / row["image"], row["image"],
                               {"txt": row["caption"].encode("utf-8")}, meta, folder))
    return samples


def _read_llava(path: Path, root: Path) -> list[_Sample]:
    """A LLaVA file's records as samples: a JSON array, or JSON Lines when the file does not
    start with `[`. The record's own "path", if any, gives way to the written one."""
    if not path.is_file():
        raise FileNotFoundError(f"no LLaVA file {path}")
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is no error
    except UnicodeDecodeError as error:
        raise ValueError(f"LLaVA file {path} is not UTF-8 text: {error}") from None
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"LLaVA file {path} is not valid JSON: {error}") from None
        except RecursionError:
            raise ValueError(f"LLaVA file {path} {_TOO_DEEP}") from None
        numbered = [(f"{path} record {number}", record)
                    for number, record in enumerate(records, 1)]
    else:
        numbered = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                numbered.append((f"{path} line {number}", json.loads(line)))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {number} is not JSON: {error}") from None
            except RecursionError:
                raise ValueError(f"{path} line {number} {_TOO_DEEP}") from None
    folder = root.resolve()
    samples = []
    for where, record in numbered:
        if not isinstance(record, dict):
            raise ValueError(f"{where} must be a JSON object, found {type(record).__name__}")
        image = record.get("image")
        if image is not None and not isinstance(image, str):
            raise ValueError(f"{where}: 'image' must be one relative path, got {image!r:.100}")
        _check_encodable(record, where)
        meta = {key: value for key, value in record.items() if key != "path"}
        samples.append(_Sample(None if image is None else root / image, image, {}, meta,
                               folder))
    if not samples:
        raise ValueError(f"LLaVA file {path} holds no records")
    return samples


def _check_encodable(record: dict[str, Any], where: str) -> None:
    """Refuses a record that UTF-8 cannot hold, which JSON can (a lone surrogate, from an
    escape such as `\\ud800`): its json entry could not be written.

    Raises:
        ValueError: naming `where` and the character.
    """
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{where} holds a lone surrogate "
                         f"({error.object[error.start:error.end]!r}), which UTF-8 cannot "
                         f"encode") from None


def _prepare_output(out: Path, overwrite: bool) -> bool:
    """Makes `out` ready to fill; returns whether it was created."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"output {out} exists and is not a folder")
    if not out.exists():
        out.mkdir(parents=True)
        return True
    if any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"output folder {out} is not empty; pass --overwrite to "
                                  f"replace the shards an earlier run wrote there")
        # The index first: a crash after this leaves a folder that is visibly incomplete.
        with contextlib.suppress(FileNotFoundError):
            (out / INDEX).unlink()
        for entry in out.iterdir():
            if (_SHARD.fullmatch(entry.name) or WRITER_LEFTOVER.fullmatch(entry.name)) \
                    and entry.is_file():
                entry.unlink()
    return False


def _write(samples: list[_Sample], out: Path, per_shard: int, skipped: list[dict[str, str]],
           progress: bool) -> list[dict[str, Any]]:
    """Writes the samples whose images decode, `per_shard` to a shard; returns the
    shards' names and sizes and appends each skipped image to `skipped`."""
    webdataset = require("webdataset", "train", "writing shards")
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    shards: list[dict[str, Any]] = []
    writer = handle = temp = None
    with contextlib.ExitStack() as stack:
        if progress:  # warnings go through the bar's writer, not glued to it
            stack.enter_context(logging_redirect_tqdm())
        bar = stack.enter_context(tqdm(total=len(samples), desc="sharding", unit="image",
                                       disable=not progress))
        try:
            written = 0
            for sample in samples:
                bar.update()
                entries = _entries(sample, skipped)
                if entries is None:
                    continue
                if writer is None:
                    temp = out / f".{len(shards):05d}.tar.tmp"
                    handle = open(temp, "wb")  # noqa: SIM115 (closed in _finish or below)
                    writer = webdataset.TarWriter(handle, encoder=False)
                writer.write({"__key__": f"{written:09d}", **entries})
                written += 1
                if written % per_shard == 0:
                    shards.append(_finish(writer, handle, temp, per_shard))
                    writer = None
            if writer is not None:
                shards.append(_finish(writer, handle, temp, written % per_shard))
                writer = None
        finally:
            if writer is not None:  # an error half-way: drop the unfinished shard
                with contextlib.suppress(OSError):
                    writer.close()
                with contextlib.suppress(OSError):
                    handle.close()
                with contextlib.suppress(FileNotFoundError):
                    temp.unlink()
    return shards


def _finish(writer: Any, handle: IO[bytes], temp: Path, count: int) -> dict[str, Any]:
    """Closes a shard, makes it durable and gives it its name."""
    writer.close()
    handle.flush()
    os.fsync(handle.fileno())
    handle.close()
    name = temp.name[1:-len(".tmp")]
    os.replace(temp, temp.with_name(name))
    return {"name": name, "samples": count}


def _entries(sample: _Sample, skipped: list[dict[str, str]]) -> dict[str, bytes] | None:
    """The sample's tar entries but its key, or None (and a line in `skipped`) when its image
    is missing, outside its records' folder, or does not decode, or its file name (which the
    json holds) is not UTF-8."""
    meta = {"path": sample.relative, **sample.meta}
    if sample.path is None:  # a text-only record: checked for UTF-8 when read
        return {**sample.fields, "json": json.dumps(meta, ensure_ascii=False).encode("utf-8")}
    suffix = sample.path.suffix.lower()
    reason = None
    if not _is_utf8(sample.relative):  # records are checked when read: a folder's file
        reason = "file name is not UTF-8"
    elif suffix not in IMAGE_SUFFIXES:
        reason = f"{suffix or 'no suffix'} is not an image suffix"
    elif sample.folder is not None and not resolves_inside(sample.path, sample.folder):
        reason = OUTSIDE
    elif not sample.path.is_file():
        reason = "no such file"
    elif (size := sample.path.stat().st_size) > reader.MAX_MEMBER_BYTES:
        # read at call time, as the readers do; they would skip the member unread
        reason = f"{size:,} bytes, over the {reader.MAX_MEMBER_BYTES:,} a shard member " \
                 f"may hold"
    else:
        try:
            data = sample.path.read_bytes()
            # The bytes to be written are the ones decoded, whole: verify() passes files that
            # fail to load (an IM file's TypeError).
            _DECODER.load(data, "image")
        except OSError as error:  # unreadable
            reason = f"{type(error).__name__}: {error}"
        except (ImageLoadError, ImageTooLargeError) as error:
            reason = str(error)
    if reason is not None:
        utf8 = _is_utf8(sample.relative)
        logger.warning("skipping %s: %s", sample.path if utf8 else escape_name(str(sample.path)),
                       reason)
        skipped.append({"path": sample.relative if utf8 else escape_name(sample.relative),
                        "reason": reason})
        return None
    return {suffix[1:]: data, **sample.fields,
            "json": json.dumps(meta, ensure_ascii=False).encode("utf-8")}


def _is_utf8(name: str) -> bool:
    """Whether a name from the file system is UTF-8 (others hold surrogate escapes)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
