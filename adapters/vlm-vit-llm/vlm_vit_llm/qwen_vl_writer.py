"""Writing a Qwen2-VL, Qwen2.5-VL or Qwen3-VL `MultimodalLM` (`vlm_vit_llm.qwen_vl_reader`)
back as transformers' own class (`Qwen2VLForConditionalGeneration`,
`Qwen2_5_VLForConditionalGeneration`, `Qwen3VLForConditionalGeneration`) with its processor.

The language model is transformers' own module already (its vision tower dropped), so its
tensors keep their names; the tower and its patch merger (and Qwen3-VL's DeepStack mergers)
go back through vlm-vit's own tower writers (`vlm_vit.convert.hf_qwen2_vl`, `hf_qwen2_5_vl`,
`hf_qwen3_vl`) under `model.visual.`. The same
folder is what `MultimodalLM.save_pretrained` keeps in `llm/` for such a model (base weights,
its LoRA beside it) and what `llm export` writes (LoRA merged), so both are read back by the
same reader.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vlm_vit import VisionEncoder
from vlm_vit.convert.hf_qwen2_5_vl import HfQwen2_5VLVisionFormat
from vlm_vit.convert.hf_qwen2_vl import HfQwen2VLVisionFormat, qwen_preprocessor
from vlm_vit.convert.hf_qwen3_vl import HfQwen3VLVisionFormat
from vlm_vit.io.files import atomic_directory
from vlm_vit_llm.mrope import multimodal_rope
from vlm_vit_llm.peft_helpers import base_state, merged_state, merged_tied_state, split_peft
from vlm_vit_llm.saving import EXPORT_FILES, ModelParts
from vlm_vit_llm.video_processor import RULE_OF

logger = logging.getLogger(__name__)

# transformers' model_type -> (our tower writer, the prefix of transformers' class names)
FAMILIES = {"qwen2_vl": (HfQwen2VLVisionFormat(), "Qwen2VL"),
            "qwen2_5_vl": (HfQwen2_5VLVisionFormat(), "Qwen2_5_VL"),
            "qwen3_vl": (HfQwen3VLVisionFormat(), "Qwen3VL")}
# transformers' video processor class, by family (Qwen3-VL samples and stamps frames itself).
VIDEO_PROCESSORS = {"qwen3_vl": "Qwen3VLVideoProcessor"}
VISUAL_PREFIX = "model.visual."
# Fields of the tower's config.json that are bookkeeping, not shape.
UNCOMPARED = ("architectures", "model_type", "dtype", "initializer_range")


def base_writer(llm: Any) -> Callable[[ModelParts, Path], None] | None:
    """What writes `llm`'s model into a saved folder's `llm/` as one transformers folder
    (`write_base`), or None for an LLM the usual `llm/` holds.

    Raises:
        ValueError: naming the class, for a multimodal-RoPE LLM no writer takes.
    """
    base = split_peft(llm)[0]
    config = getattr(base, "config", None)
    if not multimodal_rope(config):
        return None
    family(base)
    return write_base


def family(llm: Any) -> str:
    """`llm`'s model type, one of `FAMILIES`.

    Raises:
        ValueError: naming the class and the families written.
    """
    model_type = getattr(getattr(llm, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"{type(llm).__name__} (model_type {model_type!r}) cannot be written "
                         f"yet; vlm-vit-llm writes {', '.join(FAMILIES)}")
    return model_type


def qwen_vl_tensors(parts: ModelParts, *, merge: bool) -> tuple[dict[str, Any],
                                                               dict[str, torch.Tensor]]:
    """The tower's config.json and every tensor under transformers' names: the LLM's as they
    are, the tower's and its mergers' (DeepStack's too) under `model.visual.`; LoRA folded
    in (`merge`, one
    weight at a time, the model unchanged) or left out (the base weights).

    Raises:
        ValueError: as the tower writer (a tower Qwen's cannot hold), or when LoRA changes
            one of two tied weights but not the other, or for DeepStack taps on a family
            without DeepStack (or none on Qwen3-VL).
    """
    llm = split_peft(parts.llm)[0]
    encoder_base, encoder_adapter = split_peft(parts.tower.encoder)
    encoder = encoder_base
    if encoder_adapter is not None:  # a plain encoder on the wanted tensors, nothing copied
        state = merged_state(encoder_adapter) if merge else base_state(encoder_base)
        encoder = VisionEncoder.from_state_dict(state, encoder_base.config)
    model_type = family(llm)
    writer, _ = FAMILIES[model_type]
    if (parts.deepstack is None) == (model_type == "qwen3_vl"):
        raise ValueError(f"{model_type} holds DeepStack mergers exactly when it is Qwen3-VL; "
                         f"this model has {'none' if parts.deepstack is None else 'some'}")
    taps = {} if parts.deepstack is None else {"deepstack": parts.deepstack.taps()}
    vision, tower = writer.hf_tensors(encoder, parts.tower.pooler, **taps)
    tensors = merged_tied_state(parts.llm) if merge else base_state(llm)
    overlap = [name for name in tensors if name.startswith(VISUAL_PREFIX)]
    if overlap:
        raise ValueError(f"the LLM holds tower weights itself ({overlap[0]!r}); the tower "
                         "written is the MultimodalLM's")
    tensors.update({VISUAL_PREFIX + name: tensor for name, tensor in tower.items()})
    return vision, tensors


def _checked_config(llm: Any, vision: dict[str, Any]) -> Any:
    """A copy of the LLM's config, whose vision config must describe the tower written."""
    config = copy.deepcopy(llm.config)
    held = config.vision_config
    differ = [f"{key} {getattr(held, key, None)!r} (the tower: {value!r})"
              for key, value in vision.items()
              if key not in UNCOMPARED and getattr(held, key, None) != value]
    if differ:
        raise ValueError("the tower is not the one the LLM's config describes: "
                         + "; ".join(differ[:4]))
    return config


def _processor(parts: ModelParts, vision: dict[str, Any], model_type: str):
    """transformers' processor for the folder: an image processor with our processor's
    bounds, mean and std; a video processor with our video processor's settings (without
    one, the image processor's); and the tokenizer with its own chat template."""
    import transformers

    settings = qwen_preprocessor(parts.processor, vision)
    settings.pop("image_processor_type")
    sizes = {key: settings[key] for key in ("patch_size", "merge_size", "temporal_patch_size")}
    video_settings = {"size": {"shortest_edge": settings["min_pixels"],
                               "longest_edge": settings["max_pixels"]},
                      "image_mean": settings["image_mean"], "image_std": settings["image_std"]}
    if parts.video_processor is not None:
        rule = RULE_OF[model_type]
        if parts.video_processor.rule != rule:
            raise ValueError(f"the video processor sizes clips by the {parts.video_processor.rule}"
                             f" rule, but {model_type}'s video processor by the {rule} rule")
        video_settings = parts.video_processor.to_transformers()
    tokenizer = copy.deepcopy(parts.tokenizer)  # the caller's is left alone
    video = getattr(transformers, VIDEO_PROCESSORS.get(model_type, "Qwen2VLVideoProcessor"))
    return getattr(transformers, FAMILIES[model_type][1] + "Processor")(
        image_processor=transformers.Qwen2VLImageProcessor(**settings), tokenizer=tokenizer,
        video_processor=video(**{**video_settings, **sizes}),
        chat_template=tokenizer.chat_template)


def write_into(parts: ModelParts, folder: Path, *, merge: bool) -> None:
    """Writes the transformers folder into `folder` (no atomicity: the caller's)."""
    import transformers

    llm = split_peft(parts.llm)[0]
    model_type = family(llm)
    vision, tensors = qwen_vl_tensors(parts, merge=merge)
    config = _checked_config(llm, vision)
    with torch.device("meta"):
        model = getattr(transformers,
                        FAMILIES[model_type][1] + "ForConditionalGeneration")(config)
    model.load_state_dict(tensors, strict=True, assign=True)  # lists every bad key
    model.tie_weights()
    model.save_pretrained(folder)
    _processor(parts, vision, model_type).save_pretrained(folder)


def write_base(parts: ModelParts, folder: Path) -> None:
    """A saved folder's `llm/` for a Qwen-VL model: the base weights (LoRA is saved beside)."""
    write_into(parts, folder, merge=False)


def export_qwen_vl(mm: Any, directory: str | Path) -> Path:
    """Writes `mm` (a `MultimodalLM`; `model` imports this module) as transformers'
    Qwen2-VL, Qwen2.5-VL or Qwen3-VL folder, LoRA merged, atomically; over an earlier export
    none of its files is kept, the user's own are.

    Raises:
        ValueError: naming what cannot be written (another family, a tower Qwen's cannot
            hold, a tower the config does not describe); nothing is written then.
    """
    parts = ModelParts(mm.tower, mm.llm, mm.tokenizer, mm.processor, mm.image_token,
                       deepstack=mm.deepstack, video_processor=mm.video_processor)
    family(split_peft(mm.llm)[0])  # before the folder is touched
    with atomic_directory(directory, replaces=EXPORT_FILES) as temp:
        write_into(parts, temp, merge=True)
    logger.info("exported the Qwen-VL model to %s", directory)
    return Path(directory)
