"""Self-supervised pretraining objectives: the paper's masked patch prediction and MAE."""

from vlm_vit.pretrain.base import Objective, ObjectiveOutput

__all__ = ["Objective", "ObjectiveOutput"]
