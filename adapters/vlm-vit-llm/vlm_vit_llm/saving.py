"""A `MultimodalLM` on disk: the folder `save_pretrained` writes from the model's parts
(`write_folder`), and the parts `from_pretrained` assembles read back (`read_folder`).

    multimodal_config.json   the image token and which adapters there are
    tower/                   the VisionTower (base weights) and the processor
    llm/                     the LLM's base weights and config, and the tokenizer (for a
                             Qwen-VL model: transformers' own folder, tower included)
    llm_adapter/             peft's LoRA adapter on the LLM, when there is one
    vision_adapter/          the encoder's LoRA adapter (`vlm_vit.adapt.lora`), likewise
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit import ImageProcessor, VisionEncoder, VisionTower
from vlm_vit.io.card import PLACEHOLDER, model_card, write_card
from vlm_vit.io.files import MODEL_FILES, atomic_directory, atomic_write, read_json
from vlm_vit.io.integrity import MANIFEST_NAME, read_manifest, verify_files, write_manifest
from vlm_vit_llm.mrope import multimodal_rope
from vlm_vit_llm.peft_helpers import base_state, quiet_peft, split_peft
from vlm_vit_llm.video_processor import VideoProcessor

logger = logging.getLogger(__name__)

CONFIG_NAME = "multimodal_config.json"
TOWER_DIR, LLM_DIR = "tower", "llm"
LLM_ADAPTER_DIR, VISION_ADAPTER_DIR = "llm_adapter", "vision_adapter"
# What a save replaces whole in an existing folder: the previous model's files and every
# sub-folder (a new save without an adapter leaves no stale one behind); the user's own
# files are carried over.
SAVED_ENTRIES = (*MODEL_FILES, TOWER_DIR, LLM_DIR, LLM_ADAPTER_DIR, VISION_ADAPTER_DIR)
# The sub-folders hashed in their own `manifest.json` (the tower writes its own).
HASHED_DIRS = (LLM_DIR, LLM_ADAPTER_DIR, VISION_ADAPTER_DIR)
UNHASHED_FILES = (MANIFEST_NAME, "README.md")  # a card the user may edit is not a weight
# An earlier export's files, which an export over it replaces even where it writes no file of
# that name (a chat template or a SentencePiece model the new tokenizer lacks).
EXPORT_FILES = (*MODEL_FILES, "*.jinja", "*.model", "*.tiktoken", "merges.txt", "vocab.txt")
LAYOUT = "vlm_vit_llm"  # the config's "format": this module's folder layout


@dataclass
class ModelParts:
    """A `MultimodalLM`'s parts, as a folder holds them (`MultimodalLM(tower, llm, tokenizer,
    image_token=..., processor=...)` joins them).

    Attributes:
        tower: the `VisionTower` (its encoder a peft model when LoRA is on it).
        llm: the causal LM, or a peft model on one.
        tokenizer: the LLM's tokenizer.
        processor: the tower's `ImageProcessor`.
        image_token: the placeholder string in prompts.
        layout: the folder's layout: `LAYOUT`, or transformers' model type of a LLaVA folder
            (`vlm_vit_llm.llava_next.MODEL_TYPES`).
        video_token: a clip's own placeholder string, or None (Qwen-VL's `<|video_pad|>`).
        deepstack: Qwen3-VL's DeepStack mergers (`vlm_vit_llm.deepstack.DeepStack`), or None.
        video_processor: what sizes a clip's frames (`vlm_vit_llm.video_processor`), or None.
    """

    tower: VisionTower
    llm: nn.Module
    tokenizer: Any
    processor: ImageProcessor
    image_token: str
    layout: str = LAYOUT
    video_token: str | None = None
    deepstack: nn.Module | None = None
    video_processor: VideoProcessor | None = None


def write_folder(parts: ModelParts, directory: str | Path, *,
                 base_writer: Callable[[ModelParts, Path], None] | None = None) -> Path:
    """`MultimodalLM.save_pretrained`: the parts written to `directory` (see there).

    Args:
        base_writer: for a model transformers holds whole (Qwen-VL: the language model is
            the multimodal class), what writes the base weights, tower included, into
            `llm/` as transformers' own folder (`vlm_vit_llm.qwen_vl_writer.base_writer`);
            `tower/` is not written then and the config records `llm_layout`.

    Raises:
        ValueError: for a multimodal-RoPE LLM without a `base_writer` (its language model
            has no causal-LM class to be read back as).
    """
    from vlm_vit.adapt.lora import save_adapter

    directory = Path(directory)
    llm_base, llm_adapter = split_peft(parts.llm)
    if base_writer is None and multimodal_rope(getattr(llm_base, "config", None)):
        raise ValueError(f"{type(llm_base).__name__} (multimodal RoPE) is saved only with "
                         "its tower, as transformers' own folder: save it through "
                         "MultimodalLM.save_pretrained")
    encoder_base, encoder_adapter = split_peft(parts.tower.encoder)
    tower = parts.tower
    if encoder_adapter is not None:  # the tower again, on the encoder without LoRA
        encoder = VisionEncoder.from_state_dict(base_state(encoder_base),
                                                encoder_base.config)
        tower = VisionTower(encoder, tower.pooler, tower.feature_layer, tower.keep_prefix,
                            processor=tower.processor, tiling=tower.tiling)
        tower.image_newline = parts.tower.image_newline  # the same parameter, or None
    with atomic_directory(directory, replaces=SAVED_ENTRIES) as temp:
        if base_writer is not None:
            base_writer(parts, temp / LLM_DIR)
        else:
            tower.save_pretrained(temp / TOWER_DIR)
            parts.processor.save_pretrained(temp / TOWER_DIR)
            llm_base.save_pretrained(temp / LLM_DIR, state_dict=base_state(llm_base))
            parts.tokenizer.save_pretrained(temp / LLM_DIR)
        if llm_adapter is not None:
            llm_adapter.save_pretrained(str(temp / LLM_ADAPTER_DIR))
        if encoder_adapter is not None:
            save_adapter(encoder_adapter, temp / VISION_ADAPTER_DIR)
        for name in HASHED_DIRS:
            if (temp / name).is_dir():
                write_manifest(temp / name, _hashed_files(temp / name))
        config = {"format": "vlm_vit_llm", "format_version": 1,
                  "image_token": parts.image_token,
                  "llm_adapter": llm_adapter is not None,
                  "vision_adapter": encoder_adapter is not None}
        if parts.video_token is not None:
            config["video_token"] = parts.video_token
        if parts.video_processor is not None and base_writer is None:  # else in llm/
            config["video_processor"] = parts.video_processor.to_dict()
        if base_writer is not None:
            config["llm_layout"] = llm_base.config.model_type
        with atomic_write(temp / CONFIG_NAME, "w") as handle:
            json.dump(config, handle, indent=2)
            handle.write("\n")
        write_card(temp, _model_card(parts, llm_base))
    logger.info("saved the multimodal model to %s", directory)
    return directory


def _model_card(parts: ModelParts, llm: nn.Module) -> str:
    """The Hub card of a saved model: what it joins, and how to load it."""
    base = getattr(getattr(llm, "config", None), "_name_or_path", "") or ""
    facts = {"LLM": type(llm).__name__ + (f" ({base})" if base else ""),
             "vision encoder": f"{parts.tower.encoder.config.width} wide, "
                               f"{parts.tower.encoder.config.depth} blocks",
             "projector": getattr(parts.tower.pooler, "pooler_spec", {}).get("name"),
             "feature layer": parts.tower.feature_layer,
             "image tokens": parts.tower.num_image_tokens(),
             "image token": f"`{parts.image_token}`",
             "LoRA adapters": ", ".join(name for name, on in (
                 ("LLM", hasattr(parts.llm, "peft_config")),
                 ("encoder", split_peft(parts.tower.encoder)[1] is not None)) if on)
                              or "none"}
    metadata = {"library_name": "vlm-vit", "pipeline_tag": "image-text-to-text",
                "tags": ["vlm-vit", "llava", "multimodal"]}
    if base and not Path(base).exists():  # a Hub name, not a local folder
        metadata["base_model"] = base
    usage = ("from vlm_vit_llm import MultimodalLM\n\n"
             f"mm = MultimodalLM.from_pretrained(\"{PLACEHOLDER}\")\n"
             f"mm.generate([\"{parts.image_token}\\nDescribe it.\"], [[\"photo.jpg\"]])")
    return model_card(metadata, "Multimodal LM (vlm-vit)", facts, usage)


def read_folder(directory: Path, *, trainable: bool, dtype: torch.dtype | None,
                verify: bool | None,
                base_readers: dict[str, Callable[..., ModelParts]] | None = None) -> ModelParts:
    """The parts of a folder `write_folder` wrote (arguments and errors as
    `MultimodalLM.from_pretrained`); `base_readers` read an `llm/` that is transformers' own
    folder, by the config's `llm_layout` (`vlm_vit_llm.readers.READERS`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = read_json(directory / CONFIG_NAME)
    if config.get("format") != "vlm_vit_llm":
        raise ValueError(f"{directory / CONFIG_NAME} is not a vlm-vit-llm model config")
    layout = config.get("llm_layout")
    if layout is not None and layout not in (base_readers or {}):
        raise ValueError(f"{directory / CONFIG_NAME}: llm_layout {str(layout)[:60]!r} is not "
                         f"one this version reads ({', '.join(base_readers or {}) or 'none'})")
    for name in HASHED_DIRS:  # all of them, before the LLM is read
        if (directory / name).is_dir():
            _verify_folder(directory / name, verify)
    deepstack, video = None, config.get("video_processor")
    if video is not None:
        video = VideoProcessor.from_dict(video, f"{directory / CONFIG_NAME}: video_processor")
    if layout is not None:
        base = base_readers[layout](directory / LLM_DIR, dtype=dtype)
        tower, processor, llm, tokenizer = base.tower, base.processor, base.llm, base.tokenizer
        deepstack, video = base.deepstack, base.video_processor
    else:
        tower = VisionTower.from_pretrained(directory / TOWER_DIR, verify=verify)
        processor = ImageProcessor.from_pretrained(directory / TOWER_DIR)
        llm = AutoModelForCausalLM.from_pretrained(directory / LLM_DIR, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(directory / LLM_DIR)
    if config.get("llm_adapter"):
        from peft import PeftModel

        with quiet_peft():
            llm = PeftModel.from_pretrained(llm, str(directory / LLM_ADAPTER_DIR),
                                            is_trainable=trainable)
    if config.get("vision_adapter"):
        from vlm_vit.adapt.lora import load_adapter

        tower.encoder = load_adapter(tower.encoder, directory / VISION_ADAPTER_DIR,
                                     trainable=trainable)
    return ModelParts(tower, llm, tokenizer, processor, config["image_token"],
                      video_token=config.get("video_token"), deepstack=deepstack,
                      video_processor=video)


def _hashed_files(folder: Path) -> list[str]:
    """The files of a saved folder its manifest covers, relative to it (sub-folders too)."""
    return sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*")
                  if path.is_file() and path.name not in UNHASHED_FILES)


def _verify_folder(folder: Path, verify: bool | None) -> None:
    """Checks every file of `folder`, and every one its manifest lists, against the
    manifest (a file planted beside the saved ones is refused as unlisted)."""
    listed = read_manifest(folder) or {}
    verify_files(folder, sorted({*_hashed_files(folder), *listed}), verify)
