"""The reference libraries' encoders, built on our weights through the repository's own
converters, so every comparison runs identical weights on identical pixels.

Each anchor gives the same tokens as `VisionEncoder(...).tokens` (every token after the final
norm), computed the way that library computes them:

- timm: `VisionTransformer.forward_features`;
- transformers: `CLIPVisionModel(...).last_hidden_state` with CLIP's `post_layernorm` applied to
  every token (Hugging Face normalises only the pooled token; applying it everywhere gives the
  same work and output as ours);
- open_clip: `VisionTransformer(output_tokens=True)`, whose patch tokens (after `ln_post`) are
  ours without the class token (which it returns pooled and projected, a `[B, D]` extra).

transformers and open_clip hold CLIP-shaped encoders only (`clip-vit-b/16`, ...); for other
variants `build_anchor` raises ValueError naming what they cannot express.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from vlm_vit import VisionEncoder  # noqa: E402

ANCHORS = ("timm", "transformers", "open_clip")


def timm_anchor(encoder: VisionEncoder) -> tuple[nn.Module, Callable]:
    from vlm_vit.convert.timm import build_timm_model, to_timm_state_dict

    model = build_timm_model(encoder.config)
    model.load_state_dict(to_timm_state_dict(encoder.state_dict(), encoder.config), strict=True)
    return model, model.forward_features


def transformers_anchor(encoder: VisionEncoder) -> tuple[nn.Module, Callable]:
    from transformers import CLIPVisionModel

    from vlm_vit.convert.hf_clip import save_hf_clip

    with tempfile.TemporaryDirectory() as directory:
        save_hf_clip(encoder, directory)
        model = CLIPVisionModel.from_pretrained(directory)
    post_layernorm = getattr(model, "vision_model", model).post_layernorm  # transformers 4 or 5

    def tokens(pixels: torch.Tensor) -> torch.Tensor:
        return post_layernorm(model(pixel_values=pixels).last_hidden_state)

    return model, tokens


def open_clip_anchor(encoder: VisionEncoder) -> tuple[nn.Module, Callable]:
    from open_clip.transformer import QuickGELU, VisionTransformer

    from vlm_vit.convert.open_clip import OpenClipFormat

    c = encoder.config
    state = {name.removeprefix("visual."): tensor
             for name, tensor in OpenClipFormat().from_native(encoder).items()}
    model = VisionTransformer(
        image_size=c.image_size[0], patch_size=c.patch_size, width=c.width, layers=c.depth,
        heads=c.heads, mlp_ratio=c.mlp_width / c.width, output_dim=c.width, output_tokens=True,
        act_layer=QuickGELU if c.act == "quick_gelu" else nn.GELU)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) != {"proj"}:  # proj: CLIP's projection, not the encoder's
        raise ValueError(f"open_clip twin does not fit: missing {missing}, unexpected "
                         f"{unexpected}")

    def tokens(pixels: torch.Tensor) -> torch.Tensor:
        return model(pixels)[1]  # (projected class token, patch tokens)

    return model, tokens


BUILDERS = {"timm": timm_anchor, "transformers": transformers_anchor,
            "open_clip": open_clip_anchor}


def build_anchor(name: str, encoder: VisionEncoder) -> tuple[nn.Module, Callable]:
    """The anchor library's twin of `encoder` (same weights) and a call giving its tokens.

    open_clip's call returns the patch tokens only; compare the last tokens of each.

    Raises:
        ValueError: when that library cannot express the encoder.
    """
    return BUILDERS[name](encoder)
