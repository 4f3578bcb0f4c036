"""The native encoder directory: `config.json` (`model_type` "vlm_vit.encoder", the
`EncoderConfig`, any extra sections such as a tower's), `model.safetensors` (or shards with an
index, `vlm_vit.weights`), `manifest.json` (sha256 of the weights, `vlm_vit.integrity`) and a
model card, read by path or Hub name; and `check_state_dict`, the strict fit check every
loader runs before it assigns weights to a module.

`VisionEncoder.save_pretrained` / `from_pretrained` are these functions on the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from vlm_vit.config import EncoderConfig
from vlm_vit.files import atomic_directory, atomic_write, read_json
from vlm_vit.hub import resolve
from vlm_vit.integrity import write_manifest
from vlm_vit.weights import WEIGHTS_NAME as WEIGHTS_NAME
from vlm_vit.weights import read_weights, write_weights

CONFIG_NAME = "config.json"
MODEL_TYPE = "vlm_vit.encoder"  # marks a native checkpoint in config.json


def save_native(directory: str | Path, config: EncoderConfig, state: dict[str, torch.Tensor], *,
                extra_config: dict | None = None, max_shard_size: int | str = "5GB",
                model_card: bool = True) -> Path:
    """Writes an encoder's directory (see `VisionEncoder.save_pretrained`); returns it."""
    directory = Path(directory)
    raw = {"model_type": MODEL_TYPE, "format_version": 1, "encoder": config.to_dict(),
           **(extra_config or {})}
    # The whole folder appears at once (a reader never sees this config with the weights
    # it replaces); files besides the model's are carried over (`atomic_directory`).
    with atomic_directory(directory) as temp:
        with atomic_write(temp / CONFIG_NAME, "w") as handle:
            json.dump(raw, handle, indent=2)
        write_manifest(temp, write_weights(state, temp, max_shard_size))
        if model_card:
            from vlm_vit.card import write_model_card

            write_model_card(temp, config, extra_config)
    return directory


def read_native(name: str | Path, verify: bool | None = None
                ) -> tuple[EncoderConfig, dict[str, torch.Tensor], Path]:
    """The config, weights and local directory of what `save_native` wrote, found by path or
    Hub name (`vlm_vit.hub.resolve`; see `VisionEncoder.from_pretrained`)."""
    directory = resolve(name)
    config_path = directory / CONFIG_NAME
    raw = read_json(config_path)
    if raw.get("model_type") != MODEL_TYPE or "encoder" not in raw:
        raise ValueError(
            f"{config_path} is not a vlm-vit encoder config (model_type is "
            f"{raw.get('model_type')!r}, expected {MODEL_TYPE!r})"
        )
    try:
        config = EncoderConfig.from_dict(raw["encoder"])
    except (TypeError, ValueError) as error:
        raise ValueError(f"{config_path}: {error}") from error
    return config, read_weights(directory, verify), directory


def check_state_dict(model: nn.Module, state: dict[str, torch.Tensor], source: object) -> None:
    """Raises one ValueError listing every missing, unexpected, mis-shaped and mis-typed key
    (integer or boolean weights where the model has floating-point ones: a cast would load
    them silently as whole numbers)."""
    own = model.state_dict()
    expected = {name: tuple(t.shape) for name, t in own.items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshaped = sorted(
        f"{name} (checkpoint {list(state[name].shape)}, model {list(expected[name])})"
        for name in set(expected) & set(state)
        if tuple(state[name].shape) != expected[name]
    )
    mistyped = sorted(
        f"{name} (checkpoint {str(state[name].dtype).removeprefix('torch.')}, model "
        f"{str(own[name].dtype).removeprefix('torch.')})"
        for name in set(expected) & set(state)
        if own[name].is_floating_point() and not state[name].is_floating_point()
    )
    problems = [
        f"{label}: {', '.join(names)}"
        for label, names in (("missing", missing), ("unexpected", unexpected),
                             ("wrong shape", misshaped), ("not floating point", mistyped))
        if names
    ]
    if problems:
        raise ValueError(f"weights in {source} do not fit the model; " + "; ".join(problems))
