"""Reading transformers' Qwen2-VL, Qwen2.5-VL and Qwen3-VL folders
(`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`,
`Qwen3VLForConditionalGeneration`) as a `MultimodalLM`'s parts, for inference.

The vision tower goes through vlm-vit's own converters (`vlm_vit.convert.hf_qwen2_vl`,
`hf_qwen2_5_vl`, `hf_qwen3_vl`: the encoder and its 2x2 patch merger; Qwen3-VL's DeepStack
mergers as taps on the encoder, `vlm_vit_llm.deepstack`); the language model stays
transformers' own model with its vision tower dropped, so its M-RoPE layers, its head and its
tie are transformers' exactly; the bridge gives it the 3D positions `get_rope_index` would
(`vlm_vit_llm.mrope`). The config, the tokenizer's image token, the image processor and the
head are checked before any weight is read.

A clip's frames are sized by the folder's own video processor (`vlm_vit_llm.video_processor`,
read as transformers reads it: its bounds, per frame for Qwen2-VL and Qwen2.5-VL and over the
clip's frames for Qwen3-VL), not the image processor's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from vlm_vit.config import is_int
from vlm_vit.io.files import read_json
from vlm_vit.processor import NORMALIZATION, ImageProcessor
from vlm_vit.tower import VisionTower
from vlm_vit_llm.deepstack import DeepStack
from vlm_vit_llm.hf_reading import (
    bounded,
    checked_image_token,
    image_processor_settings,
    tensor_shapes,
    video_processor_settings,
)
from vlm_vit_llm.saving import ModelParts
from vlm_vit_llm.video_processor import RULE_OF, VideoProcessor

MODEL_TYPES = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}
IMAGE_TOKEN = "<|image_pad|>"
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>"  # an image in Qwen's prompts
HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight")
RESAMPLE = {2: "bilinear", 3: "bicubic"}


def read_qwen_vl(directory: str | Path, *, dtype: torch.dtype | None = None) -> ModelParts:
    """The parts of a `MultimodalLM`, for inference, from a Qwen2-VL, Qwen2.5-VL or Qwen3-VL
    folder.

    Raises:
        ValueError: naming the file and what cannot be read (another model type, an image
            token the tokenizer gives another id, an image processor whose patch or merge
            size is not the tower's, no image processor, an untied head the weights lack),
            in one line, before any weight is read.
    """
    import transformers
    from huggingface_hub.errors import StrictDataclassError
    from safetensors.torch import save_file

    from vlm_vit import load_tower
    from vlm_vit.convert.hf_qwen3_vl import deepstack_taps
    from vlm_vit.io.loading import read_checkpoint

    directory = Path(directory)
    source = f"{directory / 'config.json'}"
    raw = read_json(directory / "config.json")
    if raw.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"{source}: model_type {bounded(raw.get('model_type'))} is not one of "
                         f"{sorted(MODEL_TYPES)}")
    try:
        config = transformers.AutoConfig.from_pretrained(directory)
    except StrictDataclassError as error:
        raise ValueError(f"{source}: {bounded(error)}") from None
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    image_token = checked_image_token(tokenizer, directory, config.image_token_id, source,
                                      default=IMAGE_TOKEN)
    processor = _our_processor(directory, config.vision_config)
    video = _our_video_processor(directory, config)
    shapes = tensor_shapes(directory)
    if not config.tie_word_embeddings and not any(name in shapes for name in HEAD_NAMES):
        raise ValueError(f"{source}: tie_word_embeddings is off but the weights hold no "
                         "lm_head.weight: the output head would be random")
    _check_widths(config, source)
    model_class = getattr(transformers, MODEL_TYPES[config.model_type]
                          + "ForConditionalGeneration")
    model = model_class.from_pretrained(directory, dtype=dtype)
    visual = model.model.visual
    with tempfile.TemporaryDirectory(prefix="vlm-vit-qwen-vl-") as folder:
        # Written here, not by save_pretrained, which writes only on rank 0 under torchrun.
        visual.config.to_json_file(Path(folder) / "config.json")
        save_file({name: tensor.contiguous() for name, tensor in visual.state_dict().items()},
                  Path(folder) / "model.safetensors")
        loaded = load_tower(folder)  # the encoder and its patch merger
        taps = deepstack_taps(read_checkpoint(folder)) if config.model_type == "qwen3_vl" \
            else None
    tower = VisionTower(loaded.encoder, loaded.pooler, feature_layer=loaded.feature_layer,
                        processor=processor)
    del model.model.visual  # the tower above runs the images; the LLM never does
    deepstack = None if taps is None else \
        DeepStack(taps, model.model.language_model).to(model.dtype).eval()
    return ModelParts(tower.to(model.dtype).eval(), model.eval(), tokenizer, processor,
                      image_token, layout=config.model_type, video_token=_video_token(
                          tokenizer, config.video_token_id), deepstack=deepstack,
                      video_processor=video)


def _check_widths(config: Any, source: str) -> None:
    """The merger's output width (`out_hidden_size` in Qwen2.5-VL and Qwen3-VL, the vision
    `hidden_size` in Qwen2-VL) must be the language model's.

    Raises:
        ValueError: naming both widths, before any weight is read.
    """
    vision, text = config.vision_config, config.get_text_config()
    merged = vision.hidden_size if config.model_type == "qwen2_vl" else vision.out_hidden_size
    if merged != text.hidden_size:
        raise ValueError(f"{source}: the vision merger gives width {bounded(merged)}, but the "
                         f"language model's hidden_size is {bounded(text.hidden_size)}")


def _video_token(tokenizer: Any, video_token_id: Any) -> str | None:
    """The clip placeholder the config names, when the tokenizer holds it (else clips go at
    the image token only)."""
    if not is_int(video_token_id) or not 0 <= video_token_id < len(tokenizer):
        return None
    return tokenizer.convert_ids_to_tokens(video_token_id)


def _our_video_processor(directory: Path, config: Any) -> VideoProcessor | None:
    """Qwen's video processor as ours (`VideoProcessor.from_transformers`), or None for a
    folder without one (each frame is then sized as an image)."""
    found = video_processor_settings(directory)
    if found is None:
        return None
    settings, path = found
    vision = config.vision_config
    _check_sizes(settings, vision, path)
    return VideoProcessor.from_transformers(
        settings, RULE_OF[config.model_type],
        multiple=vision.patch_size * vision.spatial_merge_size,
        temporal=vision.temporal_patch_size, source=path)


def _check_sizes(settings: dict[str, Any], vision: Any, path: Path) -> None:
    """A processor's patch, merge and temporal patch sizes must be the tower's.

    Raises:
        ValueError: naming the file, the setting and both values.
    """
    for name, tower_value in (("patch_size", vision.patch_size),
                              ("merge_size", vision.spatial_merge_size),
                              ("temporal_patch_size", vision.temporal_patch_size)):
        value = settings.get(name, tower_value)
        if value != tower_value:
            raise ValueError(f"{path}: {name} {bounded(value)}, but the vision tower's is "
                             f"{tower_value}")


def _our_processor(directory: Path, vision: Any) -> ImageProcessor:
    """Qwen's image processor as ours: native resolution, sides multiples of patch x merge,
    its pixel bounds (`size` shortest_edge / longest_edge, or min_pixels / max_pixels), its
    mean, std and resampling filter."""
    settings, path = image_processor_settings(directory)
    _check_sizes(settings, vision, path)
    size = settings.get("size") if isinstance(settings.get("size"), dict) else {}
    low = settings.get("min_pixels", size.get("shortest_edge"))
    high = settings.get("max_pixels", size.get("longest_edge"))
    resample = RESAMPLE.get(settings.get("resample", 3))
    if not (is_int(low) and is_int(high) and 0 < low <= high) or resample is None:
        raise ValueError(f"{path}: pixel bounds {bounded(low)} to {bounded(high)} or resample "
                         f"{bounded(settings.get('resample'))} are not what vlm-vit reads "
                         "(positive ints, the first not above the second; bilinear or bicubic)")
    mean, std = NORMALIZATION["clip"]
    try:
        return ImageProcessor(
            resize_mode="native", resample=resample,
            patch_multiple=vision.patch_size * vision.spatial_merge_size,
            min_output_pixels=low, max_output_pixels=high,
            mean=tuple(settings.get("image_mean", mean)), std=tuple(settings.get("image_std", std)))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {bounded(error)}") from None
