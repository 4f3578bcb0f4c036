"""Poolers and projectors: encoder tokens to what a pipeline wants (see `base.py`)."""

from vlm_vit.poolers import (  # noqa: F401
    attention_pool,
    attentive_probe,
    conv_merger,
    mlp,
    patch_merger,
    perceiver,
    pixel_shuffle,
    simple,
)
from vlm_vit.poolers.base import (
    POOLERS,
    Pooler,
    available_poolers,
    build_pooler,
    pool_packed,
    register_pooler,
)

__all__ = ["POOLERS", "Pooler", "available_poolers", "build_pooler", "pool_packed",
           "register_pooler"]
