"""vlm-vit: a Vision Transformer encoder component for multimodal LLM pipelines.

Importing this package only defines things: no plugin scanning, no output.
"""

from vlm_vit.config import EncoderConfig, available_variants
from vlm_vit.loading import load_encoder
from vlm_vit.model import EncoderOutput, VisionEncoder
from vlm_vit.processor import ImageProcessor

__version__ = "0.1.0"

__all__ = [
    "EncoderConfig",
    "EncoderOutput",
    "ImageProcessor",
    "VisionEncoder",
    "available_variants",
    "load_encoder",
]
