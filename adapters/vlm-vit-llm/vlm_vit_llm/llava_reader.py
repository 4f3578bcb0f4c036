"""Reading transformers' LLaVA-1.5 folders (`LlavaForConditionalGeneration`: llava-hf's
checkpoints, a model transformers saved, or our own `export_llava`) as a `MultimodalLM`'s parts.

Everything that decides whether the folder can be represented is checked before a weight is
read: the config (`check_llava_config`), the tokenizer and its image token, the image
processor, the head the tie needs and the tensors' shapes (from the safetensors headers).
The weights are then loaded by transformers itself (every key layout it reads, llava-hf's
`vision_tower.vision_model.*` included), the CLIP tower goes through vlm-vit's converter, the
projector is copied, and the language model becomes its causal LM with its head tied exactly
when transformers ties it (`hf_reading.causal_lm`).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from vlm_vit.config import is_int
from vlm_vit.io.files import read_json
from vlm_vit.processor import ImageProcessor
from vlm_vit.tower import VisionTower
from vlm_vit_llm.hf_reading import (
    bounded,
    causal_lm,
    check_causal_lm,
    checked_image_token,
    image_processor_settings,
    projector_state,
    tensor_shapes,
)
from vlm_vit_llm.saving import ModelParts

logger = logging.getLogger(__name__)

MODEL_TYPE = "llava"
VISION_TYPE = "clip_vision_model"  # transformers' default vision config for LLaVA
STRATEGIES = ("default", "full")
HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")  # as loaded, as saved
MAX_FEATURE_LAYERS = 64


def read_llava15(directory: str | Path, *, dtype: torch.dtype | None = None) -> ModelParts:
    """The parts of a `MultimodalLM`, for inference, from a transformers LLaVA-1.5 folder.

    Raises:
        ValueError: naming the file and what vlm-vit cannot represent (a vision tower other
            than CLIP, a projector other than LLaVA's, a feature layer out of range, an image
            token the tokenizer lacks, a processor that pads to a square or crops to another
            size, an untied head the weights lack, tensors whose shapes disagree with the
            config), in one line of bounded length, before any weight is read.
    """
    import transformers
    from huggingface_hub.errors import StrictDataclassError

    from vlm_vit import build_pooler, load_encoder

    directory = Path(directory)
    source = f"{directory / 'config.json'}"
    check_llava_config(read_json(directory / "config.json"), source)
    try:
        config = transformers.AutoConfig.from_pretrained(directory)
    except StrictDataclassError as error:  # a field of the wrong type: one bounded line
        raise ValueError(f"{source}: {bounded(error)}") from None
    check_causal_lm(config.text_config, source)
    layers = _feature_layers(config, source)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    image_token = checked_image_token(tokenizer, directory, config.image_token_index, source)
    processor = _our_processor(directory, config)
    _check_weights(directory, config, len(layers), source)
    model, loading = transformers.LlavaForConditionalGeneration.from_pretrained(
        directory, dtype=dtype, output_loading_info=True)
    with tempfile.TemporaryDirectory(prefix="vlm-vit-llava-") as folder:
        model.model.vision_tower.save_pretrained(folder)
        encoder = load_encoder(folder)
    width = config.text_config.hidden_size
    pooler = build_pooler("mlp2x_gelu", in_dim=encoder.config.width * len(layers),
                          out_dim=width)
    pooler.load_state_dict(projector_state(model.model.multi_modal_projector))
    tower = VisionTower(encoder, pooler, feature_layer=config.vision_feature_layer,
                        keep_prefix=config.vision_feature_select_strategy == "full",
                        processor=processor)
    llm = causal_lm(model, config, loading["missing_keys"], source)
    return ModelParts(tower.to(model.dtype).eval(), llm, tokenizer, processor, image_token,
                      layout=MODEL_TYPE)


def check_llava_config(raw: dict[str, Any], source: str) -> None:
    """Checks a LLaVA-1.5 `config.json`, read as JSON, before transformers builds anything
    from it: the model type, a CLIP vision tower, LLaVA's projector (GELU, biases), the
    feature selection, and `vision_feature_layer` an int or a short list of ints.

    Raises:
        ValueError: naming `source` and the field, its value bounded.
    """
    if raw.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{source}: model_type {bounded(raw.get('model_type'))} is not "
                         f"{MODEL_TYPE!r}")
    vision = raw.get("vision_config", {})
    vision_type = vision.get("model_type", VISION_TYPE) if isinstance(vision, dict) else vision
    if vision_type != VISION_TYPE:
        raise ValueError(f"{source}: vision_config model_type {bounded(vision_type)}: vlm-vit "
                         f"reads LLaVA's CLIP vision tower ({VISION_TYPE!r})")
    for name, wanted, why in (
            ("projector_hidden_act", "gelu", "vlm-vit's mlp2x_gelu is GELU"),
            ("multimodal_projector_bias", True, "vlm-vit's mlp2x_gelu has biases")):
        if raw.get(name, wanted) != wanted:  # absent: transformers' default, the wanted one
            raise ValueError(f"{source}: {name} {bounded(raw[name])}: {why}")
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in STRATEGIES:
        raise ValueError(f"{source}: vision_feature_select_strategy {bounded(strategy)} is "
                         f"not one of {list(STRATEGIES)}")
    layer = raw.get("vision_feature_layer", -2)
    layers = layer if isinstance(layer, list) else [layer]
    if not (0 < len(layers) <= MAX_FEATURE_LAYERS and all(is_int(item) for item in layers)):
        raise ValueError(f"{source}: vision_feature_layer {bounded(layer)} is not an int or a "
                         f"list of 1 to {MAX_FEATURE_LAYERS} ints")


def _feature_layers(config: Any, source: str) -> list[int]:
    """`vision_feature_layer` as a list, each within the tower's hidden states."""
    layer = config.vision_feature_layer
    layers = list(layer) if isinstance(layer, (list, tuple)) else [layer]
    depth = config.vision_config.num_hidden_layers
    for item in layers:
        if not -(depth + 1) <= item <= depth:
            raise ValueError(f"{source}: vision_feature_layer {bounded(layer)}: the vision "
                             f"tower has {depth} layers ({depth + 1} hidden states)")
    return layers


def _our_processor(directory: Path, config: Any) -> ImageProcessor:
    """Our processor from the folder's image processor, which must end at the vision
    config's image size and must not pad to a square (`LlavaImageProcessor`'s `do_pad`)."""
    from vlm_vit.convert.hf_common import processor_from_hf

    settings, path = image_processor_settings(directory)
    if settings.get("do_pad"):
        raise ValueError(f"{path}: do_pad true (pads each image to a square with the mean "
                         "colour first), which vlm-vit's ImageProcessor cannot do")
    size = config.vision_config.image_size
    rules: list[str] = []
    processor = processor_from_hf(
        settings, ImageProcessor.for_family("clip", size=size, crop_rounding="floor"), rules,
        path)
    for rule in rules:
        logger.warning("%s", rule)
    if tuple(processor.size) != (size, size):
        raise ValueError(f"{path}: the image processor ends at {tuple(processor.size)}, but "
                         f"the vision tower takes {size} x {size}")
    return processor


def _check_weights(directory: Path, config: Any, layers: int, source: str) -> None:
    """From the safetensors headers alone: an untied head is on disk, and the projector and
    the embeddings have the config's shapes (a vision or text width that disagrees)."""
    shapes = tensor_shapes(directory)
    text, vision = config.text_config, config.vision_config
    if not config.tie_word_embeddings and not any(name in shapes for name in HEAD_NAMES):
        raise ValueError(f"{source}: tie_word_embeddings is off (top level "
                         f"{config.tie_word_embeddings}, text_config "
                         f"{getattr(text, 'tie_word_embeddings', None)}) but the weights hold "
                         "no lm_head.weight: the output head would be random")
    expected = {"multi_modal_projector.linear_1.weight":
                [text.hidden_size, vision.hidden_size * layers],
                "multi_modal_projector.linear_2.weight": [text.hidden_size, text.hidden_size]}
    for name, shape in expected.items():
        found = next((shapes[key] for key in (name, f"model.{name}") if key in shapes), None)
        if found is not None and found != shape:
            raise ValueError(f"{source}: {name} is {found} on disk, but the config needs "
                             f"{shape} (text hidden_size {text.hidden_size}, vision "
                             f"hidden_size {vision.hidden_size} x {layers} layers)")
