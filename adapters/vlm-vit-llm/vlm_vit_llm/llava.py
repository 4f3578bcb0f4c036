"""Export to Hugging Face's LLaVA layout (`LlavaForConditionalGeneration`, CLIP vision).

The weights move by declarative prefix maps; LoRA adapters are merged into the written
tensors one weight at a time, leaving the model as it was. The folder also gets the tokenizer
and a `LlavaProcessor` (an image processor that reproduces our pixels, and a chat template
that takes transformers' structured content), so `AutoProcessor` and
`LlavaForConditionalGeneration.from_pretrained` read it as they read the published LLaVA-1.5
checkpoints, and transformers' LLaVA documentation prompts it as written. A tiled (AnyRes)
tower is written as LLaVA-NeXT or OneVision instead (`vlm_vit_llm.llava_next`).
"""

from __future__ import annotations

import copy
import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import vlm_vit_llm.llava_next as llava_next
from vlm_vit import VisionEncoder
from vlm_vit.convert.hf_clip import (
    check_expressible,
    hf_clip_config,
    hf_clip_tensors,
    preprocessor_config,
)
from vlm_vit.io.files import atomic_directory
from vlm_vit_llm.chat import adds_bos, chat_template, structured_chat_template
from vlm_vit_llm.peft_helpers import merged_state, merged_tied_state, split_peft
from vlm_vit_llm.saving import EXPORT_FILES

if TYPE_CHECKING:
    from vlm_vit_llm.model import MultimodalLM

logger = logging.getLogger(__name__)

# Our names (prefix) -> LLaVA's (prefix); the LLM's own prefix is filled in from the model.
PROJECTOR_KEYS = {"0.": "model.multi_modal_projector.linear_1.",
                  "2.": "model.multi_modal_projector.linear_2."}
VISION_PREFIX = "model.vision_tower."  # + "vision_model." before transformers 5
LANGUAGE_PREFIX = "model.language_model."
PROJECTOR_NAME = "mlp2x_gelu"  # LLaVA-1.5's projector: Linear, GELU, Linear (with biases)
# transformers' names for an image processor doing CLIP's steps, in the order tried: the first
# that `AutoImageProcessor.from_pretrained` loads, with default arguments, as one giving our
# pixels is written. transformers 5 loads "CLIPImageProcessor" as its torchvision backend,
# whose bicubic resize rounds otherwise than PIL's (one uint8 level in about 0.4% of values);
# the PIL backend, under its own name, gives ours exactly (tests/test_llava_processor.py).
IMAGE_PROCESSOR_CLASSES = ("CLIPImageProcessor", "PilBackend")
PIXEL_TOLERANCE = 1e-5  # what the README promises of the export's pixels


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
    if tower.tiling is not None:  # LLaVA-NeXT or OneVision, whose processors tile
        problems.extend(llava_next.tiling_problems(tower, mm.processor))
    else:
        try:  # transformers' CLIPImageProcessor must give our pixels
            preprocessor_config(mm.processor)
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
    """Every weight under `LlavaForConditionalGeneration`'s names, LoRA adapters merged in.

    `mm` is not changed: a LoRA-wrapped weight becomes a new tensor (`merged_state`), every
    other tensor is `mm`'s own. Names an LLM ties to one parameter (the output head of a
    `tie_word_embeddings` LLM) all map to one tensor object. `vision_prefix` replaces the
    `vision_model.` that `hf_clip_tensors` writes.

    Raises:
        ValueError: when LoRA changes one of two tied weights but not the other.
    """
    encoder, encoder_adapter = split_peft(mm.tower.encoder)
    if encoder_adapter is not None:  # a plain encoder on the merged tensors, nothing copied
        encoder = VisionEncoder.from_state_dict(merged_state(encoder_adapter), encoder.config)
    tensors = _renamed(hf_clip_tensors(encoder), {"vision_model.": vision_prefix})
    tensors.update(_renamed(mm.tower.pooler.state_dict(), PROJECTOR_KEYS))
    # The causal LM holds its decoder under `base_model_prefix` and the head beside it.
    llm = split_peft(mm.llm)[0]
    state = merged_tied_state(mm.llm)
    prefix = llm.base_model_prefix + "."
    head = {name: name for name in state if not name.startswith(prefix)}
    tensors.update(_renamed(state, {prefix: LANGUAGE_PREFIX, **head}))
    return tensors


def _probe_image():
    """A fixed 47 x 61 noise image: resized to any size, hundreds of its values fall where
    two resize implementations round differently."""
    from PIL import Image

    noise = torch.randint(0, 256, (61, 47, 3), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0))
    return Image.fromarray(noise.numpy())


def image_processor_for(processor, settings: dict):
    """The transformers image processor to export: the first of `IMAGE_PROCESSOR_CLASSES`
    that, saved and loaded back by `AutoImageProcessor.from_pretrained` with its defaults,
    gives `processor`'s pixels on `_probe_image` (within `PIXEL_TOLERANCE`). When none does,
    the first is returned and the difference is logged as a warning.

    Args:
        processor: our `ImageProcessor`.
        settings: its transformers settings (`preprocessor_config`, less the class name).
    """
    import transformers
    from transformers import AutoImageProcessor

    probe = _probe_image()
    expected = processor.preprocess_one(probe)
    candidates, measured = [], []
    with tempfile.TemporaryDirectory(prefix="vlm-vit-export-") as folder:
        for name in IMAGE_PROCESSOR_CLASSES:
            if not hasattr(transformers, name):  # PilBackend is transformers 5's
                continue
            candidate = getattr(transformers, name)(**settings)
            candidates.append(candidate)
            candidate.save_pretrained(Path(folder) / name)
            loaded = AutoImageProcessor.from_pretrained(Path(folder) / name)
            pixels = loaded(images=probe, return_tensors="pt")["pixel_values"][0]
            difference = (torch.as_tensor(pixels) - expected).abs().max().item()
            if difference <= PIXEL_TOLERANCE:
                logger.debug("exporting the image processor as %s (loads as %s)", name,
                             type(loaded).__name__)
                return candidate
            measured.append(f"{name} loads as {type(loaded).__name__}, {difference:.2g} off")
    logger.warning("no transformers image processor reproduces our pixels within %g (%s); "
                   "exporting the first", PIXEL_TOLERANCE, "; ".join(measured))
    return candidates[0]


def llava_config(mm: MultimodalLM):
    """The `LlavaConfig`: CLIP vision config, the LLM's config, the image token and layers."""
    from transformers import CLIPVisionConfig, LlavaConfig

    tower, llm = mm.tower, split_peft(mm.llm)[0]
    return LlavaConfig(
        vision_config=CLIPVisionConfig(**hf_clip_config(split_peft(tower.encoder)[0])),
        text_config=llm.config,
        image_token_index=mm.image_token_id,
        image_seq_length=tower.num_image_tokens(),
        projector_hidden_act="gelu",
        vision_feature_layer=tower.feature_layer,
        vision_feature_select_strategy="full" if tower.keep_prefix else "default",
        multimodal_projector_bias=True,
        tie_word_embeddings=bool(getattr(llm.config, "tie_word_embeddings", False)),
    )


def export_llava(mm: MultimodalLM, directory: str | Path) -> Path:
    """Writes `mm` as a Hugging Face LLaVA folder, atomically. Over an earlier export, none
    of its files (`EXPORT_FILES`) is kept; the user's own files are carried over. A tiled
    tower is written as `LlavaNextForConditionalGeneration` (or, with `max_feature_tiles`,
    `LlavaOnevisionForConditionalGeneration`) with its processor (`vlm_vit_llm.llava_next`).

    Raises:
        ValueError: naming every part the layout cannot hold (a projector other than
            `mlp2x_gelu`, the final-norm tokens, an encoder CLIP cannot express, a tiling
            setting LLaVA-NeXT cannot); nothing is written then.
    """
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

    check_exportable(mm)
    tiling = mm.tower.tiling
    config = llava_config(mm)
    if tiling is not None:
        config = llava_next.anyres_config(mm.tower, config)
    with torch.device("meta"):
        model = (LlavaForConditionalGeneration if tiling is None
                 else llava_next.model_class(tiling))(config)
    nested = any(name.startswith(VISION_PREFIX + "vision_model.") for name in model.state_dict())
    # LoRA is merged into the written tensors one weight at a time, never into a copy of
    # the whole model (the frozen LLM would be copied with it).
    tensors = llava_tensors(mm, VISION_PREFIX + ("vision_model." if nested else ""))
    if tiling is not None:
        tensors[llava_next.NEWLINE_KEY] = mm.tower.image_newline.detach()
    model.load_state_dict(tensors, strict=True, assign=True)  # lists every bad key
    # `assign` gives each of a tied pair of names its own Parameter (on one storage): tie
    # them again, so the model written is the one transformers builds from the config.
    model.tie_weights()
    encoder_config = split_peft(mm.tower.encoder)[0].config
    tokenizer = copy.deepcopy(mm.tokenizer)  # the caller's tokenizer is left alone
    if tokenizer.pad_token is None:  # batched processing needs one; LLaVA-1.5 pads with unk
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
        logger.info("the exported tokenizer pads with %r", tokenizer.pad_token)
    # Its own template, else vicuna_v1 (as `vlm-vit llm generate --chat`), taking structured
    # content too; the processor and the tokenizer share the folder's chat_template.jinja.
    tokenizer.chat_template = structured_chat_template(
        chat_template(tokenizer), mm.image_token, drop_bos=adds_bos(tokenizer))
    if tiling is not None:
        processor = llava_next.anyres_processor(mm.tower, mm.processor, mm.image_token,
                                                tokenizer, config, tokenizer.chat_template)
    else:
        settings = preprocessor_config(mm.processor)
        settings.pop("image_processor_type")
        processor = LlavaProcessor(
            image_processor=image_processor_for(mm.processor, settings), tokenizer=tokenizer,
            patch_size=encoder_config.patch_size,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            image_token=mm.image_token,
            num_additional_image_tokens=int(encoder_config.class_token),
            chat_template=tokenizer.chat_template)
    with atomic_directory(directory, replaces=EXPORT_FILES) as temp:
        model.save_pretrained(temp)
        processor.save_pretrained(temp)
    logger.info("exported the LLaVA model to %s", directory)
    return Path(directory)
