"""The native format: `config.json` (model_type `vlm_vit.encoder`) and `model.safetensors`."""

from __future__ import annotations

from vlm_vit.config import EncoderConfig
from vlm_vit.convert.base import Checkpoint, Converted, register_format
from vlm_vit.model import MODEL_TYPE
from vlm_vit.processor import PROCESSOR_CONFIG_NAME, ImageProcessor


class NativeFormat:
    name = "native"

    def matches(self, checkpoint: Checkpoint) -> bool:
        return bool(checkpoint.config) and checkpoint.config.get("model_type") == MODEL_TYPE

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        try:
            config = EncoderConfig.from_dict(checkpoint.config["encoder"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{checkpoint.path}: bad native config: {error}") from error
        settings = checkpoint.files.get(PROCESSOR_CONFIG_NAME)
        processor = ImageProcessor.from_dict(settings) if settings is not None else None
        return Converted(config=config, state=dict(checkpoint.tensors), processor=processor)


register_format(NativeFormat())
