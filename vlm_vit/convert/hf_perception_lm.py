"""Perception Encoder as PerceptionLM holds it (Cho et al. 2025, arXiv 2504.13180):
transformers' `PerceptionLMForConditionalGeneration` / `PerceptionLMModel` folders (model_type
"perception_lm"), whose vision tower is a `TimmWrapperModel` of a timm PE registration
(`vision_config.architecture`, `vision_config.model_args`) with its weights under
`model.vision_tower.timm_model.`.

The tower is timm's PE, so `timm_pe` reads it, from those tensors and the wrapper's
architecture and `model_args`. PerceptionLM reads the tower's last hidden state, not timm's
pooled output (its `global_pool` is ""): the tower's pooler is `all`, without the class token
when `vision_use_cls_token` (transformers drops the first token), with it otherwise. Its
projector (two Linears and a GELU, then an average pool of `projector_pooling_ratio`) is the
language model's side and is not read. The processor is the thumbnail's view: a squash resize
to `tile_size`, bicubic, the file's mean and std (0.5 by default); PerceptionLM's extra tiles
of large images are not reproduced.
"""

from __future__ import annotations

from typing import Any

from vlm_vit.config import is_real
from vlm_vit.convert.base import FORMATS, Checkpoint, Converted, NativePooler, register_format
from vlm_vit.convert.hf_common import PREPROCESSOR_NAME
from vlm_vit.convert.timm_pe_registrations import ARCHITECTURES, _architecture
from vlm_vit.processor import ImageProcessor

CONFIG_FILE = "config.json"
MODEL_TYPES = ("perception_lm",)
PREFIXES = ("model.vision_tower.timm_model.", "vision_tower.timm_model.")
DEFAULT_TILE, DEFAULT_MEAN = 448, (0.5, 0.5, 0.5)  # PerceptionLMImageProcessorFast's


class HfPerceptionLmFormat:
    """PerceptionLM's vision tower, from a whole PerceptionLM folder."""

    name = "hf_perception_lm"

    def matches(self, checkpoint: Checkpoint) -> bool:
        return (checkpoint.config or {}).get("model_type") in MODEL_TYPES

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        source = checkpoint.path / CONFIG_FILE
        config = checkpoint.config or {}
        vision = config.get("vision_config")
        if not isinstance(vision, dict) or vision.get("model_type") != "timm_wrapper" or \
                _architecture(vision) not in ARCHITECTURES:
            found = vision.get("architecture") if isinstance(vision, dict) else vision
            raise ValueError(f"{source}: vision_config must be a timm_wrapper of a Perception "
                             f"Encoder registration ({', '.join(ARCHITECTURES)}), got "
                             f"{found!r}"[:400])
        model_args = vision.get("model_args") or {}
        if not isinstance(model_args, dict):
            raise ValueError(f"{source}: vision_config.model_args must be a JSON object, got "
                             f"{type(model_args).__name__}")
        prefix = next((p for p in PREFIXES if checkpoint.has_prefix(p)), None)
        if prefix is None:
            raise ValueError(f"{checkpoint.path} holds no vision tower tensors (expected "
                             f"{PREFIXES[0]}*)")
        tensors = {key.removeprefix(prefix): tensor for key, tensor in checkpoint.tensors.items()
                   if key.startswith(prefix)}
        # the tokens, not timm's pooled output: any pool without fc_norm reads them
        args = {**model_args, "global_pool": "avg", "use_fc_norm": "fc_norm.weight" in tensors}
        tower = Checkpoint(checkpoint.path, tensors, {"architecture": vision["architecture"],
                                                      "model_args": args},
                           given=checkpoint.given)
        converted = FORMATS.get("timm_pe").to_native(tower)
        encoder = converted.config
        use_cls = config.get("vision_use_cls_token", True)
        if not isinstance(use_cls, bool):
            raise ValueError(f"{source}: vision_use_cls_token must be true or false, got "
                             f"{use_cls!r}")
        if use_cls and (not encoder.class_token or encoder.num_register_tokens):
            raise ValueError(f"{source}: vision_use_cls_token drops the first token, but this "
                             f"tower has class_token={encoder.class_token} and "
                             f"{encoder.num_register_tokens} registers: vlm-vit drops all "
                             "prefix tokens or none")
        converted.pooler = NativePooler("all", encoder.width, None,
                                        {"keep_prefix": not use_cls}, {})
        converted.processor, rule = thumbnail_processor(
            checkpoint.files.get(PREPROCESSOR_NAME), encoder.image_size, source)
        converted.rules = [*converted.rules, rule,
                           f"the tower's tokens{' without the class token' if use_cls else ''} "
                           "(PerceptionLM's projector is not read)"]
        converted.config_file = CONFIG_FILE
        return converted


def thumbnail_processor(settings: dict[str, Any] | None, image_size: tuple[int, int],
                        source: object) -> tuple[ImageProcessor, str]:
    """PerceptionLM's thumbnail view as an `ImageProcessor`, and the rule that says so.

    Raises:
        ValueError: naming `source`, for a tile size or mean/std the processor refuses.
    """
    if settings is None:
        return (ImageProcessor(size=image_size, resize_mode="squash", resample="bicubic",
                               mean=DEFAULT_MEAN, std=DEFAULT_MEAN),
                f"no {PREPROCESSOR_NAME}: PerceptionLM's defaults (squash, bicubic, mean and "
                f"std 0.5) at the tower's size {image_size}")
    where = source.parent / PREPROCESSOR_NAME if hasattr(source, "parent") else source
    rescale = settings.get("rescale_factor", 1 / 255)
    if settings.get("do_rescale", True) is not True or settings.get("do_normalize", True) \
            is not True or not is_real(rescale) or abs(rescale - 1 / 255) > 1e-9:
        raise ValueError(f"{where}: rescales or normalises pixels otherwise than by 1/255 and "
                         "mean/std (do_rescale, rescale_factor, do_normalize), which "
                         "ImageProcessor cannot do")
    tile = settings.get("tile_size", DEFAULT_TILE)
    try:
        processor = ImageProcessor(size=tile, resize_mode="squash", resample="bicubic",
                                   mean=tuple(settings.get("image_mean", DEFAULT_MEAN)),
                                   std=tuple(settings.get("image_std", DEFAULT_MEAN)))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None
    return processor, (f"{PREPROCESSOR_NAME}: the thumbnail (squash to tile_size {tile}, "
                       "bicubic); PerceptionLM's extra tiles are not reproduced")


register_format(HfPerceptionLmFormat())
