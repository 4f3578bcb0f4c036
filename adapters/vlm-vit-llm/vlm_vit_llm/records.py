"""LLaVA's conversation data, indexed once and read one record at a time.

    records = ConversationRecords("llava_v1_5_mix665k.json", "images/")
    records[0]        # Record(id, turns=[Turn("user", "<image>\\nWhat is ..."), ...], images=[...])

The format (LLaVA-Instruct-150K, ShareGPT4V, LLaVA-1.5's 665k mix, LLaVA-OneVision): a JSON
array of records, or JSON lines with one record per line:

    {"id": "000000033471", "image": "coco/train2017/000000033471.jpg",
     "conversations": [{"from": "human", "value": "<image>\\nWhat are the colors of the bus?"},
                       {"from": "gpt", "value": "The bus is white and red."}, ...]}

`image` is one path, a list of paths (in placeholder order) or absent (a text-only record).
Instead of `image`, `video` is one clip given as its frames, a list of image paths in time
order (LLaVA-Video's records, their video decoded to frames beforehand); its one `<image>`
stands for the whole clip, for a tower with temporal patches. Beside it, `fps` (a positive
number) is the frames' rate, which Qwen2.5-VL's positions and Qwen3-VL's timestamps follow
(without it, transformers' 24). Paths are relative to the
image folder, and one that resolves outside it (`..`, an absolute path, a symbolic link out)
is a bad record. Each `<image>` in a human turn stands for the next image. Roles are
`human`/`user`, `gpt`/`assistant` and `system`; turns may also be spelled
`{"role": ..., "content": ...}`. A record names at most `MAX_IMAGES` images (a video at most
`MAX_FRAMES` frames).

Indexing parses every record once, checks it, and keeps only where it lies in the file (byte
offsets in numpy arrays), so a 665k-record file is not held as Python objects and forked
DataLoader workers share the index. A record that fails a check is skipped, counted and
named (file, line, id), or refused with `strict=True`: besides the checks of `parse_record`,
a line that is not JSON or nests too deeply, and a lone surrogate (`"\\ud800"`) in a text or
a path.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from vlm_vit.io.files import resolves_inside
from vlm_vit_llm.batch_types import Video

logger = logging.getLogger(__name__)

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "system": "system"}
MAX_FRAMES = 1024  # frames of one video record
# Images of one record: LLaVA-OneVision's and LLaVA-Interleave's multi-image records hold a
# few dozen; 10,000 `<image>` naming one small file would decode 13.5 GB of pixels at 336 px.
MAX_IMAGES = 256
NAMED_SKIPS = 20  # bad records named one by one in the log; the rest are only counted


class Turn(NamedTuple):
    """One message: `role` is "system", "user" or "assistant"."""

    role: str
    text: str


class Record(NamedTuple):
    """One conversation.

    Attributes:
        where: how messages name it (`file:line (id ...)`).
        turns: the messages in order.
        images: absolute image paths in placeholder order; a video is one `Video` of its
            frames' paths.
    """

    where: str
    turns: list[Turn]
    images: list[Path | Video]


class BadRecord(ValueError):
    """A record that cannot be used; the message names it and says why.

    Attributes:
        where: the record (`file:line (id ...)`).
        reason: what is wrong with it.
        kind: a short category, for the counts.
    """

    def __init__(self, where: str, reason: str, kind: str):
        super().__init__(f"{where}: {reason}")
        self.where, self.reason, self.kind = where, reason, kind


@dataclass
class SkippedRecords:
    """What indexing left out: a count per reason and the first few records by name."""

    count: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    named: list[str] = field(default_factory=list)

    def add(self, where: str, reason: str, kind: str) -> None:
        self.count += 1
        self.by_reason[kind] = self.by_reason.get(kind, 0) + 1
        if len(self.named) < NAMED_SKIPS:
            self.named.append(f"{where}: {reason}")
            logger.warning("skipping %s: %s", where, reason)


def _has_surrogate(text: str) -> bool:
    """Whether `text` holds a lone surrogate (JSON's `"\\ud800"`), which is no character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_record(raw: Any, where: str, image_folder: Path, image_token: str = "<image>",
                 check_files: bool = True, folder_root: Path | None = None,
                 image_text: str | None = None) -> Record:
    """Checks one parsed record and returns it with roles mapped and paths resolved.

    Args:
        image_text: what each `image_token` becomes in the returned turns, for a model whose
            prompts wrap an image in its own tokens (Qwen-VL's
            `<|vision_start|><|image_pad|><|vision_end|>`); None keeps it.
        folder_root: `image_folder` resolved; when given, an image path that resolves
            outside it (`..`, an absolute path, a symbolic link out) is a bad record, with
            `check_files` or not. None: the names are not paths (a shard's records).

    Raises:
        BadRecord: naming `where` and what is wrong.
    """

    def bad(reason: str, kind: str) -> BadRecord:
        return BadRecord(where, reason, kind)

    if not isinstance(raw, dict):
        raise bad(f"a record must be a JSON object, got {type(raw).__name__}", "not an object")
    conversation = raw.get("conversations", raw.get("messages"))
    if not isinstance(conversation, list) or not conversation:
        raise bad("'conversations' must be a non-empty list of turns", "empty conversation")
    turns = []
    for number, turn in enumerate(conversation):
        if not isinstance(turn, dict):
            raise bad(f"turn {number} is not an object", "malformed turn")
        role = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if role not in ROLES:
            raise bad(f"turn {number} has unknown role {role!r} (known: {sorted(ROLES)})",
                      "unknown role")
        if not isinstance(text, str):
            raise bad(f"turn {number} has no text ('value' or 'content' string)",
                      "malformed turn")
        if _has_surrogate(text):
            raise bad(f"turn {number} holds a lone surrogate (a \\ud800-\\udfff escape that "
                      "is no character)", "lone surrogate")
        if ROLES[role] != "user" and image_token in text:
            raise bad(f"turn {number} ({role}) holds {image_token!r}; images go in human turns",
                      "placeholder outside a human turn")
        turns.append(Turn(ROLES[role], text))
    if not any(turn.role == "assistant" for turn in turns):
        raise bad("no assistant ('gpt') turn to learn", "no assistant turn")

    names = _visual_names(raw, bad)
    placeholders = sum(turn.text.count(image_token) for turn in turns)
    if placeholders != len(names):
        raise bad(f"{placeholders} {image_token!r} placeholder(s) but {len(names)} image(s)",
                  "placeholders do not match images")
    if image_text is not None:
        turns = [Turn(turn.role, turn.text.replace(image_token, image_text)) for turn in turns]
    files = [name for item in names for name in ([item] if isinstance(item, str) else item)]
    if any(_has_surrogate(name) for name in files):
        raise bad(f"an image path holds a lone surrogate: {ascii(files)[:80]}", "lone surrogate")
    if folder_root is not None:
        for name in files:
            if not resolves_inside(image_folder / name, folder_root):
                raise bad(f"image {name!r} resolves outside the image folder {image_folder}",
                          "image outside the image folder")
    if check_files:
        for name in files:
            if not (image_folder / name).is_file():
                raise bad(f"no image {image_folder / name}", "missing image")
    fps = _video_fps(raw, bad)
    return Record(where, turns, [image_folder / item if isinstance(item, str)
                                 else Video(tuple(image_folder / name for name in item), fps)
                                 for item in names])


def _video_fps(raw: dict, bad: Callable[[str, str], BadRecord]) -> float | None:
    """A video record's `fps`, or None when it gives none."""
    fps = raw.get("fps")
    if fps is None:
        return None
    if raw.get("video") is None:
        raise bad("'fps' is a video's frame rate: the record holds no 'video'", "malformed fps")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < 1e6:
        raise bad(f"'fps' must be a positive number (frames a second), got {fps!r:.40}",
                  "malformed fps")
    return float(fps)


def _visual_names(raw: dict, bad: Callable[[str, str], BadRecord]) -> list[str | tuple]:
    """The record's images in placeholder order, a video as one tuple of its frames."""
    image, video = raw.get("image", raw.get("images")), raw.get("video")
    if video is not None:
        if image is not None:
            raise bad("a record holds 'image' or 'video', not both", "image and video")
        if isinstance(video, str):
            raise bad(f"'video' must be the clip's frames, a list of image paths, got "
                      f"{video!r:.80} (decode a video file to frames first)",
                      "malformed video field")
        if not isinstance(video, list) or not video or len(video) > MAX_FRAMES or not all(
                isinstance(n, str) and n for n in video):
            raise bad(f"'video' must be a list of 1 to {MAX_FRAMES} frame paths, got "
                      f"{video!r:.80}", "malformed video field")
        return [tuple(video)]
    names = [] if image is None else [image] if isinstance(image, str) else image
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise bad(f"'image' must be a path or a list of paths, got {image!r:.80}",
                  "malformed image field")
    if len(names) > MAX_IMAGES:
        raise bad(f"'image' names {len(names)} images, more than the {MAX_IMAGES} a record "
                  "may hold (MAX_IMAGES)", "too many images")
    return names


def _where(path: Path, line: int, raw: Any) -> str:
    record_id = raw.get("id") if isinstance(raw, dict) else None
    if isinstance(record_id, str) and _has_surrogate(record_id):
        record_id = ascii(record_id)
    return f"{path}:{line}" + (f" (id {record_id})" if record_id is not None else "")


class ConversationRecords:
    """The checked records of a LLaVA-format JSON or JSON lines file (see the module).

    Args:
        path: the `.json` (an array of records) or `.jsonl` file; the format is told by the
            first non-space character.
        image_folder: where the records' image paths start (LLaVA's `--image_folder`).
        image_token: the placeholder in human turns.
        image_text: what the placeholder becomes in the model's prompts (`parse_record`).
        strict: refuse the file at its first bad record instead of skipping it.
        check_files: check at indexing that every image exists (one `stat` per image).

    Attributes:
        skipped: what was left out, with reasons.
        image_counts: `[N]` images per record.
        text_lengths: `[N]` characters of text per record (for length-grouped batches).

    Raises:
        FileNotFoundError: for a missing file or image folder.
        ValueError: for a JSON array that does not parse or nests too deeply (naming the
            line), one that is not UTF-8, an empty result, or with `strict`, the first bad
            record (naming it).
    """

    def __init__(self, path: str | Path, image_folder: str | Path, *,
                 image_token: str = "<image>", strict: bool = False, check_files: bool = True,
                 image_text: str | None = None):
        self.path, self.image_folder = Path(path), Path(image_folder)
        self.image_token, self.check_files = image_token, check_files
        self.image_text = image_text
        if not self.path.is_file():
            raise FileNotFoundError(f"no conversation file {self.path}")
        if not self.image_folder.is_dir():
            raise FileNotFoundError(f"no image folder {self.image_folder}")
        self._root = self.image_folder.resolve()
        self.strict = strict
        self.skipped = SkippedRecords()
        spans: list[tuple[int, int, int, int, int]] = []  # start, end, line, images, chars
        self.has_videos = False  # a video's tokens vary by its frames: counts are lower bounds
        for start, end, line, raw, error in self._scan():
            where = _where(self.path, line, raw)
            try:
                if error is not None:
                    raise BadRecord(where, f"not JSON ({error})", "not JSON")
                record = parse_record(raw, where, self.image_folder, image_token, check_files,
                                      self._root, image_text)
            except BadRecord as bad:
                if strict:
                    raise ValueError(str(bad)) from None
                self.skipped.add(where, bad.reason, bad.kind)
                continue
            chars = sum(len(turn.text) for turn in record.turns)
            self.has_videos |= any(isinstance(item, Video) for item in record.images)
            spans.append((start, end, line, len(record.images), chars))
        if not spans:
            raise ValueError(f"{self.path} holds no usable records"
                             + (f" ({self.skipped.count} skipped: {self.skipped.by_reason})"
                                if self.skipped.count else ""))
        table = np.array(spans, dtype=np.int64)
        self.starts, self.ends, self.lines = table[:, 0], table[:, 1], table[:, 2]
        self.image_counts, self.text_lengths = table[:, 3], table[:, 4]
        if self.skipped.count:
            logger.warning("%s: using %d records, skipped %d (%s)", self.path, len(self),
                           self.skipped.count, ", ".join(
                               f"{n} {k}" for k, n in sorted(self.skipped.by_reason.items())))

    def _scan(self):
        """Yields (byte start, byte end, line, parsed record or None, JSON error or None)."""
        with self.path.open("rb") as handle:
            head = handle.read(4096).lstrip()
        if head.startswith(b"["):
            yield from self._scan_array()
        else:
            yield from self._scan_lines()

    def _scan_lines(self):
        offset = 0
        with self.path.open("rb") as handle:
            for line, raw in enumerate(handle, 1):
                start, offset = offset, offset + len(raw)
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as error:
                    yield start, offset, line, None, error
                except RecursionError:
                    yield start, offset, line, None, "nested too deeply"
                else:
                    yield start, offset, line, record, None

    def _scan_array(self):
        """One element at a time with `raw_decode`: each record is parsed, then dropped."""
        # Decoded from bytes, not read as text: universal newlines would turn CRLF into LF and
        # every byte offset after the first line end would be off.
        try:
            text = self.path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{self.path} is not UTF-8 text: {error}") from None
        decoder = json.JSONDecoder()
        position = text.index("[") + 1
        byte_position, char_position, line = len(text[:position].encode()), position, 1
        line += text.count("\n", 0, position)

        def skip(position: int) -> int:
            while position < len(text) and text[position] in " \t\r\n":
                position += 1
            return position

        position = skip(position)
        if position < len(text) and text[position] == "]":
            return
        while True:
            # Byte offsets follow the characters read so far (the file may not be ASCII).
            byte_position += len(text[char_position:position].encode())
            line += text.count("\n", char_position, position)
            char_position = position
            try:
                raw, end = decoder.raw_decode(text, position)
            except json.JSONDecodeError as error:
                raise ValueError(f"{self.path} is not a JSON array of records: {error}") from None
            except RecursionError:
                raise ValueError(f"{self.path}: the record at line {line} is nested too deeply "
                                 "to read") from None
            end_bytes = byte_position + len(text[position:end].encode())
            yield byte_position, end_bytes, line, raw, None
            position = skip(end)
            if position < len(text) and text[position] == ",":
                position = skip(position + 1)
            elif position < len(text) and text[position] == "]":
                return
            else:
                where = f"line {line + text.count(chr(10), char_position, position)}"
                raise ValueError(f"{self.path} is not a JSON array of records: expected ',' "
                                 f"or ']' at {where}")

    def limit_length(self, max_length: int, image_tokens: int, *, exact: bool = True) -> int:
        """Drops the records whose images alone take more than `max_length` positions, from
        the counts at indexing, so none of their images is ever decoded (a record with 10,000
        `<image>` would be read in full before the collate refused it). Skipped and named as
        bad records, or refused with `strict`.

        Args:
            max_length: the longest sequence, image positions included.
            image_tokens: positions one image takes in the LLM.
            exact: False when `image_tokens` is only the fewest an image can take (a tiled
                tower's count varies by image size): a record is dropped only when its images
                cannot fit at any size.

        Returns:
            How many records were dropped.

        Raises:
            ValueError: with `strict`, naming the first such record; when no record is left.
        """
        too_long = self.image_counts * image_tokens > max_length
        at_least = "" if exact else "at least "
        for index in np.flatnonzero(too_long):
            count = int(self.image_counts[index])
            reason = (f"its {count} image(s) take {at_least}{count * image_tokens} tokens, "
                      f"more than max_length {max_length}")
            where = self._named(int(index))
            if self.strict:
                raise ValueError(f"{where}: {reason}")
            self.skipped.add(where, reason, "images longer than max_length")
        dropped = int(too_long.sum())
        if not dropped:
            return 0
        if dropped == len(self):
            raise ValueError(f"{self.path} holds no record whose images fit in max_length "
                             f"{max_length} ({at_least}{image_tokens} tokens an image)")
        keep = ~too_long
        self.starts, self.ends, self.lines = self.starts[keep], self.ends[keep], self.lines[keep]
        self.image_counts, self.text_lengths = self.image_counts[keep], self.text_lengths[keep]
        return dropped

    def _named(self, index: int) -> str:
        """`file:line (id ...)` of record `index`; its id is read back only while the skipped
        records are still named one by one (`NAMED_SKIPS`)."""
        if len(self.skipped.named) >= NAMED_SKIPS and not self.strict:
            return self.where(index)
        try:
            return _where(self.path, int(self.lines[index]), json.loads(self._read(index)))
        except (ValueError, RecursionError):  # changed since indexing: its line names it
            return self.where(index)

    def _read(self, index: int) -> bytes:
        start, end = int(self.starts[index]), int(self.ends[index])
        with self.path.open("rb") as handle:
            handle.seek(start)
            return handle.read(end - start)

    def __len__(self) -> int:
        return len(self.starts)

    def where(self, index: int) -> str:
        return f"{self.path}:{int(self.lines[index])}"

    def __getitem__(self, index: int) -> Record:
        """Reads and checks record `index` from the file (cheap: one seek and one parse).

        Raises:
            BadRecord: naming the record, when the file changed since indexing.
        """
        try:
            raw = json.loads(self._read(index))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
            reason = "nested too deeply" if isinstance(error, RecursionError) else error
            raise BadRecord(self.where(index), f"not JSON ({reason}); was the file changed "
                            "after indexing?", "not JSON") from None
        return parse_record(raw, _where(self.path, int(self.lines[index]), raw),
                            self.image_folder, self.image_token, check_files=False,
                            folder_root=self._root, image_text=self.image_text)
