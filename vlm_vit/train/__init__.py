"""Training: the loop (`Trainer`), image folders, checkpoints, data-parallel support and
token-budget batches of variable-size images.

A library, not a recipe: scripts that build an objective and call `Trainer.fit` live
outside the package. Importing it loads no optional dependency (torchvision, tqdm and
tensorboard are imported where used).
"""

from vlm_vit.data.folders import ImageFolder, LabelledImageFolder
from vlm_vit.data.sampler import GlobalBatchSampler
from vlm_vit.data.samples import ImageBatch, UndecodableImage, collate_images, collate_labelled
from vlm_vit.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from vlm_vit.train.token_budget import TokenBudgetBatchSampler, collate_packed
from vlm_vit.train.trainer import (
    NonFiniteLossError,
    TrainConfig,
    Trainer,
    TrainResult,
    build_scheduler,
    learning_rate,
    parameter_groups,
)

__all__ = [
    "GlobalBatchSampler",
    "ImageBatch",
    "ImageFolder",
    "LabelledImageFolder",
    "NonFiniteLossError",
    "TokenBudgetBatchSampler",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "UndecodableImage",
    "build_scheduler",
    "collate_images",
    "collate_labelled",
    "collate_packed",
    "latest_checkpoint",
    "learning_rate",
    "load_checkpoint",
    "parameter_groups",
    "save_checkpoint",
]
