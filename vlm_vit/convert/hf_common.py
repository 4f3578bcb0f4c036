"""Facts shared by the Hugging Face families (CLIP / SigLIP and ViT)."""

from __future__ import annotations

from typing import Any

from vlm_vit.config import ConfigError, EncoderConfig

# transformers' ACT2FN names -> ours; gelu_new / gelu_fast / gelu_pytorch_tanh are all the
# tanh approximation.
ACTIVATIONS = {
    "gelu": "gelu", "gelu_python": "gelu",
    "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "quick_gelu": "quick_gelu",
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

