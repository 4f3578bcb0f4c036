"""Inspecting a trained encoder as the ViT paper's section 4.5 does: mean attention distance,
attention rollout, position-embedding similarity and embedding filters.

The numeric functions (`attention`, `position`, `filters`) need only torch; the figures need
matplotlib (the `train` extra), imported only when one is drawn.
"""

from vlm_vit.analysis.attention import (
    attention_distance,
    attention_rollout,
    mean_attention_distance,
    patch_attention,
    patch_distances,
    prefix_attention,
    rollout_grid,
)
from vlm_vit.analysis.collect import ImageAttention, image_attention, iter_image_attention
from vlm_vit.analysis.filters import embedding_filters
from vlm_vit.analysis.position import patch_position_embeddings, position_similarity
from vlm_vit.analysis.report import analyze

__all__ = [
    "ImageAttention",
    "analyze",
    "attention_distance",
    "attention_rollout",
    "embedding_filters",
    "image_attention",
    "iter_image_attention",
    "mean_attention_distance",
    "patch_attention",
    "patch_distances",
    "patch_position_embeddings",
    "position_similarity",
    "prefix_attention",
    "rollout_grid",
]
