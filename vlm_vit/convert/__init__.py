"""Checkpoint converters, one module per source family, registered by name on import.

Each is a pure `state_dict -> state_dict` function built from a declarative key map
(`keymap.py`) plus a few named tensor fix-ups; `detect_format` picks the one whose
`matches` accepts a checkpoint's content.
"""

from vlm_vit.convert import (  # noqa: F401  (importing registers the formats)
    hf_aimv2,
    hf_clip,
    hf_dinov2,
    hf_dinov3,
    hf_glm4v,
    hf_internvl,
    hf_perception_lm,
    hf_pixtral,
    hf_qwen2_5_vl,
    hf_qwen2_vl,
    hf_qwen3_vl,
    hf_siglip2,
    hf_vit,
    jax_npz,
    native,
    open_clip,
    timm,
    timm_aimv2,
    timm_dinov3,
    timm_eva,
    timm_naflex,
    timm_pe,
)
from vlm_vit.convert.base import (
    FORMATS,
    Checkpoint,
    Converted,
    NativePooler,
    detect_format,
    register_format,
)

__all__ = ["FORMATS", "Checkpoint", "Converted", "NativePooler", "detect_format",
           "register_format"]
