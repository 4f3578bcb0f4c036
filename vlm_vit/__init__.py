"""vlm-vit: a Vision Transformer encoder component for multimodal LLM pipelines.

Importing this package only defines things: no plugin scanning, no output.
"""

from vlm_vit.config import EncoderConfig, available_variants
from vlm_vit.loading import load_encoder, load_processor, load_tower
from vlm_vit.model import EncoderOutput, VisionEncoder
from vlm_vit.poolers import Pooler, available_poolers, build_pooler, register_pooler
from vlm_vit.processor import ImageProcessor
from vlm_vit.tower import VisionTower

__version__ = "0.1.0"

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
