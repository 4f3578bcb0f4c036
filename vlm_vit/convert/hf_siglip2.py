"""Hugging Face SigLIP 2 NaFlex vision towers (`Siglip2VisionModel`, `Siglip2Model`; model_type
"siglip2"): SigLIP's block, final norm and MAP head, with images at their own aspect ratio.

SigLIP 2's fixed-resolution checkpoints (`google/siglip2-*-patch16-256` and the like) are
`SiglipModel`s, read by `hf_siglip`. The NaFlex ones differ from SigLIP in two tensors and
one rule, recorded in `Converted.rules`:

* the patch embedding is a Linear over each patch flattened as (row, column, channel), the
  order `Siglip2ImageProcessor` flattens in: reshaped to our Conv2d `[D, C, P, P]`
  (`linear_patches_as_conv`);
* the position table is a square grid (`num_patches` entries, 16 x 16 for 256) that
  transformers resizes to every image's own patch grid, bilinearly with antialiasing, in
  float32: our `pos_resize_mode="bilinear"`, `pos_resize_antialias=True`, and `image_size`
  the table's grid times the patch;
* the processor sizes each image by `naflex_size` (at most `max_num_patches` patches,
  scaled up or down): `ImageProcessor(resize_mode="native", max_num_patches=...)`.

transformers pads a batch to `max_num_patches` and masks the padding; our packed path
(`encoder([image, ...])`, `VisionTower` on a list) encodes each image's own tokens, which
equal theirs on the valid tokens, and the MAP head (the `attention_pool` pooler) pools each
image's tokens, which equals its masked `pooler_output`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from vlm_vit.config import EncoderConfig, is_int
from vlm_vit.convert.base import Checkpoint, register_format
from vlm_vit.convert.hf_clip import SIGLIP_ARCHITECTURE, SIGLIP_DEFAULTS, HFSiglipFormat
from vlm_vit.convert.hf_common import PIL_RESAMPLE, PREPROCESSOR_NAME
from vlm_vit.io.native import CONFIG_NAME
from vlm_vit.processor import NORMALIZATION, ImageProcessor

# transformers' position resize (`Siglip2VisionEmbeddings.resize_positional_embeddings`).
SIGLIP2_ARCHITECTURE = {**SIGLIP_ARCHITECTURE, "pos_resize_mode": "bilinear",
                        "pos_resize_antialias": True}
# Siglip2VisionConfig's defaults (ViT-B/16, a 16 x 16 position grid); it has no image_size.
SIGLIP2_DEFAULTS = {**{k: v for k, v in SIGLIP_DEFAULTS.items() if k != "image_size"},
                    "num_patches": 256, "vision_use_head": True}
# Siglip2ImageProcessor's defaults (its patch_size defaults to the model's here).
PROCESSOR_DEFAULTS: dict[str, Any] = dict(max_num_patches=256, resample=2,
                                          image_mean=NORMALIZATION["inception"][0],
                                          image_std=NORMALIZATION["inception"][1])


def linear_patches_as_conv(state: dict[str, torch.Tensor], config: EncoderConfig,
                           source: object) -> None:
    """`patch_embed.proj.weight` from SigLIP 2's Linear `[D, P * P * C]`, its input flattened
    (row, column, channel), to the Conv2d's `[D, C, P, P]` (in place).

    Raises:
        ValueError: for a weight that is not `[width, P * P * channels]`, naming `source`.
    """
    name = "patch_embed.proj.weight"
    weight, patch = state[name], config.patch_size
    expected = [config.width, patch * patch * config.in_channels]
    if weight.ndim != 2 or list(weight.shape) != expected:
        raise ValueError(f"{source}: embeddings.patch_embedding.weight is "
                         f"{list(weight.shape)}, not {expected} (width, patch {patch} x "
                         f"{patch} x {config.in_channels} channels)")
    # [D, P*P*C] -> [D, P, P, C] -> [D, C, P, P]
    state[name] = weight.reshape(config.width, patch, patch, config.in_channels) \
        .permute(0, 3, 1, 2).contiguous()


class HFSiglip2Format(HFSiglipFormat):
    """`Siglip2VisionModel` and `Siglip2Model` directories (NaFlex)."""

    name = "hf_siglip2"
    family = "SigLIP 2"
    model_types = ("siglip2", "siglip2_vision_model")
    architecture = SIGLIP2_ARCHITECTURE
    defaults = SIGLIP2_DEFAULTS

    def matches(self, checkpoint: Checkpoint) -> bool:
        # Only by config: without one (num_patches, heads) the tower cannot be read.
        return (checkpoint.config or {}).get("model_type") in self.model_types

    def vision_config(self, checkpoint: Checkpoint, rules: list[str]) -> dict[str, Any]:
        """SigLIP's, with `image_size` the position grid's side (`sqrt(num_patches)`) times
        the patch.

        Raises:
            ValueError: for a `num_patches` that is not a positive square (transformers
                reshapes the table to a square grid), naming the file.
        """
        vision = super().vision_config(checkpoint, rules)
        count = vision["num_patches"]
        side = math.isqrt(count) if is_int(count) and count > 0 else 0
        if side * side != count or side == 0:
            raise ValueError(f"{checkpoint.path / CONFIG_NAME}: num_patches must be a positive "
                             f"square (the position table is a square grid), got {count!r}")
        patch = vision["patch_size"]
        image_size = side * patch if is_int(patch) else patch  # EncoderConfig refuses the rest
        rules.append(f"position table: a {side}x{side} grid resized to each image's patch grid, "
                     f"bilinear with antialias, as Siglip2VisionEmbeddings")
        return {**vision, "image_size": image_size}

    def fix_up(self, state: dict[str, torch.Tensor], config: EncoderConfig,
               source: object) -> None:
        linear_patches_as_conv(state, config, source)

    def image_processor(self, settings: dict[str, Any] | None, config: EncoderConfig,
                        rules: list[str], source: object) -> ImageProcessor:
        """NaFlex preprocessing: native resolution at `naflex_size` (sides multiples of the
        patch, at most `max_num_patches` patches), bilinear, mean and std 0.5 unless the
        file says otherwise.

        Raises:
            ValueError: naming `source`, for a `patch_size` other than the model's or a
                `max_num_patches` that is not a positive int.
        """
        if settings is None:
            rules.append(f"no {PREPROCESSOR_NAME}: using Siglip2ImageProcessor's defaults")
        settings = {**PROCESSOR_DEFAULTS, "patch_size": config.patch_size, **(settings or {})}
        budget, patch = settings["max_num_patches"], settings["patch_size"]
        if patch != config.patch_size:
            raise ValueError(f"{source}: patch_size {patch!r} is not the model's "
                             f"{config.patch_size}")
        if not (is_int(budget) and budget > 0):
            raise ValueError(f"{source}: max_num_patches must be a positive int, got "
                             f"{budget!r}")
        rules.append(f"{PREPROCESSOR_NAME}: NaFlex sizes (naflex_size, up to {budget} patches)")
        resample = settings["resample"]
        try:
            return ImageProcessor(
                resize_mode="native", patch_multiple=patch,
                max_num_patches=budget, size=config.image_size,
                resample=PIL_RESAMPLE.get(resample, "bilinear") if is_int(resample)
                else "bilinear",
                mean=tuple(settings["image_mean"]), std=tuple(settings["image_std"]))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{source}: {error}") from None


HF_SIGLIP2 = register_format(HFSiglip2Format())
