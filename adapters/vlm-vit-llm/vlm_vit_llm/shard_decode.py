"""Tar shards (`vlm-vit shards --captions` / `--llava`) stream through `ShardStream` with
`CaptionShardDecode` / `ConversationShardDecode`, which give the same items as `CaptionFolder`
/ `ConversationDataset`, for the same collates:

    stream = ShardStream("shards/{00000..00031}.tar", CaptionShardDecode(mm.processor))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlm_vit import ImageProcessor
from vlm_vit.data.samples import UndecodableImage
from vlm_vit_llm.conversation_batch import Pixels, load_pixels
from vlm_vit_llm.conversations import ConversationItem
from vlm_vit_llm.records import BadRecord, parse_record


def _shard_pixels(processor: ImageProcessor, sample: Any, data: bytes) -> Pixels:
    """A sample's encoded image, decoded and preprocessed as `load_pixels` does a file.

    Raises:
        ValueError: naming `shard:key` when it does not decode or is too large.
    """
    return load_pixels(processor, processor.load(data, f"image {sample.name}"))


def _own_reason(error: ValueError, name: str) -> str:
    """An error's message without the leading `name: ` (the marker names the sample)."""
    return str(error).removeprefix(f"{name}: ")


class CaptionShardDecode:
    """A caption shard sample as a `CaptionFolder` item, for `ShardStream`: the image through
    the inference preprocessing, the caption from the `txt` field (else the `json` field's
    "caption"), the prompt from the `json` field's "prompt" (else None: the collate's).

    Small and picklable: each DataLoader worker holds a copy.

    Returns (from a call on a `Sample`): `(pixels, caption, prompt or None)`, the pixels as
    `load_pixels` gives them;
    `(UndecodableImage, caption, prompt)` for an image that does not decode, and
    `(UndecodableImage, "", None)` for a bad record (no caption; a json field that is not a
    JSON object; a prompt that is not a string holding the image token once), each naming
    `shard:key` (`CaptionCollate` drops them, the trainer counts and names them); None for a
    sample without an image (the stream counts those as "no image").

    Args:
        processor: the tower's preprocessing.
        image_token: what a record's own prompt must hold once.
    """

    def __init__(self, processor: ImageProcessor, image_token: str = "<image>"):
        self.processor, self.image_token = processor, image_token

    def __call__(self, sample: Any
                 ) -> tuple[Pixels | UndecodableImage, str, str | None] | None:
        data = sample.image()
        if data is None:
            return None
        try:
            meta = sample.json() if "json" in sample.fields else {}
            if not isinstance(meta, dict):
                raise ValueError(f"its json field is a {type(meta).__name__}, not an object")
            caption = sample.text("txt") if "txt" in sample.fields else meta.get("caption")
            prompt = meta.get("prompt")
            if not isinstance(caption, str) or not caption:
                raise ValueError("no caption (a txt field, or a string 'caption' in its json "
                                 "field)")
            if prompt is not None and (not isinstance(prompt, str)
                                       or prompt.count(self.image_token) != 1):
                raise ValueError(f"its prompt must be a string holding {self.image_token!r} "
                                 f"once, got {prompt!r:.80}")
        except ValueError as error:
            return UndecodableImage(sample.name, _own_reason(error, sample.name)), "", None
        try:
            return _shard_pixels(self.processor, sample, data), caption, prompt
        except ValueError as error:  # ImageLoadError, ImageTooLargeError
            return UndecodableImage(sample.name, str(error)), caption, prompt


class ConversationShardDecode:
    """A LLaVA shard sample as a `ConversationDataset` item, for `ShardStream`: the record
    from the `json` field, checked by `parse_record` as a file's records are, and its image
    from the sample's image field (`jpg`, `png`, ...).

    A record without an "image" whose sample holds an image takes that image (placeholders
    must still match); a text-only record (no placeholder, no image) is an item without
    pixels, not a sample without an image. Small and picklable: each DataLoader worker holds
    a copy.

    Returns (from a call on a `Sample`): a `ConversationItem` named `shard:key (id ...)`, or
    an `UndecodableImage` naming it with the reason (`ConversationCollate` drops it, the
    trainer counts and names it) when: its json field is missing or not JSON; the record
    fails a check; it needs an image the sample lacks, or more than the one a sample holds;
    or its image does not decode. Never None: every sample is a record.

    Args:
        processor: the tower's preprocessing.
        image_token: the placeholder in human turns.
    """

    def __init__(self, processor: ImageProcessor, image_token: str = "<image>"):
        self.processor, self.image_token = processor, image_token

    def __call__(self, sample: Any) -> ConversationItem | UndecodableImage:
        where = sample.name
        try:
            raw = sample.json()
        except ValueError as error:
            return UndecodableImage(where, _own_reason(error, where))
        if raw is None:
            return UndecodableImage(where, f"no json field to hold the record (fields "
                                    f"{sorted(sample.fields)})")
        data = sample.image()
        if isinstance(raw, dict):
            if raw.get("id") is not None:
                where = f"{where} (id {raw['id']})"
            if raw.get("video") is not None:
                return UndecodableImage(where, "it is a video record (its frames); a shard "
                                        "sample holds one image: train videos from a folder")
            if data is not None and raw.get("image", raw.get("images")) is None:
                raw = {**raw, "image": sample.key}  # the sample's own image
        try:
            # Only the names' count matters: the image comes from the sample, not a folder.
            record = parse_record(raw, where, Path(), self.image_token, check_files=False)
        except BadRecord as bad:
            return UndecodableImage(where, bad.reason)
        if len(record.images) > 1:
            return UndecodableImage(where, f"it names {len(record.images)} images; a shard "
                                    "sample holds one")
        if not record.images:
            return ConversationItem(where, record.turns, [])
        if data is None:
            return UndecodableImage(where, f"it needs image {record.images[0].as_posix()!r} but "
                                    f"the sample holds none (fields {sorted(sample.fields)})")
        try:
            pixels = _shard_pixels(self.processor, sample, data)
        except ValueError as error:  # ImageLoadError, ImageTooLargeError
            return UndecodableImage(where, str(error))
        return ConversationItem(where, record.turns, [pixels])
