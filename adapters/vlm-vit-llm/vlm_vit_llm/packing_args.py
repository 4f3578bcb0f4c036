"""Command-line flags for packed LLM training (`vlm-vit llm train`), and their translation
into the objects that do it, apart from the CLI so they can be tested and reused:

    add_packing_arguments(parser)
    options = packing_from_args(args)       # a PackingOptions, checked
    collate = ConversationCollate(mm, max_length=..., packing=options.packing)
    dataset = options.batches(dataset, collate.max_length)
    objective = ConversationObjective(mm, loss_reduction=options.loss_reduction)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from vlm_vit_llm.presets import LOSS_REDUCTIONS

# The largest --max-tokens-per-batch: ten million tokens of one batch is past any
# accelerator's activations; a larger budget is a typo (10**18) that packs a whole file into
# one batch.
MAX_TOKENS_PER_BATCH = 10_000_000


@dataclass(frozen=True)
class PackingOptions:
    """How `llm train` batches and reduces the loss.

    Attributes:
        packing: records packed into rows of at most --max-length tokens.
        max_tokens_per_batch: batches of at most this many (estimated) tokens, or None for
            --batch-size records each.
        loss_reduction: "token" or "record" (`vlm_vit_llm.packing.loss_terms`).
    """

    packing: bool = False
    max_tokens_per_batch: int | None = None
    loss_reduction: str = "token"

    def batches(self, dataset: Any, max_length: int) -> Any:
        """`dataset`, or with `max_tokens_per_batch` its token-budget packs
        (`vlm_vit_llm.train.TokenBudgetPacks`), which the trainer then batches `--batch-size`
        packs at a time."""
        if self.max_tokens_per_batch is None:
            return dataset
        from vlm_vit_llm.train import TokenBudgetPacks

        return TokenBudgetPacks(dataset, self.max_tokens_per_batch, max_length)


def add_packing_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds --packing, --max-tokens-per-batch and --loss-reduction to `parser` (a group)."""
    group = parser.add_argument_group("packing (padding-free rows)")
    group.add_argument("--packing", action="store_true",
                       help="pack several records into each row of --max-length tokens, "
                            "attention and positions confined to each record")
    group.add_argument("--max-tokens-per-batch", type=int, default=None, metavar="N",
                       help="batches of at most N tokens (estimated per record) instead of "
                            "--batch-size records; --batch-size then counts such batches "
                            f"(conversations file only; at most {MAX_TOKENS_PER_BATCH:,})")
    group.add_argument("--loss-reduction", choices=LOSS_REDUCTIONS, default="token",
                       help="token: mean over the batch's supervised tokens (the default, as "
                            "padded training); record: each record's mean, then the mean "
                            "over records")


def packing_from_args(args: argparse.Namespace, *, shards: bool = False) -> PackingOptions:
    """The `PackingOptions` the flags ask for.

    Args:
        args: parsed flags (with `group_by_length` and `data_format` when the parser has them).
        shards: whether `--data` is a shard stream.

    Raises:
        ValueError: naming the flag, for a budget outside 1..`MAX_TOKENS_PER_BATCH`, or one with
            --group-by-length, with captions or with shards (it needs a conversations file's
            record lengths).
    """
    budget = getattr(args, "max_tokens_per_batch", None)
    if budget is not None:
        if budget <= 0:
            raise ValueError(f"--max-tokens-per-batch must be positive, got {budget}")
        if budget > MAX_TOKENS_PER_BATCH:
            raise ValueError(f"--max-tokens-per-batch {budget} is over the most a batch may "
                             f"hold, {MAX_TOKENS_PER_BATCH:,} tokens (MAX_TOKENS_PER_BATCH)")
        reasons = {"--group-by-length": getattr(args, "group_by_length", False),
                   "captions (--data-format captions)":
                       getattr(args, "data_format", "llava") == "captions",
                   "tar shards": shards}
        for what, given in reasons.items():
            if given:
                raise ValueError(f"--max-tokens-per-batch cannot go with {what}: it batches "
                                 "a conversations file by its records' lengths")
    return PackingOptions(bool(getattr(args, "packing", False)), budget,
                          getattr(args, "loss_reduction", "token"))
