"""LLaVA's two training stages on vlm-vit's trainer, from a folder of images and captions.

    data = CaptionFolder("images/", "captions.jsonl", mm.processor)
    mm.train_projector_only()                          # stage 1: the projector alone
    # mm.add_lora(r=16)                                 # stage 2: + LoRA on the LLM
    objective = CaptionObjective(mm, prompt="<image>\\n")
    Trainer(objective, data, TrainConfig(...), "runs/s1",
            collate=CaptionCollate(mm.tokenizer)).fit()  # writes runs/s1/model/

Captions file: JSON lines, one per image, `{"image": "relative/path.jpg", "caption": "..."}`
(paths relative to the image folder). The loss is on the caption tokens (and the end of
sequence) only, never on the prompt or the image positions.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit import ImageProcessor
from vlm_vit.pretrain.base import ObjectiveOutput
from vlm_vit.train.data import ImageBatch, UndecodableImage
from vlm_vit_llm.model import IGNORE_INDEX, MultimodalLM, target_ids

MODEL_DIR = "model"  # where a run writes the trained multimodal model


def read_captions(captions_file: str | Path, root: str | Path) -> list[tuple[Path, str]]:
    """(image path, caption) pairs from a JSON lines file.

    Raises:
        FileNotFoundError: for a missing captions file or image (naming the line).
        ValueError: for a line that is not an object with string "image" and "caption", or
            an empty file.
    """
    captions_file, root = Path(captions_file), Path(root)
    if not captions_file.is_file():
        raise FileNotFoundError(f"no captions file {captions_file}")
    pairs = []
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
                    isinstance(row.get(key), str) for key in ("image", "caption")):
                raise ValueError(f"{where} needs string fields 'image' and 'caption', got "
                                 f"{line.strip()[:100]}")
            path = root / row["image"]
            if not path.is_file():
                raise FileNotFoundError(f"{where}: no image {path}")
            pairs.append((path, row["caption"]))
    if not pairs:
        raise ValueError(f"{captions_file} holds no captions")
    return pairs


class CaptionFolder(torch.utils.data.Dataset):
    """Images with captions (see the module docstring), preprocessed as at inference.

    Items are `(pixels [3, H, W], caption)`, or `(UndecodableImage, caption)` for a file that
    does not decode (the trainer skips it and names it).
    """

    def __init__(self, root: str | Path, captions_file: str | Path, processor: ImageProcessor):
        self.root = Path(root)
        self.pairs = read_captions(captions_file, root)
        self.processor = processor

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor | UndecodableImage, str]:
        path, caption = self.pairs[index]
        try:
            return self.processor.preprocess_one(path), caption
        except ValueError as error:  # ImageLoadError, ImageTooLargeError
            return UndecodableImage(str(path), str(error)), caption


class CaptionCollate:
    """Collates `CaptionFolder` items into an `ImageBatch` whose labels are the captions'
    token ids, `[B, L]`, padded with `IGNORE_INDEX`. Holds only the tokenizer, so it pickles
    cheaply into DataLoader workers."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def __call__(self, items: Sequence[tuple[Any, str]]) -> ImageBatch:
        good = [(image, caption) for image, caption in items
                if isinstance(image, torch.Tensor)]
        bad = [image for image, _ in items if isinstance(image, UndecodableImage)]
        if not good:
            return ImageBatch(torch.zeros(0, 3, 1, 1), bad, torch.zeros(0, 1, dtype=torch.long))
        rows = [target_ids(self.tokenizer, caption) for _, caption in good]
        labels = torch.full((len(rows), max(map(len, rows))), IGNORE_INDEX, dtype=torch.long)
        for index, row in enumerate(rows):
            labels[index, :len(row)] = torch.tensor(row, dtype=torch.long)
        return ImageBatch(torch.stack([image for image, _ in good]), bad, labels)


class CaptionObjective(nn.Module):
    """Caption loss for the trainer: `prompt` (with one image placeholder) then the caption.

    Set up the stage on `mm` first (`train_projector_only()` or `add_lora(...)`); frozen parts
    get no gradients, and a frozen encoder runs without an autograd graph.

    Args:
        mm: the multimodal model.
        prompt: what precedes each caption; must hold the image token once.
    """

    def __init__(self, mm: MultimodalLM, prompt: str = "<image>\n"):
        super().__init__()
        if prompt.count(mm.image_token) != 1:
            raise ValueError(f"the prompt must hold the image token {mm.image_token!r} "
                             f"exactly once, got {prompt!r}")
        self.mm = mm
        self.prompt = prompt

    @property
    def encoder(self) -> nn.Module:  # what the trainer records in run_config.json
        return self.mm.tower.encoder

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> ObjectiveOutput:
        targets = [row[row != IGNORE_INDEX].tolist() for row in labels]
        images = [[image] for image in pixel_values]
        out = self.mm([self.prompt] * len(targets), images, targets=targets)
        return ObjectiveOutput(out.loss, {"target_tokens": float(sum(map(len, targets)))})

    def export(self, run_dir: str | Path) -> Path:
        """Writes the whole multimodal model to `run_dir/model` (the trainer calls this)."""
        return self.mm.save_pretrained(Path(run_dir) / MODEL_DIR)
