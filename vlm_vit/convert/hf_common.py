"""Facts shared by the Hugging Face families (CLIP / SigLIP and ViT)."""

from __future__ import annotations

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


def activation(hidden_act: str, source: object = "config.json") -> str:
    """Our name for a Hugging Face `hidden_act`, or a ValueError naming it and `source`."""
    if hidden_act not in ACTIVATIONS:
        raise ValueError(f"{source}: hidden_act {hidden_act!r} has no vlm-vit equivalent; "
                         f"known: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[hidden_act]
