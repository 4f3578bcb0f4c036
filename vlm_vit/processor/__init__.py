"""Image preprocessing: PIL images, arrays, tensors or files to a normalised pixel batch.

`decode` (files and arrays to RGB, the two errors), `geometry` (size bounds, the native-
resolution rule), `anyres` (`Tiling`: LLaVA-NeXT / OneVision tiles and
their token counts), `image_processor` (`ImageProcessor`: resize, crop, normalise, presets).
"""

from vlm_vit.processor.anyres import Tiling
from vlm_vit.processor.decode import ImageLoadError, ImageTooLargeError
from vlm_vit.processor.geometry import MAX_OUTPUT_PIXELS, MAX_SIDE, PIXEL_CEILING, native_size
from vlm_vit.processor.image_processor import (
    CROP_ROUNDINGS,
    NORMALIZATION,
    PROCESSOR_CONFIG_NAME,
    RESIZE_MODES,
    ImageInput,
    ImageProcessor,
)

__all__ = [
    "CROP_ROUNDINGS",
    "MAX_OUTPUT_PIXELS",
    "MAX_SIDE",
    "NORMALIZATION",
    "PIXEL_CEILING",
    "PROCESSOR_CONFIG_NAME",
    "RESIZE_MODES",
    "Tiling",
    "ImageInput",
    "ImageLoadError",
    "ImageProcessor",
    "ImageTooLargeError",
    "native_size",
]
