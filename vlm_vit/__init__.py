"""vlm-vit: a Vision Transformer encoder component for multimodal LLM pipelines.

Importing this package only defines things: no plugin scanning, no output, and no torch
until a name below is first used (PEP 562), so `vlm-vit --help` and the plugins' command
tables start without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlm_vit.config import EncoderConfig, available_variants
    from vlm_vit.io.loading import load_encoder, load_processor, load_tower
    from vlm_vit.model import EncoderOutput, VisionEncoder
    from vlm_vit.poolers import Pooler, available_poolers, build_pooler, register_pooler
    from vlm_vit.processor import ImageProcessor
    from vlm_vit.tower import VisionTower

__version__ = "0.1.0"

# Each public name and the module that defines it, imported on first use.
_PUBLIC = {
    "EncoderConfig": "vlm_vit.config",
    "available_variants": "vlm_vit.config",
    "load_encoder": "vlm_vit.io.loading",
    "load_processor": "vlm_vit.io.loading",
    "load_tower": "vlm_vit.io.loading",
    "EncoderOutput": "vlm_vit.model",
    "VisionEncoder": "vlm_vit.model",
    "Pooler": "vlm_vit.poolers",
    "available_poolers": "vlm_vit.poolers",
    "build_pooler": "vlm_vit.poolers",
    "register_pooler": "vlm_vit.poolers",
    "ImageProcessor": "vlm_vit.processor",
    "VisionTower": "vlm_vit.tower",
}

__all__ = [
    "EncoderConfig",
    "EncoderOutput",
    "ImageProcessor",
    "Pooler",
    "VisionEncoder",
    "VisionTower",
    "available_poolers",
    "available_variants",
    "build_pooler",
    "load_encoder",
    "load_processor",
    "load_tower",
    "register_pooler",
]
assert sorted(__all__) == sorted(_PUBLIC)  # one list, checked at import


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:  # a sub-module, as `vlm_vit.io.files` was reachable before
        try:
            return importlib.import_module(f"vlm_vit.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"vlm_vit.{name}":
                raise
        raise AttributeError(f"module 'vlm_vit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
