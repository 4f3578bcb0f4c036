"""AnyRes LLaVA layouts: LLaVA-NeXT (`LlavaNextForConditionalGeneration`) and LLaVA-OneVision
(`LlavaOnevisionForConditionalGeneration`), written for a tiled tower and read back.

The tiling picks the layout: `max_feature_tiles` set is OneVision's `anyres_max_N`, else
LLaVA-NeXT. Both hold the LLaVA weights (`vlm_vit_llm.llava`), the pinpoints as
`image_grid_pinpoints`, the tile as the vision config's `image_size`, and the learned newline
as `model.image_newline`. Their processors tile as ours does (the base view squashed to one
tile, then the tiles of the best canvas), so the written processor gives our pixels.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from vlm_vit.config import is_int
from vlm_vit.convert.hf_common import PIL_RESAMPLE
from vlm_vit.io.files import read_json
from vlm_vit.processor import ImageProcessor, Tiling
from vlm_vit.processor.anyres import MAX_PINPOINTS
from vlm_vit.tower import VisionTower
from vlm_vit_llm.hf_reading import (
    bounded,
    causal_lm,
    check_causal_lm,
    checked_image_token,
    image_processor_settings,
    projector_state,
)
from vlm_vit_llm.peft_helpers import split_peft
from vlm_vit_llm.saving import ModelParts

logger = logging.getLogger(__name__)

NEWLINE_KEY = "model.image_newline"
ONEVISION_RATIO = "anyres_max_{}"  # OneVision's vision_aspect_ratio for max_feature_tiles N
VIDEO_TOKEN = "<video>"
MODEL_TYPES = {"llava_next": "LlavaNext", "llava_onevision": "LlavaOnevision"}


def is_onevision(tiling: Tiling) -> bool:
    """OneVision's layout holds the `anyres_max_N` shrink; LLaVA-NeXT's does not."""
    return tiling.max_feature_tiles is not None


def tiling_problems(tower: VisionTower, processor: ImageProcessor) -> list[str]:
    """What the AnyRes layouts cannot hold of a tiled tower and its processor, one line
    each, naming the setting (empty when it exports)."""
    tiling = tower.tiling
    problems = []
    if not tiling.base_image:
        problems.append("tiling base_image=False: LLaVA-NeXT and OneVision always put the "
                        "base view first")
    if not tiling.newline:
        problems.append("tiling newline=False: LLaVA-NeXT and OneVision end every row with "
                        "image_newline")
    encoder = split_peft(tower.encoder)[0]
    image_size = encoder.config.image_size
    if (tiling.tile_size,) * 2 != (tuple(image_size) if isinstance(image_size, (list, tuple))
                                   else (image_size,) * 2):
        problems.append(f"tiling tile_size {tiling.tile_size} is not the encoder's image_size "
                        f"{image_size}: transformers tiles by the vision config's image_size")
    if encoder.num_prefix_tokens != 1:
        problems.append(f"the encoder has {encoder.num_prefix_tokens} prefix tokens; "
                        "vision_feature_select_strategy 'default' drops exactly one (the class "
                        "token)")
    if processor.resize_mode == "native":
        problems.append("processor resize_mode 'native': the AnyRes processors resize")
    return problems


def anyres_config(tower: VisionTower, llava: Any):
    """`LlavaNextConfig` or `LlavaOnevisionConfig` for a tiled tower, with `llava`'s (a
    `LlavaConfig`) fields."""
    import transformers

    tiling = tower.tiling
    fields = {name: getattr(llava, name) for name in (
        "image_token_index", "projector_hidden_act", "vision_feature_layer",
        "vision_feature_select_strategy", "multimodal_projector_bias", "tie_word_embeddings")}
    fields.update(vision_config=llava.vision_config, text_config=llava.text_config,
                  image_grid_pinpoints=[list(p) for p in tiling.pinpoints])
    if is_onevision(tiling):
        return transformers.LlavaOnevisionConfig(
            **fields, vision_aspect_ratio=ONEVISION_RATIO.format(tiling.max_feature_tiles))
    return transformers.LlavaNextConfig(**fields, image_seq_length=tower.num_image_tokens())


def model_class(tiling: Tiling):
    import transformers

    return (transformers.LlavaOnevisionForConditionalGeneration if is_onevision(tiling)
            else transformers.LlavaNextForConditionalGeneration)


def image_processor(processor: ImageProcessor):
    """The PIL image processor of the layout, set to give `processor`'s pixels. Saved, it
    loads by default as transformers' torchvision backend, whose bicubic resize rounds one
    uint8 level off PIL's now and then; `backend="pil"` loads this one."""
    import transformers

    tiling, tile = processor.tiling, processor.tiling.tile_size
    codes = {name: code for code, name in PIL_RESAMPLE.items()}
    settings = dict(image_grid_pinpoints=[list(p) for p in tiling.pinpoints],
                    resample=codes[processor.resample], do_rescale=True,
                    rescale_factor=1 / 255, do_normalize=True, image_mean=list(processor.mean),
                    image_std=list(processor.std), do_convert_rgb=True, do_pad=True)
    if is_onevision(tiling):
        return transformers.LlavaOnevisionImageProcessorPil(
            size={"height": tile, "width": tile}, **settings)
    return transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
        do_center_crop=True, do_resize=True, **settings)


def anyres_processor(tower: VisionTower, processor: ImageProcessor, image_token: str,
                     tokenizer: Any, config: Any, chat_template: str):
    """`LlavaNextProcessor` or `LlavaOnevisionProcessor` for a tiled tower, its processor and
    image token, counting as the tower does (OneVision's: `tokenizer` gets a "<video>"
    token, and `config` its id)."""
    import transformers

    tiling = tower.tiling
    common = dict(image_processor=image_processor(processor), tokenizer=tokenizer,
                  vision_feature_select_strategy=config.vision_feature_select_strategy,
                  image_token=image_token, chat_template=chat_template)
    if is_onevision(tiling):
        # Its count is the base view's num_image_tokens, less one for "default" (the CLS).
        # Its processor counts "<video>" in every text: without the token, unknown pieces
        # read as it. The written config names its id (the LLM never sees one from us).
        if tokenizer.convert_tokens_to_ids(VIDEO_TOKEN) in (None, tokenizer.unk_token_id):
            tokenizer.add_tokens([VIDEO_TOKEN], special_tokens=True)
        config.video_token_index = tokenizer.convert_tokens_to_ids(VIDEO_TOKEN)
        # A video processor it must have; videos are not ours to reproduce.
        video = transformers.LlavaOnevisionVideoProcessor(
            size={"height": tiling.tile_size, "width": tiling.tile_size},
            image_mean=list(processor.mean), image_std=list(processor.std))
        return transformers.LlavaOnevisionProcessor(
            **common, video_processor=video, video_token=VIDEO_TOKEN,
            num_image_tokens=tower.tile_side ** 2 + 1,
            vision_aspect_ratio=config.vision_aspect_ratio)
    return transformers.LlavaNextProcessor(
        **common, patch_size=split_peft(tower.encoder)[0].config.patch_size,
        num_additional_image_tokens=1)


# ---- reading ------------------------------------------------------------------------------

def read_llava(directory: str | Path, *, dtype: torch.dtype | None = None) -> ModelParts:
    """The parts of a `MultimodalLM` (`MultimodalLM.from_pretrained` joins them), for
    inference, from a transformers LLaVA-NeXT or OneVision folder (`save_pretrained` of
    `LlavaNextForConditionalGeneration` or `LlavaOnevisionForConditionalGeneration`, or our
    export).

    The vision tower goes through vlm-vit's own converters (`load_tower`), the projector
    and `image_newline` are copied, the language model becomes its causal LM
    (`AutoModelForCausalLM` on `text_config`), its head tied to the embeddings exactly when
    transformers ties them (`hf_reading.causal_lm`), and the tokenizer and processor are read
    from the folder. `config.json` is checked (`check_config`) before any weight is read.

    Raises:
        ValueError: naming the file and the setting our tiled tower cannot hold (a projector
            other than LLaVA's, the 'full' feature selection, pinpoints that are not a list
            of at most `MAX_PINPOINTS` pairs, an image token the tokenizer lacks, an untied
            head the weights do not hold), in one line of bounded length.
    """
    import transformers
    from huggingface_hub.errors import StrictDataclassError

    from vlm_vit import build_pooler, load_tower

    directory = Path(directory)
    source = f"{directory / 'config.json'}"
    max_tiles = check_config(read_json(directory / "config.json"), source)
    try:
        config = transformers.AutoConfig.from_pretrained(directory)
    except StrictDataclassError as error:  # a field of the wrong type: one bounded line
        raise ValueError(f"{source}: {bounded(error)}") from None
    check_causal_lm(config.text_config, source)
    vision = config.vision_config
    try:
        tiling = Tiling(pinpoints=config.image_grid_pinpoints, tile_size=vision.image_size,
                        max_feature_tiles=max_tiles)
    except ValueError as error:  # before the weights: image_grid_pinpoints and image_size
        raise ValueError(f"{source}: {bounded(error)}") from None
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    image_token = checked_image_token(tokenizer, directory, config.image_token_index, source)
    processor = _our_processor(directory, tiling)
    model, loading = getattr(transformers, MODEL_TYPES[config.model_type]
                             + "ForConditionalGeneration").from_pretrained(
        directory, dtype=dtype, output_loading_info=True)
    width = config.text_config.hidden_size
    with tempfile.TemporaryDirectory(prefix="vlm-vit-llava-") as folder:
        model.model.vision_tower.save_pretrained(folder)
        loaded = load_tower(folder, "mlp2x_gelu", out_dim=width,
                            feature_layer=config.vision_feature_layer)
    pooler = build_pooler("mlp2x_gelu", in_dim=loaded.feature_dim, out_dim=width)
    pooler.load_state_dict(projector_state(model.model.multi_modal_projector))
    tower = VisionTower(loaded.encoder, pooler, feature_layer=config.vision_feature_layer,
                        processor=processor, tiling=tiling)
    with torch.no_grad():
        tower.image_newline.copy_(model.model.image_newline)
    llm = causal_lm(model, config, loading["missing_keys"], source)
    return ModelParts(tower.to(model.dtype).eval(), llm, tokenizer, processor, image_token,
                      layout=config.model_type)


def check_config(raw: dict[str, Any], source: str) -> int | None:
    """Checks a LLaVA-NeXT / OneVision `config.json`, read as JSON, before transformers
    builds anything from it or a weight is read; returns OneVision's `anyres_max_N` N (None
    for LLaVA-NeXT).

    `image_grid_pinpoints` must be absent (transformers' default) or a list of 1 to
    `MAX_PINPOINTS` (height, width) pairs of positive ints; every value echoed is bounded,
    so each message is one line of at most a few hundred characters.

    Raises:
        ValueError: naming `source` and the field.
    """
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise ValueError(f"{source}: model_type {bounded(model_type)} is not one of "
                         f"{sorted(MODEL_TYPES)}")
    pinpoints = raw.get("image_grid_pinpoints")
    if pinpoints is not None:
        if not isinstance(pinpoints, list) or not 0 < len(pinpoints) <= MAX_PINPOINTS:
            size = f" of {len(pinpoints)}" if isinstance(pinpoints, list) else ""
            raise ValueError(f"{source}: image_grid_pinpoints must be a list of 1 to "
                             f"{MAX_PINPOINTS} [height, width] pairs, got "
                             f"{type(pinpoints).__name__}{size} {bounded(pinpoints)}")
        for number, pinpoint in enumerate(pinpoints):
            if not (isinstance(pinpoint, list) and len(pinpoint) == 2
                    and all(is_int(side) and side > 0 for side in pinpoint)):
                raise ValueError(f"{source}: image_grid_pinpoints[{number}] is not a [height, "
                                 f"width] pair of positive ints: {bounded(pinpoint)}")
    for name, wanted, why in (
            ("projector_hidden_act", "gelu", "vlm-vit's mlp2x_gelu is GELU"),
            ("multimodal_projector_bias", True, "vlm-vit's mlp2x_gelu has biases"),
            ("vision_feature_select_strategy", "default", "a tiled tower drops the class "
             "token ('default')")):
        if raw.get(name, wanted) != wanted:  # absent: transformers' default, the wanted one
            raise ValueError(f"{source}: {name} {bounded(raw[name])}: {why}")
    if model_type != "llava_onevision":
        return None
    ratio = raw.get("vision_aspect_ratio", "anyres_max_9")  # transformers' default
    digits = ratio.removeprefix("anyres_max_") if isinstance(ratio, str) else ""
    if not (isinstance(ratio, str) and ratio.startswith("anyres_max_") and digits.isdigit()
            and len(digits) <= 6):
        raise ValueError(f"{source}: vision_aspect_ratio {bounded(ratio)} is not anyres_max_N")
    return int(digits)


def _our_processor(directory: Path, tiling: Tiling) -> ImageProcessor:
    """Our processor from the folder's image processor settings (mean, std, resample;
    `hf_reading.image_processor_settings`)."""
    settings, path = image_processor_settings(directory)
    resample = PIL_RESAMPLE.get(settings.get("resample", 3))
    if resample is None:
        raise ValueError(f"{path}: resample {bounded(settings.get('resample'))}; vlm-vit "
                         f"resizes with {sorted(PIL_RESAMPLE.values())}")
    clip = ImageProcessor.for_family("clip", size=tiling.tile_size)
    mean = tuple(settings.get("image_mean", clip.mean))
    std = tuple(settings.get("image_std", clip.std))
    return ImageProcessor(size=tiling.tile_size, mean=mean, std=std, resample=resample,
                          tiling=tiling)
