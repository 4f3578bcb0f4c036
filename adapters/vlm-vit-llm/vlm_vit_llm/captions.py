"""Captioned images, for LLaVA's two training stages: a folder of images and its captions
file, read as `CaptionFolder` items and batched by `CaptionCollate` (`vlm_vit_llm.train`).

Captions file: JSON lines, one per image, `{"image": "relative/path.jpg", "caption": "..."}`
(paths relative to the image folder). A line may carry its own `"prompt"` (with the image
token once), as instruction data does (`{"image": ..., "prompt": "<image>\nWhat is it?",
"caption": "A dog."}`); the others get the collate's prompt. The loss is on the caption tokens
(and the end of sequence) only, never on the prompt or the image positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from vlm_vit import ImageProcessor
from vlm_vit.data.folders import read_caption_lines
from vlm_vit.data.samples import ImageBatch, UndecodableImage
from vlm_vit.io.files import resolves_inside
from vlm_vit_llm.batch_types import IGNORE_INDEX, TiledImage
from vlm_vit_llm.conversation_batch import (
    ImageTokens,
    Pixels,
    _expanded_length,
    _flattened,
    _max_length,
    _packed_batch,
    _records_batch,
    load_pixels,
)
from vlm_vit_llm.model import MultimodalLM, target_ids


class Caption(NamedTuple):
    """One line of a captions file."""

    image: Path
    caption: str
    prompt: str | None = None  # None: the collate's prompt


def read_captions(captions_file: str | Path, root: str | Path) -> list[Caption]:
    """The lines of a JSON lines captions file (see the module docstring).

    Raises:
        FileNotFoundError: for a missing captions file or image (naming the line).
        ValueError: for a line that is not an object with string "image" and "caption" (and
            a string "prompt", if any), a line whose image resolves outside `root` (`..`, an
            absolute path, a symbolic link out), or an empty file.
    """
    root = Path(root)
    resolved_root = root.resolve()
    rows = []
    for where, row in read_caption_lines(captions_file):
        path = root / row["image"]
        if not resolves_inside(path, resolved_root):
            raise ValueError(f"{where}: image {row['image']!r} resolves outside the image "
                             f"folder {root}")
        if not path.is_file():
            raise FileNotFoundError(f"{where}: no image {path}")
        rows.append(Caption(path, row["caption"], row.get("prompt")))
    return rows


class CaptionFolder(torch.utils.data.Dataset):
    """Images with captions (see the module docstring), preprocessed as at inference.

    Items are `(pixels, caption, prompt or None)`, the pixels as `load_pixels` gives them
    (`[3, H, W]`, or a `TiledImage` for a tiled tower), with an `UndecodableImage` in
    place of the pixels for a file that does not decode (the trainer skips it and names it).
    """

    def __init__(self, root: str | Path, captions_file: str | Path, processor: ImageProcessor):
        self.root = Path(root)
        self.rows = read_captions(captions_file, root)
        self.processor = processor

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[Pixels | UndecodableImage, str, str | None]:
        path, caption, prompt = self.rows[index]
        try:
            return load_pixels(self.processor, path), caption, prompt
        except ValueError as error:  # ImageLoadError, ImageTooLargeError
            return UndecodableImage(str(path), str(error)), caption, prompt


class CaptionCollate:
    """Collates `CaptionFolder` items into an `ImageBatch` whose labels are `[B, 2, L]` token
    ids padded with `IGNORE_INDEX`: row 0 the prompt (the item's own, else `prompt`), row 1 the
    caption and end of sequence. Holds only the tokenizer, so it pickles cheaply into
    DataLoader workers.

    With `packing`, the batch is instead a `ConversationBatch` (prompt and caption as one
    record each) packed into rows of at most `max_length` tokens (`vlm_vit_llm.packing`); a
    record longer than that is dropped and named (a tiled image counts the tokens of its
    original size). Unpacked with a tiled tower, the batch is that `ConversationBatch`
    without a packing plan (one padded row per caption): tiled images do not stack.

    Args:
        mm: the model whose tokenizer and image token to use.
        prompt: the prompt of items without their own.
        packing: pack records into rows instead of one padded row each.
        max_length: with `packing`, the longest row, image tokens included (default: the
            LLM's context).

    Raises:
        ValueError: for a prompt without exactly one image token (at collation for an item's
            own prompt, naming it).
    """

    def __init__(self, mm: MultimodalLM, prompt: str = "<image>\n", *, packing: bool = False,
                 max_length: int | None = None):
        self.tokenizer, self.image_token = mm.tokenizer, mm.image_token
        self.prompt = self._checked(prompt)
        self.packing, self.tiled = packing, mm.tower.tiling is not None
        self.image_token_id = mm.image_token_id
        if packing:
            self.count_tokens = ImageTokens.of(mm)
            self.image_tokens = self.count_tokens.fixed
            self.max_length = _max_length(mm, max_length)

    def _checked(self, prompt: str) -> str:
        if prompt.count(self.image_token) != 1:
            raise ValueError(f"a prompt must hold the image token {self.image_token!r} exactly "
                             f"once, got {prompt!r}")
        return prompt

    def __call__(self, items: Sequence[tuple[Any, str, str | None]]) -> ImageBatch:
        items = _flattened(items)
        good = [item for item in items if isinstance(item[0], (torch.Tensor, TiledImage))]
        bad = [item[0] for item in items if isinstance(item[0], UndecodableImage)]
        if self.packing:
            return self._packed(good, bad)
        if self.tiled:
            return ImageBatch(_records_batch([self._record(*item) for item in good]), bad)
        if not good:
            return ImageBatch(torch.zeros(0, 3, 1, 1), bad,
                              torch.zeros(0, 2, 1, dtype=torch.long))
        rows = [(list(self.tokenizer(self._checked(prompt or self.prompt))["input_ids"]),
                 target_ids(self.tokenizer, caption)) for _, caption, prompt in good]
        length = max(len(part) for row in rows for part in row)
        labels = torch.full((len(rows), 2, length), IGNORE_INDEX, dtype=torch.long)
        for index, row in enumerate(rows):
            for part, ids in enumerate(row):
                labels[index, part, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        return ImageBatch(torch.stack([item[0] for item in good]), bad, labels)

    def _record(self, pixels: Pixels, caption: str, prompt: str | None
                ) -> tuple[list[int], list[int], list[Pixels]]:
        """One caption as a record: ids, labels (the caption's tokens only) and its image."""
        prompt_ids = list(self.tokenizer(self._checked(prompt or self.prompt))["input_ids"])
        target = target_ids(self.tokenizer, caption)
        return prompt_ids + target, [IGNORE_INDEX] * len(prompt_ids) + target, [pixels]

    def _packed(self, good: list, bad: list[UndecodableImage]) -> ImageBatch:
        rows = []
        for pixels, caption, prompt in good:
            ids, labels, images = self._record(pixels, caption, prompt)
            length = _expanded_length(ids, self.image_token_id,
                                      [self.count_tokens(pixels)])
            if length > self.max_length:
                bad.append(UndecodableImage(f"caption {caption[:40]!r}", f"its {length} tokens "
                                            f"are more than max_length {self.max_length}"))
                continue
            rows.append((ids, labels, images))
        return ImageBatch(_packed_batch(rows, self.image_token_id, self.count_tokens,
                                        self.max_length), bad)
