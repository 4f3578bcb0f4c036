"""Facts shared by the Hugging Face families (CLIP / SigLIP and ViT)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlm_vit.config import ConfigError, EncoderConfig, is_int, is_real
from vlm_vit.processor import NORMALIZATION, ImageProcessor

# transformers' ACT2FN names -> ours; gelu_new / gelu_fast / gelu_pytorch_tanh are all the
# tanh approximation.
ACTIVATIONS = {
    "gelu": "gelu", "gelu_python": "gelu",
    "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "quick_gelu": "quick_gelu",
    "silu": "silu", "swish": "silu",
}

# PIL's resampling codes, as preprocessor_config.json stores them.
PIL_RESAMPLE = {2: "bilinear", 3: "bicubic"}

# EncoderConfig fields -> the keys of a Hugging Face vision config they are read from.
HF_FIELDS = {
    "image_size": "image_size", "patch_size": "patch_size", "width": "hidden_size",
    "depth": "num_hidden_layers", "heads": "num_attention_heads",
    "mlp_width": "intermediate_size", "in_channels": "num_channels",
    "norm_eps": "layer_norm_eps",
}


def activation(hidden_act: Any, source: object = "config.json") -> str:
    """Our name for a Hugging Face `hidden_act`, or a ValueError naming it and `source`."""
    if not isinstance(hidden_act, str) or hidden_act not in ACTIVATIONS:
        raise ValueError(f"{source}: hidden_act {hidden_act!r} has no vlm-vit equivalent; "
                         f"known: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[hidden_act]


def hf_encoder_config(hf: dict[str, Any], source: object, **fixed: Any) -> EncoderConfig:
    """Our architecture from a Hugging Face vision config (its defaults already filled in).

    Args:
        hf: the config, with every key of `HF_FIELDS` and `hidden_act`.
        source: the config file, named in errors.
        **fixed: the EncoderConfig fields the family fixes (class token, pre-norm, ...).

    Raises:
        ValueError: for a `hidden_act` vlm-vit does not have, or a value `EncoderConfig`
            refuses (out of range, of the wrong type), naming `source`, our field and the
            file's key.
    """
    act = activation(hf["hidden_act"], source)
    try:
        return EncoderConfig(**{ours: hf[theirs] for ours, theirs in HF_FIELDS.items()},
                             act=act, **fixed)
    except ConfigError as error:
        raise error.located(source, HF_FIELDS.get(error.field)) from None



# -- preprocessor_config.json -----------------------------------------------------------------

PREPROCESSOR_NAME = "preprocessor_config.json"


@dataclass(frozen=True)
class ImageProcessorClass:
    """What a transformers image-processor class does where its preprocessor_config.json is
    silent: the only differences between the families' files that the parser needs.

    Attributes:
        name: the class, for messages.
        resample: the PIL code it resizes with when the file names none.
    """

    name: str
    resample: int


CLIP_IMAGE_PROCESSOR = ImageProcessorClass("CLIPImageProcessor", resample=3)  # and SigLIP's
VIT_IMAGE_PROCESSOR = ImageProcessorClass("ViTImageProcessor", resample=2)


def hf_size(value: Any) -> tuple[int, int] | None:
    """(height, width) from a preprocessor `size` or `crop_size` (an int, `{height, width}`
    or `{shortest_edge}`, a square side here); None when it says none of these (or its
    sides are not ints)."""
    if isinstance(value, dict) and "height" in value and "width" in value:
        value = (value["height"], value["width"])
    elif isinstance(value, dict) and "shortest_edge" in value:
        value = value["shortest_edge"]
    if is_int(value):
        return (int(value), int(value))
    if isinstance(value, tuple) and all(is_int(side) for side in value):
        return (int(value[0]), int(value[1]))
    return None


def processor_from_hf(settings: dict[str, Any], fallback: ImageProcessor, rules: list[str],
                      source: object = PREPROCESSOR_NAME, *,
                      processor_class: ImageProcessorClass = CLIP_IMAGE_PROCESSOR
                      ) -> ImageProcessor:
    """An `ImageProcessor` from a Hugging Face `preprocessor_config.json`, for every family.

    The processors resize the shortest edge then centre crop (CLIP: flooring the crop's
    offset, `crop_rounding="floor"`), or resize straight to `{height, width}` (SigLIP,
    ViT). What `ImageProcessor` cannot express is approximated, with a rule saying how: a
    resize-then-crop whose sizes differ, a size it cannot read (the fallback's is used),
    a resampling filter other than bilinear or bicubic (the class's default is used).
    Pixels rescaled other than by 1/255 would change every value, so they are refused.

    Args:
        settings: the parsed JSON.
        fallback: the family's preprocessing, for what the file leaves out (size, mean,
            std).
        rules: appended to, for every approximation.
        source: the file, named in errors.
        processor_class: the transformers class's own defaults (`resample`).

    Raises:
        ValueError: naming `source`, for a rescale other than 1/255 or settings the processor
            refuses (a size over its bounds, a mean that is not 3 finite numbers, ...).
    """
    rescale_factor = settings.get("rescale_factor", 1 / 255)
    if settings.get("do_rescale", True) is not True or not is_real(rescale_factor) or \
            abs(rescale_factor - 1 / 255) > 1e-9:
        raise ValueError(f"{source}: rescales pixels other than by 1/255 (do_rescale="
                         f"{settings.get('do_rescale')!r}, rescale_factor="
                         f"{settings.get('rescale_factor')!r}), which ImageProcessor cannot do")
    resample = settings.get("resample", processor_class.resample)
    resample = resample if is_int(resample) else None  # a list or dict is no PIL code
    cropped = settings.get("do_center_crop", "crop_size" in settings)
    size = settings.get("size")
    # A bare int is a legacy spelling: CLIP's (which always crops) meant the shortest edge.
    shortest_edge = ((isinstance(size, dict) and "shortest_edge" in size)
                     or (isinstance(size, int) and cropped))
    resized = hf_size(size) or fallback.size
    output = (hf_size(settings.get("crop_size")) if cropped else resized) or fallback.size
    default_filter = PIL_RESAMPLE[processor_class.resample]
    approximations = {
        f"resizes the shortest edge to {resized[0]}, then crops {output}; approximated by "
        f"resizing to cover {output}, then cropping":
            shortest_edge and cropped and resized != output,
        f"resizes the shortest edge to {resized[0]} without cropping; approximated by "
        f"cropping the centre {output}": shortest_edge and not cropped,
        f"resizes to {resized}, then crops {output}; approximated by resizing to {output}":
            not shortest_edge and cropped and resized != output,
        f"size {size!r} is not understood; using {fallback.size}":
            size is not None and hf_size(size) is None,
        f"resample {settings.get('resample')!r} is not bilinear (2) or bicubic (3); using "
        f"{processor_class.name}'s {default_filter}": resample not in PIL_RESAMPLE,
    }
    rules.extend(f"{PREPROCESSOR_NAME}: {rule}" for rule, applies in approximations.items()
                 if applies)
    normalized = settings.get("do_normalize", True)
    try:
        return ImageProcessor(
            size=output,
            resize_mode="shortest_edge" if shortest_edge else "squash",
            resample=PIL_RESAMPLE.get(resample, default_filter),
            mean=settings.get("image_mean", fallback.mean) if normalized else (0.0, 0.0, 0.0),
            std=settings.get("image_std", fallback.std) if normalized else (1.0, 1.0, 1.0),
            crop_rounding="floor",  # transformers' center_crop
        )
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: {error}") from None


def squash_processor(settings: dict[str, Any] | None, image_size: tuple[int, int],
                     source: object, *, resample: str, family: str,
                     processor_class: ImageProcessorClass) -> tuple[ImageProcessor, list[str]]:
    """The `ImageProcessor` of a `preprocessor_config.json` whose processor resizes straight
    to the model's size with ImageNet's mean and std (DINOv3's, InternVL's); without one,
    those defaults at `image_size`, said in the returned rules.

    Args:
        settings: the file's settings, or None when the folder has none.
        resample: the family's filter ("bilinear", "bicubic").
        family: named in the rule ("DINOv3's defaults").
        processor_class: the transformers processor `processor_from_hf` accepts.
    """
    mean, std = NORMALIZATION["imagenet"]
    defaults = ImageProcessor(size=image_size, resize_mode="squash", resample=resample,
                              mean=mean, std=std, crop_rounding="floor")
    if settings is None:
        return defaults, [f"no {PREPROCESSOR_NAME}: {family} defaults (squash resize, "
                          f"{resample}, ImageNet mean/std) at the model's image size "
                          f"{image_size}"]
    rules: list[str] = []
    return processor_from_hf(settings, defaults, rules, source,
                             processor_class=processor_class), rules
