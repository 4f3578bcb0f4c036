"""WebDataset tar shards as a source of samples, beside image folders.

    stream = ShardStream("shards/{00000..00127}.tar", ImageDecode(augmentation, seed=0))

A shard spec is a brace pattern, a glob, a list, a directory of `.tar` files, or any URL
`webdataset` opens (`pipe:aws s3 cp ...`, `https://...`). The tars are read by `webdataset`
as raw bytes; only the fields we decode ourselves (images, `cls`, `txt`, `json`) are ever
looked at, so nothing in a shard is unpickled (webdataset's own decoders would unpickle
`.pyd` and `.pth` members).

Order and bookkeeping (see docs/architecture.md, "Shards"):

- Epoch e deals the shards in an order seeded by (seed, e). The epochs follow one another
  as one endless sequence of shard positions, and position p goes to slot p mod (ranks x
  workers): worker w of rank r is slot w x ranks + r. So the ranks and workers read
  disjoint shards, every sample is read once per epoch across all of them, and an uneven
  last round is neither dropped nor padded: it continues into the next epoch's shards.
- Within a shard, blocks of `shuffle_block` samples are shuffled, seeded by (seed, epoch,
  shard, block), so a shard written in class order still mixes.
- Each worker batches its own samples. A batch carries its slot's position after it (the
  shard ordinal and the samples consumed in that shard), so a checkpoint records, per rank,
  where each slot stands, and a resume skips exactly the consumed samples: nothing is
  repeated or skipped. DataLoader takes batches from its workers in turn, so the next batch
  comes from slot `batches mod workers`; a resumed loader rotates the slots to match.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import json
import logging
import re
import tarfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlm_vit.optional import require
from vlm_vit.train.data import UndecodableImage, mixed_seed

logger = logging.getLogger(__name__)

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
URL_PREFIXES = ("pipe:", "http://", "https://", "s3://", "gs://", "ais://", "file:")
# A sample's image is the first of these fields it has (img2dataset writes `jpg`).
IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif", "ppm", "pgm")
DATASET_INDEX = "dataset.json"  # written by `vlm-vit shards` beside its shards
DATASET_FORMAT, DATASET_VERSION = "vlm-vit-shards", 1  # its "format" and "version"
SAMPLES_DIR = "samples"  # the trainer's per-rank sample logs (TrainConfig.log_samples)
# The most bytes one member may declare; a larger one is skipped unread, by name. Members are
# read whole into memory (an image, a caption, a json), and no training image is near 1 GiB,
# while a 1.5 KB sparse tar or a small .tar.gz can declare 10 GB.
MAX_MEMBER_BYTES = 2**30
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
        from vlm_vit.files import image_files

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
    from vlm_vit.files import read_json

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


# -- samples ----------------------------------------------------------------------------------

@dataclass
class Sample:
    """One sample of a shard, undecoded.

    Attributes:
        key: its `__key__`.
        shard: the shard's URL.
        shard_index: the shard's place in the shard list (fixes augmentation seeds).
        index: its place in the shard, in the order read.
        epoch: the epoch it is read in.
        fields: extension -> raw bytes (`jpg`, `cls`, `txt`, `json`, ...).
    """

    key: str
    shard: str
    shard_index: int
    index: int
    epoch: int
    fields: dict[str, bytes]

    @property
    def name(self) -> str:
        """`shard:key`, used in every message about the sample."""
        return f"{self.shard}:{self.key}"

    def image(self) -> bytes | None:
        """The encoded image (the first of `IMAGE_FIELDS` present), or None."""
        return next((self.fields[f] for f in IMAGE_FIELDS if f in self.fields), None)

    def text(self, name: str) -> str | None:
        value = self.fields.get(name)
        return None if value is None else value.decode("utf-8", errors="replace").strip()

    def json(self) -> Any:
        """The `json` field parsed, or None.

        Raises:
            ValueError: naming the sample when it is not JSON.
        """
        value = self.fields.get("json")
        if value is None:
            return None
        try:
            return json.loads(value)
        except (ValueError, RecursionError) as error:
            raise ValueError(f"{self.name}: its json field is not JSON ({error})") from None

    def label(self, json_field: str | None = None) -> int:
        """The class index: the `cls` field, or `json_field` of the `json` field.

        Raises:
            ValueError: naming the sample when the label is missing or not an integer.
        """
        if json_field is None:
            raw = self.text("cls")
            where = "cls field"
        else:
            record = self.json()
            raw = record.get(json_field) if isinstance(record, dict) else None
            where = f"json field {json_field!r}"
        try:
            value = int(raw) if not isinstance(raw, bool) else None
        except (TypeError, ValueError):
            value = None
        if value is None or value < 0:
            raise ValueError(f"{self.name}: no class label in its {where} (got {raw!r}); "
                             "a label is a non-negative integer")
        return value


@dataclass
class ShardProblems:
    """What reading skipped: the truncated or unreadable shards, and the members passed
    over (over `MAX_MEMBER_BYTES`, or a duplicate within a sample)."""

    truncated: list[tuple[str, int, str]] = field(default_factory=list)  # (url, read, error)
    members: list[tuple[str, str, str]] = field(default_factory=list)  # (url, member, reason)
    # False where the caller reports each truncated shard itself (encode names its output),
    # so the user is told once.
    warn_truncated: bool = True

    def skip_member(self, url: str, member: str, reason: str) -> None:
        logger.warning("%s: skipping member %s: %s", url, escape_name(member), reason)
        self.members.append((url, member, reason))


# Members webdataset treats as metadata, not samples (`__key__`-like names).
_META_MEMBER = re.compile(r"__[^/]*__($|/)")
# A member's sample key and field: everything before the first dot of its base name.
_MEMBER_NAME = re.compile(r"((?:.*/|)[^.]+)[.]([^/]*)", re.DOTALL)


def _members(stream: Any, url: str, problems: ShardProblems) -> Iterator[tuple[str, bytes]]:
    """The regular members of a tar stream as (name, bytes), in order; a member declaring
    more than `MAX_MEMBER_BYTES` is skipped before a byte of it is read (its size in the
    header is what it declares, for a sparse or compressed tar too)."""
    archive = tarfile.open(fileobj=stream, mode="r|*")  # noqa: SIM115 (the caller closes stream)
    for member in archive:
        archive.members = []  # a stream keeps no list of what it passed
        if not member.isreg() or _META_MEMBER.match(member.name):
            continue
        if member.size > MAX_MEMBER_BYTES:
            problems.skip_member(url, member.name, f"it declares {member.size:,} bytes, more "
                                 f"than the {MAX_MEMBER_BYTES:,} a member may (MAX_MEMBER_BYTES)")
            continue
        yield member.name, archive.extractfile(member).read()


def _grouped(members: Iterator[tuple[str, bytes]], url: str, problems: ShardProblems
             ) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Consecutive members of one key as (key, {field: bytes}), as webdataset groups them;
    a second member of the same key and field is skipped by name, and reading goes on."""
    key, fields = None, {}
    for name, data in members:
        match = _MEMBER_NAME.fullmatch(name)
        if match is None:
            continue
        prefix, suffix = match.group(1), match.group(2).lower()
        if prefix != key:
            if key is not None:
                yield key, fields
            key, fields = prefix, {}
        if suffix in fields:
            problems.skip_member(url, name, "a duplicate of an earlier member of the same "
                                 "sample")
            continue
        fields[suffix] = data
    if key is not None:
        yield key, fields


def read_shard(url: str, shard_index: int = 0, *, epoch: int = 0, skip: int = 0,
               problems: ShardProblems | None = None) -> Iterator[Sample]:
    """The samples of one shard, in tar order, skipping the first `skip` undecoded.

    A truncated or unreadable shard ends early with a warning naming it and how many
    samples were read (and an entry in `problems`); the caller goes on with the next. A
    member over `MAX_MEMBER_BYTES`, or a duplicate within a sample, is skipped with a
    warning naming the shard and the member (and an entry in `problems`).
    """
    wds = require("webdataset", "train", "reading tar shards")
    problems = ShardProblems() if problems is None else problems
    read = 0
    try:
        stream = _EndWatch(wds.gopen(url))
        try:
            for key, fields in _grouped(_members(stream, url, problems), url, problems):
                if read >= skip:
                    yield Sample(key, url, shard_index, read, epoch, fields)
                read += 1
            stream.check_end()
        finally:
            stream.close()
    except GeneratorExit:
        raise
    except Exception as error:  # tarfile.ReadError, OSError, a pipe that failed...
        message = str(error).split(" @ ")[0]
        if problems.warn_truncated:
            logger.warning("shard %s is truncated or unreadable after %d samples (%s); going "
                           "on with the next shard", url, read, message)
        problems.truncated.append((url, read, message))


class _EndWatch:
    """A read-only stream that remembers its last bytes, to tell a complete tar from one cut
    at a member boundary (which `tarfile` reads as a normal end): a tar ends with at least
    two zero blocks and is a whole number of blocks long. Compressed tars need no check:
    their decompressor fails on a cut."""

    BLOCK = 512

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.total = 0
        self.head = b""
        self.tail = b""

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        if len(self.head) < 6:
            self.head += data[: 6 - len(self.head)]
        self.total += len(data)
        self.tail = (self.tail + data[-2 * self.BLOCK:])[-2 * self.BLOCK:]
        return data

    def check_end(self) -> None:
        """Raises EOFError unless the stream ended like a whole tar."""
        while self.read(1 << 16):  # tarfile stops at the first zero block; read the rest
            pass
        if self.head.startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ")):
            return
        if self.total % self.BLOCK or self.tail != bytes(2 * self.BLOCK):
            raise EOFError(f"the tar ends after {self.total} bytes without its end-of-archive "
                           "blocks")

    def close(self) -> None:
        self.stream.close()


def iter_samples(shards: Sequence[str], problems: ShardProblems | None = None
                 ) -> Iterator[Sample]:
    """Every sample of every shard once, in order (for encoding and evaluation)."""
    for index, url in enumerate(shards):
        yield from read_shard(url, index, problems=problems)


# -- decoding ---------------------------------------------------------------------------------

class ImageDecode:
    """A sample's image, augmented for pretraining; seeds from (seed, epoch, shard, index).

    Returns a `[3, H, W]` tensor, an `UndecodableImage` naming `shard:key`, or None for a
    sample without an image (the stream counts those).
    """

    def __init__(self, augmentation: Callable[[Any, int], torch.Tensor], seed: int = 0) -> None:
        self.augmentation = augmentation
        self.seed = seed

    def __call__(self, sample: Sample) -> torch.Tensor | UndecodableImage | None:
        data = sample.image()
        if data is None:
            return None
        try:
            image = self.augmentation.decoder.load(data, f"image {sample.name}")
        except ValueError as error:
            return UndecodableImage(sample.name, str(error))
        return self.augmentation(image, mixed_seed(self.seed, sample.epoch,
                                                   sample.shard_index, sample.index))


class LabelledDecode:
    """A sample's image through the inference processor, and its class label.

    Args:
        processor: the `ImageProcessor` (resize, crop, normalise).
        label_field: None for the `cls` field, else a field of the `json` field.
        num_classes: when given, a label outside 0..num_classes-1 is refused.

    A sample whose label is missing, not an integer or out of range comes back as an
    `UndecodableImage` naming it and the reason, so it is skipped and reported like a bad
    image rather than stopping the run.
    """

    def __init__(self, processor: Any, label_field: str | None = None,
                 num_classes: int | None = None) -> None:
        self.processor = processor
        self.label_field = label_field
        self.num_classes = num_classes

    def __call__(self, sample: Sample) -> tuple[torch.Tensor, int] | UndecodableImage | None:
        data = sample.image()
        if data is None:
            return None
        try:
            label = sample.label(self.label_field)
        except ValueError as error:
            return UndecodableImage(sample.name, str(error))
        if self.num_classes is not None and label >= self.num_classes:
            return UndecodableImage(sample.name, f"class {label} is out of range for "
                                                 f"{self.num_classes} classes")
        try:
            image = self.processor.load(data, f"image {sample.name}")
        except ValueError as error:
            return UndecodableImage(sample.name, str(error))
        return self.processor.preprocess_one(image), label


class LabelledBatches:
    """(pixels `[B, 3, H, W]`, labels `[B]`) batches from shards read once in order (for
    evaluation); what it skips (no image, undecodable) is kept for the report.

    Args:
        shards: the shard URLs.
        decode: a `LabelledDecode`.
        batch_size: samples per batch (the last may be smaller).
        select: keeps a sample when true (e.g. the held-out part of a `KeySplit`).
    """

    def __init__(self, shards: Sequence[str], decode: Callable[[Sample], Any], batch_size: int,
                 select: Callable[[Sample], bool] | None = None) -> None:
        self.shards, self.decode, self.batch_size = list(shards), decode, batch_size
        self.select = select
        self.problems = ShardProblems()
        self.no_image: list[str] = []
        self.undecodable: list[tuple[str, str]] = []

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        pixels, labels = [], []
        for sample in iter_samples(self.shards, self.problems):
            if self.select is not None and not self.select(sample):
                continue
            item = self.decode(sample)
            if item is None:
                self.no_image.append(sample.name)
            elif isinstance(item, UndecodableImage):
                self.undecodable.append((item.path, item.reason))
            else:
                pixels.append(item[0])
                labels.append(item[1])
                if len(pixels) == self.batch_size:
                    yield torch.stack(pixels), torch.tensor(labels)
                    pixels, labels = [], []
        if pixels:
            yield torch.stack(pixels), torch.tensor(labels)

    def skipped(self) -> dict[str, int]:
        """The counts, after a warning that names the skipped samples."""
        if self.no_image or self.undecodable:
            named = [f"{name} (no image)" for name in self.no_image[:5]]
            named += self.described(5)
            logger.warning("skipped %d samples without an image and %d whose image or label "
                           "cannot be read: %s%s",
                           len(self.no_image), len(self.undecodable), "; ".join(named),
                           "; ..." if len(self.no_image) > 5 or len(self.undecodable) > 5
                           else "")
        return {"no_image": len(self.no_image), "undecodable": len(self.undecodable),
                "truncated_shards": len(self.problems.truncated)}

    def described(self, count: int) -> list[str]:
        """The first `count` undecodable samples, each named once with its reason."""
        return [reason if name in reason else f"{name}: {reason}"
                for name, reason in self.undecodable[:count]]


def held_out(key: str, fraction: float, seed: int) -> bool:
    """Whether a sample belongs to the held-out part: a seeded hash of its key, so a stream
    can split without reading the whole dataset first."""
    import zlib

    crc = zlib.crc32(key.encode("utf-8", "surrogateescape"))  # a key's bytes: any name
    return fraction > 0 and mixed_seed(seed, crc) / 2 ** 63 < fraction


class KeySplit:
    """Keeps the training part (`test=False`) or the held-out part of a `held_out` split."""

    def __init__(self, fraction: float, seed: int, test: bool) -> None:
        self.fraction, self.seed, self.test = fraction, seed, test

    def __call__(self, sample: Sample) -> bool:
        return held_out(sample.key, self.fraction, self.seed) == self.test


# -- the stream -------------------------------------------------------------------------------

@dataclass
class StreamBatch:
    """One worker's collated batch and where its slot stands after it.

    Attributes:
        batch: what the collate made of the decoded samples.
        samples: (epoch, shard, key) of each sample in the batch that decoded, in order.
        role: the slot's worker role (0..workers-1).
        position: (shard ordinal within the slot, samples consumed in that shard).
        no_image: samples skipped for having no image since the slot's previous batch.
        truncated: (shard, samples read, error) of shards found truncated since then.
    """

    batch: Any
    samples: list[tuple[int, str, str]]
    role: int
    position: tuple[int, int]
    no_image: int
    truncated: list[tuple[str, int, str]] = field(default_factory=list)


@dataclass
class StreamState:
    """Where one rank's stream stands: recorded in checkpoints, one per rank.

    Attributes:
        seed, shuffle, block, shards, world_size, rank, workers: what fixes the order; a
            resume must match them.
        shard_list: a CRC-32 of the shard URLs, so a resume on other shards is refused.
        slots: per worker role, [shard ordinal, samples consumed in that shard].
        batches: batches this rank has drawn (the next comes from role batches mod workers).
        no_image: samples skipped so far for having no image.
        truncated: [shard, samples read, error] of each truncated shard met, once each.
    """

    seed: int
    shuffle: bool
    block: int
    shards: int
    shard_list: int
    world_size: int
    rank: int
    workers: int
    slots: list[list[int]]
    batches: int = 0
    no_image: int = 0
    truncated: list[list] = field(default_factory=list)

    def advance(self, batch: StreamBatch) -> None:
        """Records that `batch` was drawn."""
        self.slots[batch.role] = list(batch.position)
        self.batches += 1
        self.no_image += batch.no_image
        known = {entry[0] for entry in self.truncated}
        self.truncated += [list(t) for t in batch.truncated if t[0] not in known]

    def epoch(self) -> int:
        """The oldest epoch a slot is still reading."""
        count = self.world_size * self.workers
        return min((j * count + role * self.world_size + self.rank) // self.shards
                   for role, (j, _) in enumerate(self.slots))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ShardStream(torch.utils.data.IterableDataset):
    """An endless, exactly resumable stream of batches from tar shards.

    The trainer calls `configure` and iterates a DataLoader over it (`loader`); for one
    pass in order, use `iter_samples` instead.

    Args:
        shards: a shard spec (see `expand_shards`).
        decode: turns a `Sample` into a dataset item (a tensor, `(tensor, label)`, an
            `UndecodableImage`, ...), or None to skip it as having no image.
        select: keeps a sample when true (e.g. a `KeySplit`); others are passed over.
        seed: fixes the shard order per epoch and the block shuffle.
        shuffle: shuffle the shard order per epoch, and blocks within shards.
        shuffle_block: samples per shuffled block within a shard (1: tar order); each worker
            holds one block's raw bytes.

    Raises:
        FileNotFoundError, ValueError: from `expand_shards`.
    """

    def __init__(self, shards: str | Path | Sequence[str], decode: Callable[[Sample], Any], *,
                 select: Callable[[Sample], bool] | None = None, seed: int = 0,
                 shuffle: bool = True, shuffle_block: int = 256) -> None:
        super().__init__()
        if shuffle_block < 1:
            raise ValueError(f"shuffle_block must be at least 1, got {shuffle_block}")
        self.spec = shards
        self.shards = expand_shards(shards)
        self.decode = decode
        self.select = select
        self.seed = seed
        self.shuffle = shuffle
        self.shuffle_block = shuffle_block
        self.index = read_dataset_index(self.shards)
        # Set by `configure` before a loader starts; workers get copies.
        self._batch_size = 1
        self._collate: Callable[[list], Any] = list
        self._state: StreamState | None = None
        self._num_workers = 0

    # -- order --------------------------------------------------------------------------------

    def shard_order(self, epoch: int) -> list[int]:
        """The shard indices in the order epoch `epoch` deals them."""
        if not self.shuffle:
            return list(range(len(self.shards)))
        rng = np.random.default_rng(mixed_seed(self.seed, epoch))
        return rng.permutation(len(self.shards)).tolist()

    def _blocks(self, shard_index: int, epoch: int, skip: int,
                problems: ShardProblems) -> Iterator[Sample]:
        """The shard's samples in block-shuffled order, from the `skip`-th on."""
        url = self.shards[shard_index]
        size = self.shuffle_block if self.shuffle else 1
        first = skip // size * size  # whole blocks before the resume point are not decoded
        block: list[Sample] = []
        number = first // size

        def shuffled(samples: list[Sample], number: int) -> list[Sample]:
            if size == 1:
                return samples
            rng = np.random.default_rng(mixed_seed(self.seed, epoch, shard_index, number))
            return [samples[i] for i in rng.permutation(len(samples))]

        emitted = first
        for sample in read_shard(url, shard_index, epoch=epoch, skip=first, problems=problems):
            block.append(sample)
            if len(block) == size:
                for item in shuffled(block, number):
                    if emitted >= skip:
                        yield item
                    emitted += 1
                block, number = [], number + 1
        for item in shuffled(block, number):  # the shard's last, partial block
            if emitted >= skip:
                yield item
            emitted += 1

    # -- the trainer's side -------------------------------------------------------------------

    def configure(self, batch_size: int, collate: Callable[[list], Any], *, rank: int = 0,
                  world_size: int = 1, workers: int = 0, state: dict | None = None
                  ) -> StreamState:
        """Sets up this rank's stream, fresh or from a checkpoint's state; returns the state
        the caller advances with each batch drawn.

        Raises:
            ValueError: when the saved state was made with another shard list, seed, number
                of processes or of workers, naming what differs.
        """
        roles = max(workers, 1)
        import zlib

        listed = "\n".join(self.shards).encode("utf-8", "surrogateescape")  # names are bytes
        fresh = StreamState(self.seed, self.shuffle, self.shuffle_block, len(self.shards),
                            zlib.crc32(listed), world_size, rank, roles,
                            [[0, 0] for _ in range(roles)])
        if state is not None:
            saved = StreamState(**state)
            differs = {name: (getattr(saved, name), getattr(fresh, name))
                       for name in ("seed", "shuffle", "block", "shards", "shard_list",
                                    "world_size", "rank", "workers")
                       if getattr(saved, name) != getattr(fresh, name)}
            if differs:
                raise ValueError(
                    "the checkpoint's shard stream was read with " + ", ".join(
                        f"{name} {old}" for name, (old, _) in differs.items())
                    + "; this run has " + ", ".join(
                        f"{name} {new}" for name, (_, new) in differs.items())
                    + ": resume with the same shards, seed, processes and --num-workers "
                    "(or start afresh with --overwrite)")
            fresh = saved
        self._batch_size, self._collate, self._state = batch_size, collate, fresh
        self._num_workers = workers
        return fresh

    def loader(self, generator: torch.Generator | None = None,
               worker_init_fn: Callable[[int], None] | None = None,
               pin_memory: bool = False) -> torch.utils.data.DataLoader:
        """A DataLoader of `StreamBatch`es for the configured rank (see `configure`)."""
        if self._state is None:
            raise RuntimeError("ShardStream.configure must be called before loader()")
        return torch.utils.data.DataLoader(
            self, batch_size=None, num_workers=self._num_workers, generator=generator,
            worker_init_fn=worker_init_fn if self._num_workers else None,
            pin_memory=pin_memory, collate_fn=_identity)

    def __iter__(self) -> Iterator[StreamBatch]:
        state = self._state
        if state is None:
            raise RuntimeError("ShardStream.configure must be called before iterating")
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        role = (worker + state.batches) % state.workers
        slot_count = state.world_size * state.workers
        slot = role * state.world_size + state.rank
        ordinal, consumed = state.slots[role]
        problems = ShardProblems()
        items, names, no_image, idle = [], [], 0, 0
        while True:
            position = ordinal * slot_count + slot
            epoch, within = divmod(position, len(self.shards))
            shard_index = self.shard_order(epoch)[within]
            read_any = consumed > 0  # resumed at a shard's end: read before, not empty
            for sample in self._blocks(shard_index, epoch, consumed, problems):
                read_any = True
                consumed += 1
                if self.select is not None and not self.select(sample):
                    continue
                item = self.decode(sample)
                if item is None:
                    no_image += 1
                    logger.debug("skipping %s: no image (fields %s)", sample.name,
                                 sorted(sample.fields))
                    continue
                items.append(item)
                if not isinstance(item, UndecodableImage):  # the collate drops those
                    names.append((epoch, sample.shard, sample.key))
                if len(items) == self._batch_size:
                    yield StreamBatch(self._collate(items), names, role, (ordinal, consumed),
                                      no_image, list(problems.truncated))
                    items, names, no_image = [], [], 0
                    problems.truncated.clear()  # the shard being read still holds it
            idle = 0 if read_any else idle + 1
            if idle >= slot_count * len(self.shards):
                raise ValueError(f"worker {role} of rank {state.rank} read no sample from "
                                 f"{idle} shards in a row: are the shards of {self.spec} "
                                 "empty?")
            ordinal, consumed = ordinal + 1, 0

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description for the run configuration."""
        return {"type": type(self).__name__, "shards": len(self.shards),
                "first": self.shards[0], "last": self.shards[-1], "seed": self.seed,
                "shuffle": self.shuffle, "shuffle_block": self.shuffle_block}


def _identity(batch: Any) -> Any:
    return batch


def escape_name(text: str) -> str:
    """A shard or member name as one line of UTF-8 without tabs, reversibly (`unescape_name`).

    Names are bytes: tar member names and file names that are not UTF-8 arrive with
    surrogate escapes, and any may hold a newline or a tab. Those bytes, other control
    characters and backslashes are written as Python escapes (`\\xff`, `\\x0a`, `\\\\`); other
    text is kept as it is.
    """
    raw = text.encode("utf-8", "surrogateescape").replace(b"\\", b"\\\\")
    raw = re.sub(rb"[\x00-\x1f\x7f]", lambda match: b"\\x%02x" % match.group()[0], raw)
    return raw.decode("utf-8", "backslashreplace")  # bytes that are not UTF-8: \\xff


def unescape_name(text: str) -> str:
    """The name `escape_name` escaped."""
    return codecs.escape_decode(text.encode("utf-8"))[0].decode("utf-8", "surrogateescape")


class SampleLog:
    """samples/rank_R.tsv: `step, epoch, shard, key` for every sample a step trained on
    (not the ones it skipped), names escaped by `escape_name`.

    On a resume, lines after the checkpoint's step are dropped, so the file reads as the
    log of one uninterrupted run.
    """

    def __init__(self, run_dir: Path, rank: int, resumed_step: int | None) -> None:
        from vlm_vit.files import atomic_write

        folder = Path(run_dir) / SAMPLES_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank_{rank}.tsv"
        if resumed_step is not None and self.path.is_file():
            kept = [line + "\n" for line in _log_lines(self.path)
                    if int(line.split("\t", 1)[0]) <= resumed_step]
            with atomic_write(self.path, "w") as handle:
                handle.writelines(kept)
        elif self.path.exists():
            self.path.unlink()
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, step: int, samples: Sequence[tuple[int, str, str]]) -> None:
        self._file.writelines(f"{step}\t{epoch}\t{escape_name(shard)}\t{escape_name(key)}\n"
                              for epoch, shard, key in samples)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _log_lines(path: Path) -> list[str]:
    """The whole lines of a sample log (a line cut by a kill has no newline: dropped)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    return lines[:-1]


def read_sample_log(run_dir: str | Path, rank: int = 0) -> list[tuple[int, int, str, str]]:
    """The (step, epoch, shard, key) lines a run's `SampleLog` wrote for `rank`."""
    path = Path(run_dir) / SAMPLES_DIR / f"rank_{rank}.tsv"
    rows = []
    for line in _log_lines(path):
        step, epoch, shard, key = line.split("\t")
        rows.append((int(step), int(epoch), unescape_name(shard), unescape_name(key)))
    return rows


def rank_shards(shards: Sequence[str], rank: int, world_size: int) -> list[int]:
    """The indices of the shards rank `rank` of `world_size` handles in a single pass
    (encoding): every world_size-th, so uneven counts differ by at most one shard."""
    return list(range(rank, len(shards), world_size))


__all__ = ["ImageDecode", "KeySplit", "LabelledBatches", "LabelledDecode", "Sample",
           "SampleLog", "ShardProblems", "ShardStream", "StreamBatch", "StreamState",
           "escape_name", "expand_shards", "held_out", "is_shard_spec", "iter_samples",
           "rank_shards", "read_dataset_index", "read_sample_log", "read_shard", "unescape_name"]
