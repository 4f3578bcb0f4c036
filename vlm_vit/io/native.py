"""The native encoder directory: `config.json` (`model_type` "vlm_vit.encoder", the
`EncoderConfig`, any extra sections such as a tower's), `model.safetensors` (or shards with an
index, `vlm_vit.io.weights`), `manifest.json` (sha256 of the weights, `vlm_vit.io.integrity`) and a
model card, read by path or Hub name; and `check_state_dict`, the strict fit check every
loader runs before it assigns weights to a module.

`NativeFormat` gives `VisionEncoder` its `save_pretrained`, `from_pretrained` and
`from_state_dict` on these functions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from vlm_vit.config import EncoderConfig
from vlm_vit.io.files import atomic_directory, atomic_write, read_json
from vlm_vit.io.hub import resolve
from vlm_vit.io.integrity import write_manifest
from vlm_vit.io.weights import WEIGHTS_NAME as WEIGHTS_NAME
from vlm_vit.io.weights import read_weights, write_weights
from vlm_vit.presets import parse_dtype

CONFIG_NAME = "config.json"
MODEL_TYPE = "vlm_vit.encoder"  # marks a native checkpoint in config.json


def write_config(directory: str | Path, config: EncoderConfig,
                 extra_config: dict | None = None) -> Path:
    """Writes a native directory's `config.json`: the marker, the format version, the
    encoder's architecture and any `extra_config` sections."""
    path = Path(directory) / CONFIG_NAME
    with atomic_write(path, "w") as handle:
        json.dump({"model_type": MODEL_TYPE, "format_version": 1, "encoder": config.to_dict(),
                   **(extra_config or {})}, handle, indent=2)
    return path


def save_native(directory: str | Path, config: EncoderConfig, state: dict[str, torch.Tensor], *,
                extra_config: dict | None = None, max_shard_size: int | str = "5GB",
                model_card: bool = True) -> Path:
    """Writes an encoder's directory (see `VisionEncoder.save_pretrained`); returns it."""
    directory = Path(directory)
    # The whole folder appears at once (a reader never sees this config with the weights
    # it replaces); files besides the model's are carried over (`atomic_directory`).
    with atomic_directory(directory) as temp:
        write_config(temp, config, extra_config)
        write_manifest(temp, write_weights(state, temp, max_shard_size))
        if model_card:
            from vlm_vit.io.card import write_model_card

            write_model_card(temp, config, extra_config)
    return directory


def read_native(name: str | Path, verify: bool | None = None
                ) -> tuple[EncoderConfig, dict[str, torch.Tensor], Path]:
    """The config, weights and local directory of what `save_native` wrote, found by path or
    Hub name (`vlm_vit.io.hub.resolve`; see `VisionEncoder.from_pretrained`)."""
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


Encoder = TypeVar("Encoder", bound="NativeFormat")


class NativeFormat:
    """The native directory and strict loading, mixed into `vlm_vit.model.VisionEncoder` (as
    huggingface_hub's `ModelHubMixin` is into a model), so the model file keeps the paper's
    shape. The class provides `config`, `state_dict`, `resize_image` and `cls(config)`."""

    config: EncoderConfig

    def save_pretrained(self, directory: str | Path, *, extra_config: dict | None = None,
                        max_shard_size: int | str = "5GB", model_card: bool = True) -> Path:
        """Writes `config.json`, `model.safetensors` and `manifest.json` (the weights' sha256,
        checked on load: `vlm_vit.io.integrity`) into `directory`, each atomically
        (`vlm_vit.io.native.save_native`).

        Args:
            directory: created if needed.
            extra_config: further top-level sections for `config.json` (a tower's, say);
                loading the encoder ignores them.
            max_shard_size: larger weights are written as shards with an index
                (`vlm_vit.io.weights`), as transformers does; "5GB", "500MB", or bytes.
            model_card: write a `README.md` model card for the Hub, unless one exists.

        Returns:
            The directory.
        """
        return save_native(directory, self.config, self.state_dict(), extra_config=extra_config,
                           max_shard_size=max_shard_size, model_card=model_card)

    @classmethod
    def from_pretrained(
        cls: type[Encoder], name: str | Path, *, dtype: str | torch.dtype | None = None,
        verify: bool | None = None, **overrides
    ) -> Encoder:
        """Reads a directory written by `save_pretrained`, bit-exactly.

        Args:
            name: a directory holding `config.json` and `model.safetensors`, or a Hub name
                (`org/name[@revision]`, `hf-hub:org/name`) of one, as `load_encoder` takes.
            dtype: cast the weights to this dtype, a `torch.dtype` or its usual string
                (`vlm_vit.presets.parse_dtype`; default: as stored).
            verify: check the weights against `manifest.json` where there is one (default:
                on, unless the environment sets `VLM_VIT_VERIFY=0`); False skips it.
            **overrides: `EncoderConfig` fields to change; a new `image_size` resizes the
                position table.

        Raises:
            FileNotFoundError, ValueError: naming the file that is missing or malformed
                (`vlm_vit.io.hub.NotCachedError` for a name neither cached nor reachable);
                `vlm_vit.io.integrity.IntegrityError` (a ValueError) for weights that do not
                match their manifest hash.
        """
        dtype = parse_dtype(dtype)  # a bad spelling fails before the weights are read
        config, state, directory = read_native(name, verify)
        return cls.from_state_dict(state, config, dtype=dtype, source=directory, **overrides)

    @classmethod
    def from_state_dict(
        cls: type[Encoder],
        state: dict[str, torch.Tensor],
        config: EncoderConfig,
        *,
        dtype: str | torch.dtype | None = None,
        source: str | Path = "state dict",
        **overrides,
    ) -> Encoder:
        """Builds an encoder from native-named weights, strictly.

        Every missing, unexpected or mis-shaped key is listed in one error, and nothing is
        loaded half-way. `overrides` may change `image_size` (the position table is resized)
        or any field that does not change a weight's shape (`act`, `norm_eps`, ...).
        `dtype` as in `from_pretrained`.
        """
        dtype = parse_dtype(dtype)
        new_size = overrides.pop("image_size", None)
        config = EncoderConfig.from_dict({**config.to_dict(), **overrides})
        with torch.device("meta"):
            model = cls(config)
        check_state_dict(model, state, source)
        model.load_state_dict(state, assign=True)
        floats = {t.dtype for t in state.values() if t.is_floating_point()}
        if dtype is None and len(floats) > 1:  # e.g. OpenAI's float16 weights, float32 norms
            dtype = max(floats, key=lambda d: torch.finfo(d).bits)
        if dtype is not None:
            model.to(dtype)
        if new_size is not None:
            model.resize_image(new_size)
        return model


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
