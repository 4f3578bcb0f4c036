"""What the writers of the Hugging Face families (DINOv2, Pixtral, Qwen2-VL, Qwen2.5-VL) share:
refusing by name what a family's architecture cannot hold, and writing its directory.

A writer lists the `EncoderConfig` values its family fixes; `refuse` names every field of an
encoder that differs, in one line, before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit.config import EncoderConfig
from vlm_vit.convert.hf_clip import write_json
from vlm_vit.convert.hf_common import PIL_RESAMPLE, PREPROCESSOR_NAME
from vlm_vit.io.files import atomic_directory
from vlm_vit.io.native import CONFIG_NAME
from vlm_vit.io.weights import DEFAULT_MAX_SHARD_SIZE, write_weights

# Ours -> the transformers name written back (ACT2FN knows each).
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "quick_gelu": "quick_gelu",
                  "silu": "silu"}
RESAMPLE_CODES = {name: code for code, name in PIL_RESAMPLE.items()}


def mismatches(config: EncoderConfig, required: Mapping[str, Any], family: str) -> list[str]:
    """`field=value (FAMILY needs X)` for every field of `config` that differs from
    `required`."""
    return [f"{field}={getattr(config, field)!r} ({family} needs {want!r})"
            for field, want in required.items() if getattr(config, field) != want]


def refuse(problems: Iterable[str], family: str) -> None:
    """Raises one ValueError listing `problems`; nothing when there are none."""
    problems = list(problems)
    if problems:
        raise ValueError(f"a Hugging Face {family} model cannot hold this encoder: "
                         + "; ".join(problems))


def parameter_free(pooler: nn.Module | None, family: str) -> None:
    """A pooler without weights (cls, mean) is not written: the family's reader chooses its
    own. One with weights is refused, since `family` has no pooling head to hold it.

    Raises:
        ValueError: naming the pooler.
    """
    if pooler is not None and any(True for _ in pooler.parameters()):
        spec = getattr(pooler, "pooler_spec", {}).get("name", type(pooler).__name__)
        raise ValueError(f"a Hugging Face {family} model has no pooling head to hold the "
                         f"{spec!r} pooler's weights; write it without one")


def detached(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """The encoder's state dict, detached (renaming leaves the encoder's own dict alone)."""
    return {name: tensor.detach() for name, tensor in encoder.state_dict().items()}


def write_hf_directory(destination: str | Path, config: dict[str, Any],
                       tensors: dict[str, torch.Tensor],
                       preprocessor: dict[str, Any] | None = None,
                       max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Writes `config.json`, the weights (sharded over `max_shard_size`, as transformers
    does) and, when given, `preprocessor_config.json`, all appearing at once."""
    destination = Path(destination)
    with atomic_directory(destination) as temp:
        write_json(config, temp / CONFIG_NAME)
        write_weights(tensors, temp, max_shard_size)
        if preprocessor is not None:
            write_json(preprocessor, temp / PREPROCESSOR_NAME)
    return destination


def native_resolution_preprocessor(processor, image_processor_type: str,
                                   **settings: Any) -> dict[str, Any]:
    """A native-resolution processor (Pixtral's, Qwen2-VL's) as a `preprocessor_config.json`:
    the class, its own size `settings`, and the mean and std.

    Raises:
        ValueError: for a processor that resizes to one fixed size, which these classes
            cannot do.
    """
    if processor.resize_mode != "native":
        raise ValueError(f"processor resize_mode {processor.resize_mode!r}: "
                         f"{image_processor_type} keeps each image's aspect ratio (resize_mode "
                         "'native')")
    return {"image_processor_type": image_processor_type, "do_resize": True, **settings,
            "resample": RESAMPLE_CODES[processor.resample], "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": list(processor.mean), "image_std": list(processor.std),
            "do_convert_rgb": True}
