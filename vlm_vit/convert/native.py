"""The native format: `config.json` (model_type `vlm_vit.encoder`) and `model.safetensors`."""

from __future__ import annotations

from vlm_vit.config import EncoderConfig
from vlm_vit.convert.base import Checkpoint, Converted, register_format
from vlm_vit.io.native import CONFIG_NAME, MODEL_TYPE
from vlm_vit.processor import PROCESSOR_CONFIG_NAME, ImageProcessor


class NativeFormat:
    name = "native"

    def matches(self, checkpoint: Checkpoint) -> bool:
        return bool(checkpoint.config) and checkpoint.config.get("model_type") == MODEL_TYPE

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        """The config and weights as they are, the config checked against the weights.

        Raises:
            ValueError: for a config without an `encoder` section, with a field out of type
                or range, or with sizes the weights do not hold; each names the file.
        """
        config_path = checkpoint.path / CONFIG_NAME
        if "encoder" not in checkpoint.config:
            raise ValueError(f"{config_path} has no 'encoder' section (the encoder's fields); "
                             "was it written by VisionEncoder.save_pretrained?")
        config = EncoderConfig.from_dict(checkpoint.config["encoder"], source=config_path)
        settings = checkpoint.files.get(PROCESSOR_CONFIG_NAME)
        processor = None if settings is None else ImageProcessor.from_dict(
            settings, source=checkpoint.path / PROCESSOR_CONFIG_NAME)
        return Converted(config=config, state=dict(checkpoint.tensors), processor=processor,
                         source=checkpoint.path, config_file=CONFIG_NAME)


register_format(NativeFormat())
