"""Export to Hugging Face's LLaVA layout (`LlavaForConditionalGeneration`, CLIP vision).

The weights move by declarative prefix maps; LoRA adapters are merged into a copy first. The
folder also gets the tokenizer and a `LlavaProcessor` (a `CLIPImageProcessor` with our
preprocessing), so `AutoProcessor` and `LlavaForConditionalGeneration.from_pretrained` read it
as they read the published LLaVA-1.5 checkpoints.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vlm_vit.convert.hf_clip import (
    check_expressible,
    hf_clip_config,
    hf_clip_tensors,
    preprocessor_config,
)
from vlm_vit.files import atomic_directory

if TYPE_CHECKING:
    from vlm_vit_llm.model import MultimodalLM

logger = logging.getLogger(__name__)

# Our names (prefix) -> LLaVA's (prefix); the LLM's own prefix is filled in from the model.
PROJECTOR_KEYS = {"0.": "model.multi_modal_projector.linear_1.",
                  "2.": "model.multi_modal_projector.linear_2."}
VISION_PREFIX = "model.vision_tower."  # + "vision_model." before transformers 5
LANGUAGE_PREFIX = "model.language_model."
PROJECTOR_NAME = "mlp2x_gelu"  # LLaVA-1.5's projector: Linear, GELU, Linear (with biases)


def check_exportable(mm: MultimodalLM) -> None:
    """Raises a ValueError naming every part LLaVA's layout cannot hold."""
    tower = mm.tower
    problems = []
    spec = getattr(tower.pooler, "pooler_spec", None) or {}
    if spec.get("name") != PROJECTOR_NAME:
        problems.append(f"the projector is {spec.get('name')!r}; LLaVA holds {PROJECTOR_NAME!r}")
    if tower.feature_layer is None:
        problems.append("the tower reads the final normed tokens (feature_layer=None); LLaVA "
                        "reads hidden states: use feature_layer=-2 (or -1)")
    try:  # before merging a copy of the whole model, not after
        check_expressible(tower.encoder.config)
    except ValueError as error:
        problems.append(str(error))
    if problems:
        raise ValueError("cannot export to the LLaVA layout: " + "; ".join(problems))


def _renamed(state: dict[str, torch.Tensor], prefixes: dict[str, str]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        source = next((p for p in prefixes if name.startswith(p)), None)
        if source is None:
            raise ValueError(f"no LLaVA name for {name!r} (known prefixes: {sorted(prefixes)})")
        out[prefixes[source] + name[len(source):]] = tensor
    return out


def llava_tensors(mm: MultimodalLM, vision_prefix: str = VISION_PREFIX
                  ) -> dict[str, torch.Tensor]:
    """Every weight under `LlavaForConditionalGeneration`'s names (adapters must be merged).

    `vision_prefix` replaces the `vision_model.` that `hf_clip_tensors` writes.
    """
    llm = mm.llm
    tensors = _renamed(hf_clip_tensors(mm.tower.encoder), {"vision_model.": vision_prefix})
    tensors.update(_renamed(mm.tower.pooler.state_dict(), PROJECTOR_KEYS))
    # The causal LM holds its decoder under `base_model_prefix` and the head beside it.
    prefix = llm.base_model_prefix + "."
    head = {name: name for name, _ in llm.named_parameters() if not name.startswith(prefix)}
    tensors.update(_renamed(llm.state_dict(), {prefix: LANGUAGE_PREFIX, **head}))
    return tensors


def llava_config(mm: MultimodalLM):
    """The `LlavaConfig`: CLIP vision config, the LLM's config, the image token and layers."""
    from transformers import CLIPVisionConfig, LlavaConfig

    tower, llm = mm.tower, mm.llm
    return LlavaConfig(
        vision_config=CLIPVisionConfig(**hf_clip_config(tower.encoder)),
        text_config=llm.config,
        image_token_index=mm.image_token_id,
        image_seq_length=tower.num_image_tokens(),
        projector_hidden_act="gelu",
        vision_feature_layer=tower.feature_layer,
        vision_feature_select_strategy="default" if tower.drop_prefix else "full",
        multimodal_projector_bias=True,
        tie_word_embeddings=bool(getattr(llm.config, "tie_word_embeddings", False)),
    )


def export_llava(mm: MultimodalLM, directory: str | Path) -> Path:
    """Writes `mm` as a Hugging Face LLaVA folder, atomically.

    Raises:
        ValueError: naming every part the layout cannot hold (a projector other than
            `mlp2x_gelu`, the final-norm tokens, an encoder CLIP cannot express); nothing is
            written then.
    """
    from transformers import CLIPImageProcessor, LlavaForConditionalGeneration, LlavaProcessor

    check_exportable(mm)
    merged = mm.merged()
    config = llava_config(merged)
    settings = preprocessor_config(merged.processor)
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    nested = any(name.startswith(VISION_PREFIX + "vision_model.") for name in model.state_dict())
    tensors = llava_tensors(merged, VISION_PREFIX + ("vision_model." if nested else ""))
    model.load_state_dict(tensors, strict=True, assign=True)  # lists every bad key
    settings.pop("image_processor_type")
    tokenizer = merged.tokenizer  # merged's own copy: the caller's tokenizer is left alone
    if tokenizer.pad_token is None:  # batched processing needs one; LLaVA-1.5 pads with unk
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
        logger.info("the exported tokenizer pads with %r", tokenizer.pad_token)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(**settings), tokenizer=tokenizer,
        patch_size=merged.tower.encoder.config.patch_size,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        image_token=merged.image_token,
        num_additional_image_tokens=int(merged.tower.encoder.config.class_token))
    with atomic_directory(directory) as temp:
        model.save_pretrained(temp)
        processor.save_pretrained(temp)
    logger.info("exported the LLaVA model to %s", directory)
    return Path(directory)
