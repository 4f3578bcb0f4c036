"""Which reader a transformers multimodal folder needs, by its `config.json`'s `model_type`
(a folder vlm-vit-llm saved, with `multimodal_config.json`, is `saving.read_folder`'s)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vlm_vit.io.files import read_json
from vlm_vit_llm.hf_reading import bounded
from vlm_vit_llm.llava_next import read_llava
from vlm_vit_llm.llava_reader import read_llava15
from vlm_vit_llm.qwen_vl_reader import IMAGE_PROMPT, read_qwen_vl
from vlm_vit_llm.saving import CONFIG_NAME, ModelParts

READERS: dict[str, Callable[..., ModelParts]] = {
    "llava": read_llava15, "llava_next": read_llava, "llava_onevision": read_llava,
    "qwen2_vl": read_qwen_vl, "qwen2_5_vl": read_qwen_vl, "qwen3_vl": read_qwen_vl}
# How an image stands in the prompts of the families that wrap it in tokens of their own.
IMAGE_PROMPTS = {model_type: IMAGE_PROMPT for model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")}
RECORD_PLACEHOLDER = "<image>"  # what LLaVA-format records write for an image


def transformers_reader(directory: Path) -> Callable[..., ModelParts] | None:
    """The reader of `directory` when it is a transformers folder (a `config.json` and no
    `multimodal_config.json`), else None.

    Raises:
        ValueError: naming the file, for a `model_type` no reader takes.
    """
    if (directory / CONFIG_NAME).is_file() or not (directory / "config.json").is_file():
        return None
    model_type = read_json(directory / "config.json").get("model_type")
    if not isinstance(model_type, str) or model_type not in READERS:
        raise ValueError(f"{directory / 'config.json'}: model_type {bounded(model_type)} is "
                         f"not a multimodal model vlm-vit-llm reads ({', '.join(READERS)}); "
                         f"a folder vlm-vit-llm saved holds {CONFIG_NAME}")
    return READERS[model_type]


def record_placeholder(directory: Path) -> tuple[str, str | None]:
    """For LLaVA-format records training the model in `directory`: the placeholder they hold
    for an image, and what it becomes in the model's prompts (None: itself). A folder
    vlm-vit-llm saved says its own image token; Qwen-VL models (transformers' folders, or
    ours holding one) take `<image>` as `IMAGE_PROMPTS` writes an image."""
    if (directory / CONFIG_NAME).is_file():
        config = read_json(directory / CONFIG_NAME)
        if config.get("llm_layout") in IMAGE_PROMPTS:
            return RECORD_PLACEHOLDER, IMAGE_PROMPTS[config["llm_layout"]]
        return config.get("image_token", RECORD_PLACEHOLDER), None
    if (directory / "config.json").is_file():
        model_type = read_json(directory / "config.json").get("model_type")
        if isinstance(model_type, str) and model_type in IMAGE_PROMPTS:
            return RECORD_PLACEHOLDER, IMAGE_PROMPTS[model_type]
    return RECORD_PLACEHOLDER, None
