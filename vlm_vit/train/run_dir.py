"""The run directory: what a run writes there."""

from __future__ import annotations

import vlm_vit.train.checkpoint as ckpt
from vlm_vit.train.metrics import METRICS_NAME, TENSORBOARD_DIR
from vlm_vit.train.tar_shards import SAMPLES_DIR

RUN_CONFIG_NAME = "run_config.json"
OBJECTIVE_NAME = "objective.pt"
ENCODER_DIR = "encoder"
ADAPTER_DIR = "adapter"  # a LoRA run saves its adapter here instead of the encoder
MODEL_DIR = "model"  # where an objective's own `export` writes (the LLM bridge's whole model)
# What a run writes into its directory: a fresh run refuses to start over any of these, and
# --overwrite removes exactly these (the caller's own files, such as finetune.json, stay).
RUN_OUTPUTS = (ckpt.CHECKPOINT_DIR, METRICS_NAME, RUN_CONFIG_NAME, ENCODER_DIR, TENSORBOARD_DIR,
               SAMPLES_DIR, OBJECTIVE_NAME, ADAPTER_DIR, MODEL_DIR)


def _listing(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most
                                      else "")
