"""LLaVA's two training stages on vlm-vit's trainer, from a folder of captioned images.

    data = CaptionFolder("images/", "captions.jsonl", mm.processor)
    mm.train_projector_only()                          # stage 1: the projector alone
    # mm.add_lora(r=16)                                 # stage 2: + LoRA on the LLM
    Trainer(CaptionObjective(mm), data, TrainConfig(...), "runs/s1",
            collate=CaptionCollate(mm, prompt="<image>\n")).fit()  # writes runs/s1/model/

This module holds the objectives the trainer runs (run_config.json records their module, and
a resumed run must match it) and the token-budget packs. The data lives beside it, each name
importable from here too: captioned images and the captions file's format
(`vlm_vit_llm.captions`), LLaVA's conversations (`vlm_vit_llm.conversations`), tar shards of
either (`vlm_vit_llm.shard_decode`), and the batch both collates build, tiled images included
(`vlm_vit_llm.conversation_batch`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vlm_vit.pretrain.base import ObjectiveOutput
from vlm_vit_llm.batch_types import IGNORE_INDEX
from vlm_vit_llm.captions import Caption, CaptionCollate, CaptionFolder, read_captions
from vlm_vit_llm.conversation_batch import (
    ConversationBatch,
    ImageTokens,
    Pixels,
    _checked_reduction,
    conversation_loss,
    load_pixels,
)
from vlm_vit_llm.conversations import (
    ConversationCollate,
    ConversationDataset,
    ConversationItem,
    truncate,
)
from vlm_vit_llm.model import MultimodalLM
from vlm_vit_llm.objective import BridgeObjective
from vlm_vit_llm.shard_decode import CaptionShardDecode, ConversationShardDecode

__all__ = ["Caption", "CaptionCollate", "CaptionFolder", "CaptionObjective",
           "CaptionShardDecode", "ConversationBatch", "ConversationCollate",
           "ConversationDataset", "ConversationItem", "ConversationObjective",
           "ConversationShardDecode", "ImageTokens", "Pixels", "TokenBudgetPacks",
           "conversation_loss", "load_pixels", "read_captions", "truncate"]


class CaptionObjective(BridgeObjective):
    """Caption loss for the trainer, on batches from `CaptionCollate`: each image's prompt,
    then its caption.

    Set up the stage on `mm` first (`train_projector_only()` or `add_lora(...)`); frozen parts
    get no gradients, and a frozen encoder runs without an autograd graph. Checkpoints hold
    what trains (`BridgeObjective`). Packed batches (`CaptionCollate(packing=True)`) train
    as `ConversationObjective` trains them, with `loss_reduction`; padded ones take the mean
    over each micro-batch's caption tokens, as before.
    """

    def __init__(self, mm: MultimodalLM, loss_reduction: str = "token"):
        super().__init__(mm)
        self.loss_reduction = _checked_reduction(loss_reduction)

    def forward(self, pixel_values: torch.Tensor | ConversationBatch,
                labels: torch.Tensor | None = None) -> ObjectiveOutput:
        if isinstance(pixel_values, ConversationBatch):
            return conversation_loss(self.mm, pixel_values, self.loss_reduction)
        prompts, targets = ([row[row != IGNORE_INDEX].tolist() for row in labels[:, part]]
                            for part in (0, 1))
        images = [[image] for image in pixel_values]
        out = self.mm(prompts, images, targets=targets)
        return ObjectiveOutput(out.loss, {"target_tokens": float(sum(map(len, targets)))})


class ConversationObjective(BridgeObjective):
    """The loss on the assistant turns of `ConversationBatch`es (from `ConversationCollate`).

    Set up the stage on `mm` first (`train_projector_only()` or `add_lora(...)`); checkpoints
    hold what trains (`BridgeObjective`).

    Args:
        mm: the model.
        loss_reduction: "token" (the default, as padded training always did): the mean over
            all supervised tokens of the batch; "record": each record's mean, then the mean
            over records. Exact under gradient accumulation either way (`conversation_loss`).
    """

    def __init__(self, mm: MultimodalLM, loss_reduction: str = "token"):
        super().__init__(mm)
        self.loss_reduction = _checked_reduction(loss_reduction)

    def forward(self, batch: ConversationBatch) -> ObjectiveOutput:
        return conversation_loss(self.mm, batch, self.loss_reduction)


class TokenBudgetPacks(torch.utils.data.Dataset):
    """A map-style dataset whose items are packs of another's items, each pack holding at
    most `max_tokens` tokens by the records' `lengths` (`vlm_vit.train.token_budget`'s
    first-fit decreasing): with the trainer's `batch_size` counting packs, every batch costs
    about the same. The collates open the packs (`ConversationCollate(packing=True)` then
    lays each batch into rows of `max_length`).

    The packs are a function of the lengths and the budget, made once here, so a resumed
    run rebuilds the same ones; the trainer shuffles their order with its seed and epoch.

    Args:
        dataset: a dataset with `lengths` (per item, its estimated tokens, negative for
            text-only records, as `ConversationDataset.lengths`).
        max_tokens: the budget of one pack.
        max_length: the longest record after truncation: a length is counted as at most
            this. `max_tokens` must be at least this.

    Raises:
        ValueError: for a dataset without `lengths`, or `max_tokens` below `max_length`.
    """

    def __init__(self, dataset: Any, max_tokens: int, max_length: int):
        from vlm_vit.train.token_budget import first_fit_decreasing

        lengths = getattr(dataset, "lengths", None)
        if lengths is None:
            raise ValueError(f"token-budget batches need a dataset with `lengths`; "
                             f"{type(dataset).__name__} has none")
        if max_tokens < max_length:
            raise ValueError(f"max_tokens_per_batch {max_tokens} is less than max_length "
                             f"{max_length}: the longest record could fit in no batch")
        self.dataset, self.max_tokens = dataset, max_tokens
        counts = np.minimum(np.abs(np.asarray(lengths, dtype=np.int64)), max_length)
        self.packs = first_fit_decreasing(counts, max_tokens)
        self.root = getattr(dataset, "root", None)

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, index: int) -> list[Any]:
        return [self.dataset[item] for item in self.packs[index]]

    def describe(self) -> dict[str, Any]:
        """What run_config.json records: the packs, and the dataset they cover."""
        from vlm_vit.data.folders import describe_dataset

        return {"type": type(self).__name__, "length": len(self), "max_tokens": self.max_tokens,
                "dataset": describe_dataset(self.dataset)}
