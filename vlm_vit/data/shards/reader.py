"""Reading tar shards: raw samples, member by member, with nothing unpickled and every
member, shard and truncation bounded and named."""

from __future__ import annotations

import codecs
import json
import logging
import re
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from vlm_vit.optional import require

logger = logging.getLogger(__name__)

# A sample's image is the first of these fields it has (img2dataset writes `jpg`).
IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif", "ppm", "pgm")
# The most bytes one member may declare; a larger one is skipped unread, by name. Members are
# read whole into memory (an image, a caption, a json), and no training image is near 1 GiB,
# while a 1.5 KB sparse tar or a small .tar.gz can declare 10 GB.
MAX_MEMBER_BYTES = 2**30



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

