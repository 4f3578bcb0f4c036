"""LLaVA's two training stages on vlm-vit's trainer, from a folder of captioned images.

    data = CaptionFolder("images/", "captions.jsonl", mm.processor)
    mm.train_projector_only()                          # stage 1: the projector alone
    # mm.add_lora(r=16)                                 # stage 2: + LoRA on the LLM
    Trainer(CaptionObjective(mm), data, TrainConfig(...), "runs/s1",
            collate=CaptionCollate(mm, prompt="<image>\n")).fit()  # writes runs/s1/model/

Captions file: JSON lines, one per image, `{"image": "relative/path.jpg", "caption": "..."}`
(paths relative to the image folder). A line may carry its own `"prompt"` (with the image
token once), as instruction data does (`{"image": ..., "prompt": "<image>\nWhat is it?",
"caption": "A dog."}`); the others get the collate's prompt. The loss is on the caption tokens
(and the end of sequence) only, never on the prompt or the image positions.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from vlm_vit import ImageProcessor
from vlm_vit.pretrain.base import ObjectiveOutput
from vlm_vit.train.data import ImageBatch, UndecodableImage
from vlm_vit_llm.model import IGNORE_INDEX, MultimodalLM, target_ids

MODEL_DIR = "model"  # where a run writes the trained multimodal model


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
            a string "prompt", if any), or an empty file.
    """
    captions_file, root = Path(captions_file), Path(root)
    if not captions_file.is_file():
        raise FileNotFoundError(f"no captions file {captions_file}")
    rows = []
    with captions_file.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{captions_file} line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where} is not JSON: {error}") from None
            if not isinstance(row, dict) or not all(
                    isinstance(row.get(key), str) for key in ("image", "caption")) \
                    or not isinstance(row.get("prompt", ""), str):
                raise ValueError(f"{where} needs string fields 'image' and 'caption' (and "
                                 f"optionally 'prompt'), got {line.strip()[:100]}")
            path = root / row["image"]
            if not path.is_file():
                raise FileNotFoundError(f"{where}: no image {path}")
            rows.append(Caption(path, row["caption"], row.get("prompt")))
    if not rows:
        raise ValueError(f"{captions_file} holds no captions")
    return rows


class CaptionFolder(torch.utils.data.Dataset):
    """Images with captions (see the module docstring), preprocessed as at inference.

    Items are `(pixels [3, H, W], caption, prompt or None)`, with an `UndecodableImage` in
    place of the pixels for a file that does not decode (the trainer skips it and names it).
    """

    def __init__(self, root: str | Path, captions_file: str | Path, processor: ImageProcessor):
        self.root = Path(root)
        self.rows = read_captions(captions_file, root)
        self.processor = processor

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor | UndecodableImage, str, str | None]:
        path, caption, prompt = self.rows[index]
        try:
            return self.processor.preprocess_one(path), caption, prompt
        except ValueError as error:  # ImageLoadError, ImageTooLargeError
            return UndecodableImage(str(path), str(error)), caption, prompt


class CaptionCollate:
    """Collates `CaptionFolder` items into an `ImageBatch` whose labels are `[B, 2, L]` token
    ids padded with `IGNORE_INDEX`: row 0 the prompt (the item's own, else `prompt`), row 1 the
    caption and end of sequence. Holds only the tokenizer, so it pickles cheaply into
    DataLoader workers.

    Args:
        mm: the model whose tokenizer and image token to use.
        prompt: the prompt of items without their own.

    Raises:
        ValueError: for a prompt without exactly one image token (at collation for an item's
            own prompt, naming it).
    """

    def __init__(self, mm: MultimodalLM, prompt: str = "<image>\n"):
        self.tokenizer, self.image_token = mm.tokenizer, mm.image_token
        self.prompt = self._checked(prompt)

    def _checked(self, prompt: str) -> str:
        if prompt.count(self.image_token) != 1:
            raise ValueError(f"a prompt must hold the image token {self.image_token!r} exactly "
                             f"once, got {prompt!r}")
        return prompt

    def __call__(self, items: Sequence[tuple[Any, str, str | None]]) -> ImageBatch:
        good = [item for item in items if isinstance(item[0], torch.Tensor)]
        bad = [item[0] for item in items if isinstance(item[0], UndecodableImage)]
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


class CaptionObjective(nn.Module):
    """Caption loss for the trainer, on batches from `CaptionCollate`: each image's prompt,
    then its caption.

    Set up the stage on `mm` first (`train_projector_only()` or `add_lora(...)`); frozen parts
    get no gradients, and a frozen encoder runs without an autograd graph.
    """

    def __init__(self, mm: MultimodalLM):
        super().__init__()
        self.mm = mm

    @property
    def encoder(self) -> nn.Module:  # what the trainer records in run_config.json
        return self.mm.tower.encoder

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> ObjectiveOutput:
        prompts, targets = ([row[row != IGNORE_INDEX].tolist() for row in labels[:, part]]
                            for part in (0, 1))
        images = [[image] for image in pixel_values]
        out = self.mm(prompts, images, targets=targets)
        return ObjectiveOutput(out.loss, {"target_tokens": float(sum(map(len, targets)))})

    def export(self, run_dir: str | Path) -> Path:
        """Writes the whole multimodal model to `run_dir/model` (the trainer calls this)."""
        return self.mm.save_pretrained(Path(run_dir) / MODEL_DIR)
