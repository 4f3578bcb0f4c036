"""Reading checkpoints: safe file readers, `load_encoder`, `load_tower`, `load_processor`.

Weights are read without running code: safetensors first, `torch.load(weights_only=True)`
for PyTorch files, `.npz` arrays by their `.npy` headers (`files.read_npz`, checked against
the archive before anything is allocated). The format is told from the content (see
`vlm_vit.convert`), never from the file name. A directory with a `manifest.json` (what
vlm-vit writes) has its weight files checked against the recorded sha256 first; `verify=False`
or `VLM_VIT_VERIFY=0` skips that (`vlm_vit.io.integrity`).
"""

from __future__ import annotations

import logging
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

import vlm_vit.io.hub as hub
from vlm_vit.convert import FORMATS, Checkpoint, Converted, NativePooler, detect_format
from vlm_vit.convert.base import non_finite_weight
from vlm_vit.io.files import read_json
from vlm_vit.io.integrity import MANIFEST_NAME, verify_files
from vlm_vit.io.native import CONFIG_NAME, check_state_dict
from vlm_vit.io.tensor_files import read_npz, read_safetensors
from vlm_vit.io.weights import SHARD_INDEX, read_sharded
from vlm_vit.model import VisionEncoder
from vlm_vit.presets import parse_dtype
from vlm_vit.processor import ImageProcessor

logger = logging.getLogger(__name__)

# Weight files looked for in a directory, in order (native / Hugging Face, open_clip on the hub).
WEIGHT_FILES = ("model.safetensors", "open_clip_model.safetensors", "pytorch_model.bin",
                "open_clip_pytorch_model.bin", "model.npz")


# What torch's weights-only refusal says around its reason (`torch.serialization`'s message
# for an unpickler error), each line's start once "Weights only load failed." is taken off.
_TORCH_PREAMBLE = ("This file can still be loaded", "In PyTorch", "(1)", "(2)",
                   "Please file an issue", "Check the documentation")
_NEEDS_CODE_WORDS = ("global", "reduce", "class", "build")


def unpickling_refusal(error: BaseException) -> tuple[bool, str]:
    """Whether torch's weights-only unpickler refused a file because it needs code to load
    (a global, a class or a call) rather than because it is no pickle at all (random bytes
    are refused too: `invalid load key`, `Unsupported operand`), and its reason in one line
    (`Unsupported global: GLOBAL builtins.print ...`, `Trying to load unsupported GLOBAL
    posix.system whose module posix is blocked.`)."""
    text = str(error)
    _, marker, after = text.partition("WeightsUnpickler error:")
    lines = [line.strip().removeprefix("Weights only load failed.").strip()
             for line in (after if marker else text).splitlines()]
    reasons = [line for line in lines if line and not line.startswith(_TORCH_PREAMBLE)]
    reason = reasons[0].split(". ", 1)[0].rstrip(".") if reasons else type(error).__name__
    needs_code = any(word in reason.lower() for word in _NEEDS_CODE_WORDS)
    return needs_code, reason


def _read_pickled(path: Path) -> dict[str, torch.Tensor]:
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        needs_code, reason = unpickling_refusal(error)
        if not needs_code:
            raise ValueError(f"{path} is not a readable weight file (safetensors, PyTorch or "
                             f"npz): {reason}") from error
        raise ValueError(
            f"{path} is a PyTorch file whose pickle needs code to load ({reason}); refused, "
            f"and its code never ran (vlm-vit runs no code from a checkpoint). Re-save it as "
            f"a plain state dict (ideally safetensors) with the library that made it."
        ) from error
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, KeyError,
            IndexError, struct.error, UnicodeDecodeError,
            SafetensorError) as error:  # torch.load hands *.safetensors names to safetensors
        raise ValueError(f"{path} is not a readable weight file (safetensors, PyTorch or "
                         f"npz; truncated or corrupt?): "
                         f"{type(error).__name__}: {error}") from error
    return _unwrap_state_dict(loaded, path)


def _unwrap_state_dict(loaded: Any, path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a loaded object: a state dict, or one under "state_dict" / "model"."""
    for key in ("state_dict", "model", "module"):
        if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
            loaded = loaded[key]
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} holds a {type(loaded).__name__}, not a state dict")
    tensors = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise ValueError(f"{path} holds no tensors")
    # Training checkpoints saved from DistributedDataParallel prefix every name with "module.".
    if all(k.startswith("module.") for k in tensors):
        tensors = {k.removeprefix("module."): v for k, v in tensors.items()}
    return tensors


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one weight file, the container told by its first bytes.

    Raises:
        FileNotFoundError: when the file is missing.
        ValueError: for a truncated or corrupt file, a TorchScript archive, or a pickle that
            would run code; each names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist or is not a file")
    with path.open("rb") as handle:
        head = handle.read(9)
    if len(head) == 9 and head[8:9] == b"{":  # safetensors: u64 header size, then JSON
        return read_safetensors(path)
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except zipfile.BadZipFile as error:
            raise ValueError(f"{path} is a damaged zip archive: {error}") from error
        if any(n.endswith("constants.pkl") or "/code/" in n for n in names):
            raise ValueError(f"{path} is a TorchScript archive (like OpenAI's original CLIP "
                             "release); loading it means running its code, which vlm-vit "
                             "refuses. Save its state_dict() as safetensors and load that.")
        if names and all(n.endswith(".npy") for n in names):
            return read_npz(path)
    return _read_pickled(path)


def read_checkpoint(path: str | Path, verify: bool | None = None) -> Checkpoint:
    """A file, directory or model name as a `Checkpoint`: tensors, config and the JSON files
    beside them. Names (`org/name`, `hf-hub:org/name`, open_clip's `MODEL/TAG`) come from
    the Hugging Face cache, fetched if needed and allowed (`vlm_vit.io.hub`).

    Args:
        path: a file, directory or name.
        verify: check a directory's weight files against its `manifest.json`, where it has
            one (default: on unless `VLM_VIT_VERIFY=0`).

    Raises:
        FileNotFoundError: when nothing is there, or a directory has no weight file;
            `hub.NotCachedError` for a name neither cached nor reachable.
        ValueError: for malformed files, naming them; `integrity.IntegrityError` for a
            weight file that does not match its manifest hash.
    """
    location = hub.locate(path)
    path = location.directory
    if path.is_file():
        return Checkpoint(path=path, tensors=read_tensors(path))
    files = {p.name: read_json(p) for p in sorted(path.glob("*.json"))
             if p.name not in (CONFIG_NAME, SHARD_INDEX, MANIFEST_NAME)}
    config = read_json(path / CONFIG_NAME) if (path / CONFIG_NAME).is_file() else None
    weight_files = location.weight_files or WEIGHT_FILES
    if location.weight_files is None and (path / SHARD_INDEX).is_file():
        tensors = read_sharded(path, verify)
    else:
        found = next((path / name for name in weight_files if (path / name).is_file()), None)
        if found is None:
            raise FileNotFoundError(f"{path} holds none of the weight files "
                                    f"{', '.join(weight_files)}")
        verify_files(path, [found], verify)
        tensors = read_tensors(found)
    return Checkpoint(path=path, tensors=tensors, config=config, files=files)


def convert_checkpoint(path: str | Path | hub.Location, format: str | None = None,
                       verify: bool | None = None,
                       given: dict[str, Any] | None = None) -> Converted:
    """Reads a checkpoint (a path or model name) and converts it to native terms (no model
    is built); `verify` as in `read_checkpoint`; `given`: `EncoderConfig` fields the caller
    gives, which a reader takes for what the checkpoint does not record (`heads` of a bare
    state dict: `vlm_vit.convert.bare`). Every load of another library's format (and
    of a native directory through `load_encoder`) passes here: a weight holding NaN or an
    infinity is said at WARNING, naming the checkpoint and the first such tensor."""
    location = hub.locate(path)
    checkpoint = read_checkpoint(location, verify)
    checkpoint.given = dict(given or {})
    format = format or location.format
    fmt = FORMATS.get(format) if format else detect_format(checkpoint)
    converted = fmt.to_native(checkpoint)
    converted.format = fmt.name
    for rule in converted.rules:
        logger.info("%s (%s): %s", checkpoint.path, fmt.name, rule)
    if (name := non_finite_weight(converted)) is not None:
        logger.warning("%s: %s holds NaN or infinite values; every feature computed "
                       "with it will be non-finite", checkpoint.path, name)
    return converted


def load_encoder(
    path: str | Path, *, format: str | None = None, dtype: str | torch.dtype | None = None,
    verify: bool | None = None, **overrides: Any,
) -> VisionEncoder:
    """Loads an encoder from any supported checkpoint.

    Args:
        path: a file or directory: native, Hugging Face CLIP / SigLIP / ViT, open_clip or
            OpenAI CLIP, timm, or a Google `.npz` (see `vlm_vit.convert`); or a model name,
            `org/name[@revision]`, `hf-hub:org/name` or open_clip's `MODEL/TAG`, read from
            the Hugging Face cache (see `vlm_vit.io.hub`).
        format: skip detection and read the checkpoint as this format.
        dtype: cast the weights to this dtype: a `torch.dtype` or its usual string
            (`vlm_vit.presets.parse_dtype`; default: as stored).
        verify: check the weight files against the sha256 in the directory's
            `manifest.json`, where there is one (what `save_pretrained` writes). Default: on,
            unless the environment sets `VLM_VIT_VERIFY=0`; False skips the check.
        **overrides: `EncoderConfig` fields to change, e.g. ``act="quick_gelu"``;
            ``image_size=(h, w)`` resizes the position table (paper section 3.2). A bare
            state dict's readers also take from them what its tensors cannot prove
            (``heads=``; see `vlm_vit.convert.bare`).

    Raises:
        FileNotFoundError: when `path` does not exist.
        ValueError: for an unknown or ambiguous format, or weights that do not fit, with
            every missing, unexpected and mis-shaped key listed; nothing is loaded half-way.
            `vlm_vit.io.integrity.IntegrityError` (a ValueError) for a weight file that does
            not match its manifest hash (corrupt or changed since it was written).
    """
    dtype = parse_dtype(dtype)  # a bad spelling fails before the weights are read
    converted = convert_checkpoint(path, format, verify, overrides)
    return VisionEncoder.from_state_dict(converted.state, converted.config, dtype=dtype,
                                         source=path, **overrides)


def load_with_processor(
    path: str | Path, *, format: str | None = None, dtype: str | torch.dtype | None = None,
    verify: bool | None = None, **overrides: Any,
) -> tuple[VisionEncoder, ImageProcessor]:
    """The encoder and the preprocessing its checkpoint records, reading the weights once.

    A checkpoint that records none gets ImageNet normalisation at the encoder's image size
    (logged). Arguments as in `load_encoder`.
    """
    dtype = parse_dtype(dtype)
    return from_converted(convert_checkpoint(path, format, verify, overrides), path,
                          dtype=dtype, **overrides)


def from_converted(converted: Converted, path: str | Path, *,
                   dtype: str | torch.dtype | None = None,
                   **overrides: Any) -> tuple[VisionEncoder, ImageProcessor]:
    """`load_with_processor` from what `convert_checkpoint(path)` returned (a caller that
    says which format it read, say)."""
    encoder = VisionEncoder.from_state_dict(converted.state, converted.config, dtype=dtype,
                                            source=path, **overrides)
    processor = converted.processor
    if processor is None:
        logger.info("%s records no preprocessing: imagenet normalisation", path)
        processor = ImageProcessor.for_family("imagenet", size=encoder.config.image_size)
    return encoder, processor


def load_processor(path: str | Path, *, format: str | None = None,
                   required: bool = True) -> ImageProcessor | None:
    """The preprocessing a checkpoint records (mean, std, size, resize mode).

    Args:
        path: any checkpoint `load_encoder` reads, or a model name.
        format: as in `load_encoder`.
        required: raise when the checkpoint records none (the default: a silent None where
            a pipeline needs a processor would only fail later); False returns None instead.

    Raises:
        ValueError: when the checkpoint records no preprocessing and `required` is True,
            naming it and how to add one.
    """
    processor = convert_checkpoint(path, format).processor
    if processor is None and required:
        raise ValueError(f"{path} records no preprocessing (no processor_config.json or "
                         f"preprocessor config); save one beside it with "
                         f"ImageProcessor.save_pretrained, build one with "
                         f"ImageProcessor.for_family, or pass required=False")
    return processor


def build_native_pooler(own: NativePooler, source: object = "checkpoint"):
    """The pooler a checkpoint describes, with its weights loaded strictly."""
    from vlm_vit.poolers import build_pooler

    head = build_pooler(own.name, in_dim=own.in_dim, out_dim=own.out_dim, **own.options)
    check_state_dict(head, own.weights, f"the pooling head of {source}")
    head.load_state_dict(own.weights)
    return head


def load_tower(path: str | Path, pooler: str | None = None, *, out_dim: int | None = None,
               pooler_options: dict[str, Any] | None = None, format: str | None = None,
               feature_layer: int | list[int] | None = None, keep_prefix: bool | None = None,
               dtype: str | torch.dtype | None = None, verify: bool | None = None,
               **overrides: Any):
    """Loads a `VisionTower` whose pooler is the checkpoint's own, or one named.

    The checkpoint's own pooling: CLIP's image embedding (class token, final norm,
    projection), the paper's representation (final-norm class token, through `pre_logits`
    where there is one), a MAP head where there is one. A tower directory loads as saved.

    Args:
        path: any checkpoint `load_encoder` reads, or a saved tower.
        pooler: a pooler name to use instead, built fresh with `out_dim` and
            `pooler_options`.
        format: as in `load_encoder`.
        feature_layer, keep_prefix: as in `VisionTower` (defaults: the final tokens; the
            prefix kept for poolers that read the class token or keep the prefix tokens,
            dropped otherwise).
        dtype: cast the weights, as in `load_encoder`.
        verify: as in `load_encoder`.
        **overrides: `EncoderConfig` fields, as in `load_encoder`.

    Raises:
        ValueError: when no pooler is named and the checkpoint has no pooling head of its own.
    """
    from vlm_vit.poolers import build_pooler
    from vlm_vit.tower import VisionTower

    dtype = parse_dtype(dtype)
    location = hub.locate(path)  # a name is fetched once
    directory = location.directory
    if pooler is None and (directory / CONFIG_NAME).is_file() and \
            "tower" in read_json(directory / CONFIG_NAME):
        return VisionTower.from_pretrained(directory, dtype=dtype, verify=verify, **overrides)
    converted = convert_checkpoint(location, format, verify, overrides)
    encoder = VisionEncoder.from_state_dict(converted.state, converted.config, source=path,
                                            **overrides)
    if pooler is not None:
        head = build_pooler(pooler, in_dim=encoder.config.width, out_dim=out_dim,
                            **(pooler_options or {}))
    elif converted.pooler is not None:
        head = build_native_pooler(converted.pooler, source=path)
    else:
        raise ValueError(f"{path} has no pooling head of its own; name one, e.g. "
                         f"load_tower(path, 'cls') or load_tower(path, 'mlp2x_gelu', "
                         f"out_dim=4096)")
    if keep_prefix is None:
        keep_prefix = getattr(head, "requires_class_token", False) \
            or getattr(head, "keep_prefix", False)
    tower = VisionTower(encoder, head, feature_layer=feature_layer, keep_prefix=keep_prefix,
                        processor=converted.processor)
    return tower.to(dtype) if dtype is not None else tower


