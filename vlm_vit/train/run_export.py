"""The end of a run: what the trained objective leaves in the run directory.

A whole (unsharded) objective is written by rank 0 as `run_dir.export` says (`objective.pt`
and `encoder/`, `adapter/`, or the objective's own `export`). A sharded one (FSDP2) that
holds a plain encoder has `encoder/` written from its final checkpoint one block at a time
(`consolidate`), so no process ever holds the whole model; any other sharded objective (LoRA,
the LLM bridge) is gathered onto rank 0 first, every rank taking part.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

import vlm_vit.train.checkpoint as ckpt
import vlm_vit.train.distributed as distributed
import vlm_vit.train.fsdp as fsdp
import vlm_vit.train.run_dir as outputs
from vlm_vit.train.distributed import DistributedContext


def export_run(objective: nn.Module, run_dir: Path, step: int, context: DistributedContext,
               log: Any) -> None:
    """Writes the run's result; every rank calls it, and all wait until it is written.

    Args:
        step: the final step, whose checkpoint a sharded objective is written from.
    """
    sharded = fsdp.is_sharded(objective)
    streamed = sharded and outputs.plain_encoder_objective(objective)
    state = fsdp.full_state(objective) if sharded and not streamed else None
    if context.is_main and streamed:
        from vlm_vit.train.consolidate import consolidate

        log.info("saved the encoder to %s, one block at a time from %s",
                 consolidate(run_dir, run_dir / outputs.ENCODER_DIR, step),
                 ckpt.sharded_checkpoint_path(run_dir, step))
    elif context.is_main:
        outputs.export(objective, run_dir, log, state)
    distributed.barrier(context)
