"""timm's `VisionTransformer`: our parameter names are timm's, so weights copy across as they
are; what differs is how the architecture is spelled."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from vlm_vit.config import EncoderConfig
from vlm_vit.optional import require


def timm_model_kwargs(config: EncoderConfig) -> dict[str, Any]:
    """Keyword arguments for `timm.models.vision_transformer.VisionTransformer` that build
    the same architecture without a head (`forward_features` gives our `tokens`).

    Register tokens are left out: timm gives them position entries, which ours lack.
    """
    if config.num_register_tokens:
        raise ValueError("timm places register tokens inside the position table; "
                         f"a config with {config.num_register_tokens} registers has no twin")
    return dict(
        img_size=config.image_size, patch_size=config.patch_size, in_chans=config.in_channels,
        num_classes=0, global_pool="token" if config.class_token else "avg", fc_norm=False,
        embed_dim=config.width, depth=config.depth, num_heads=config.heads,
        mlp_ratio=config.mlp_width / config.width, qkv_bias=config.qkv_bias,
        class_token=config.class_token, pre_norm=config.pre_norm,
        final_norm=config.final_norm, act_layer=config.act,  # timm knows the same names
        norm_layer=functools.partial(nn.LayerNorm, eps=config.norm_eps),
    )


def build_timm_model(config: EncoderConfig, **extra: Any) -> nn.Module:
    """timm's `VisionTransformer` for `config` (needs timm), at random initialisation."""
    vision_transformer = require("timm.models.vision_transformer", "dev", "a timm twin")
    model = vision_transformer.VisionTransformer(**{**timm_model_kwargs(config), **extra})
    if not config.patch_bias:
        model.patch_embed.proj.bias = None
    return model
