"""A training run's checkpoint as a native encoder directory, one transformer block at a time.

    consolidate("runs/vit", "encoder/")               # the newest checkpoint that checks out
    consolidate("runs/vit", "encoder/", step=2000)    # that step's

A distributed checkpoint (the "fsdp" strategy, `vlm_vit.train.sharded_checkpoint`) holds each
weight in pieces across the ranks' files. Its metadata gives every tensor's whole shape, so
the encoder's tensors are grouped (each `blocks.<i>.`, then the rest: embeddings, final
norm), and each group is read whole by this process alone, appended to the weight file
being written (`vlm_vit.io.tensor_files.SafetensorsStream`) and freed before the next is read.
Memory holds the larger of one block and the rest, never the model. The files are those
`save_pretrained` writes: one `model.safetensors` for an encoder under 5 GB, else shards
(`model-0000k-of-0000n.safetensors`, whole groups each) and their index. A "ddp"
checkpoint (one `step_N.pt` of whole tensors) is read whole and written the same way.

Every file of the checkpoint is checked against its sha256 first (`load_checkpoint`); without
a step, a newer checkpoint that fails is reported and the previous one used. The encoder's
architecture is the one the run recorded in `run_config.json`; the checkpoint's tensors must
fit it exactly. The directory appears at once (`vlm_vit.io.files.atomic_directory`), with the
usual `config.json` (plus the checkpoint it came from, under `consolidated_from`), manifest
and model card.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import vlm_vit.train.checkpoint as ckpt
import vlm_vit.train.sharded_checkpoint as sharded_checkpoint
from vlm_vit.config import EncoderConfig
from vlm_vit.io.files import atomic_directory, atomic_write, read_json
from vlm_vit.io.integrity import write_manifest
from vlm_vit.io.native import CONFIG_NAME, check_state_dict, write_config
from vlm_vit.io.tensor_files import SafetensorsStream
from vlm_vit.io.weights import (
    DEFAULT_MAX_SHARD_SIZE,
    WEIGHTS_NAME,
    parse_size,
    shard_file_name,
    write_index,
)
from vlm_vit.train.run_dir import ENCODER_DIR, RUN_CONFIG_NAME

logger = logging.getLogger(__name__)

ENCODER_PREFIX = "encoder."  # the objective's encoder, `objective.encoder`
# The encoders an objective may hold: `encoder` (for ibot the EMA teacher, which DINOv2
# releases) and `student` (ibot's trained network).
MODULES = ("encoder", "student")
SOURCE_KEY = "consolidated_from"  # config.json's record of the checkpoint written
Shapes = dict[str, tuple[torch.Size, torch.dtype]]


def consolidate(run_dir: str | Path, out: str | Path, step: int | None = None, *,
                verify: bool | None = None,
                max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                module: str = "encoder") -> Path:
    """Writes the encoder of a run's checkpoint as a native directory (`load_encoder` reads
    it), holding at most one transformer block's weights at a time for a distributed one.

    Args:
        run_dir: the training run's directory, or one checkpoint in its `checkpoints/`.
        out: the encoder directory to write; replaced atomically when it exists.
        step: the checkpoint of this step (default: the newest whose files match their
            hashes; newer ones that do not are logged at WARNING level and skipped).
        verify: check the checkpoint's files against their sha256 (default: on, unless the
            environment sets `VLM_VIT_VERIFY=0`).
        max_shard_size: the largest weight file written (default 5 GB, as transformers):
            an encoder under it is one `model.safetensors`.
        module: which of the objective's encoders (`MODULES`): `encoder`, or ibot's
            `student` (its `encoder` is the EMA teacher).

    Returns:
        `out`.

    Raises:
        FileNotFoundError: no such run directory, no checkpoint (naming what is there), no
            checkpoint of `step`, or no `run_config.json`.
        ValueError: a checkpoint file that fails its hash (`IntegrityError`, naming it), an
            objective whose weights are not a plain encoder under `encoder.` (LoRA, the LLM
            bridge), weights that do not fit the recorded encoder, or an `out` that would
            replace the run or its checkpoints.
    """
    if module not in MODULES:
        raise ValueError(f"module must be one of {', '.join(MODULES)}, got {module!r}")
    prefix = f"{module}."
    run_dir, candidates = _candidates(Path(run_dir), step)
    out = Path(out)
    _check_out(out, run_dir)
    config, objective = _recorded_encoder(run_dir)
    path, state = _first_usable(candidates, run_dir, verify)
    shapes, read = _reader(path, state, objective, config, prefix)
    source = {"checkpoint": path.relative_to(run_dir).as_posix(), "step": int(state["step"])
              if isinstance(state.get("step"), int) else None}
    if module != "encoder":
        source["module"] = module
    written = write_encoder(out, config, block_groups(shapes, prefix), shapes, read,
                            {SOURCE_KEY: source}, max_shard_size, prefix)
    logger.info("wrote %s from %s", written, path)
    return written


def block_groups(names: Shapes | list[str], prefix: str = ENCODER_PREFIX) -> list[list[str]]:
    """The encoder's tensor names (with `prefix`, `encoder.`) in the groups written, in order:
    everything outside the blocks (patch and position embeddings, final norm), then each
    block's."""
    rest: list[str] = []
    blocks: dict[int, list[str]] = {}
    block = re.compile(rf"^{re.escape(prefix)}blocks\.(\d+)\.")
    for name in names:
        match = block.match(name)
        if match:
            blocks.setdefault(int(match.group(1)), []).append(name)
        else:
            rest.append(name)
    return [group for group in (rest, *(blocks[i] for i in sorted(blocks))) if group]


def write_encoder(out: Path, config: EncoderConfig, groups: list[list[str]], shapes: Shapes,
                  read: Callable[[list[str]], dict[str, torch.Tensor]],
                  extra_config: dict[str, Any] | None = None,
                  max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                  prefix: str = ENCODER_PREFIX) -> Path:
    """Writes a native encoder directory group by group: each group's tensors, read by
    `read(names)`, are appended to the weight file being written and freed before the next
    group is read. Consecutive groups share a file while it stays under `max_shard_size`, so
    an encoder under it is one `model.safetensors`, as `save_pretrained` writes it; a larger
    one is shards with their index.

    Args:
        out: the directory; it appears at once, replacing a model's that exists.
        config: the encoder's architecture, for `config.json`.
        groups: the tensor names (with `prefix`) of each group, in order.
        shapes: each name's whole shape and dtype.
        read: the whole tensors of the names given, keyed by them.
        extra_config: further top-level sections of `config.json`.
        max_shard_size: the largest weight file (bytes, or "5GB"); a group larger than it
            is a file of its own.
        prefix: the objective's name for the encoder, cut from the names written.

    Returns:
        `out`.
    """
    from vlm_vit.io.card import write_model_card

    files = _pack(groups, shapes, parse_size(max_shard_size))
    weight_map: dict[str, str] = {}
    written, total = [], 0
    with atomic_directory(out) as temp:
        for number, file_groups in enumerate(files, 1):
            name = WEIGHTS_NAME if len(files) == 1 else shard_file_name(number, len(files))
            layout = {tensor[len(prefix):]: shapes[tensor]
                      for group in file_groups for tensor in group}
            with atomic_write(temp / name) as handle:
                stream = SafetensorsStream(handle, layout)
                for group in file_groups:
                    tensors = read(group)
                    for tensor in group:
                        stream.write(tensor[len(prefix):], tensors[tensor])
                    total += sum(t.numel() * t.element_size() for t in tensors.values())
                    del tensors  # before the next group is read: one group in memory
                stream.close()
            weight_map.update((tensor, name) for tensor in layout)
            written.append(temp / name)
        if len(files) > 1:
            write_index(temp, weight_map, total)
        write_config(temp, config, extra_config)
        write_manifest(temp, written)
        write_model_card(temp, config, extra_config)
    return out


def _pack(groups: list[list[str]], shapes: Shapes, limit: int) -> list[list[list[str]]]:
    """The groups of each weight file, in order: consecutive groups while their bytes stay
    within `limit` (a larger group alone)."""
    files: list[list[list[str]]] = []
    used = limit + 1
    for group in groups:
        size = sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                   for shape, dtype in (shapes[name] for name in group))
        if used + size > limit:
            files.append([])
            used = 0
        files[-1].append(group)
        used += size
    return files


def _candidates(path: Path, step: int | None) -> tuple[Path, list[Path]]:
    """The run directory and its checkpoints to try, newest first: `step`'s, or every one;
    `path` may name one checkpoint inside `checkpoints/` instead of the run."""
    if path.parent.name == ckpt.CHECKPOINT_DIR:
        for found_step, found in ckpt.list_checkpoints(path.parent.parent):
            if found == path:
                if step not in (None, found_step):
                    raise ValueError(f"{path} is the checkpoint of step {found_step}, not "
                                     f"of step {step}")
                return path.parent.parent, [path]
    if not path.exists():
        raise FileNotFoundError(f"run directory {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is a file, not a training run directory")
    found = ckpt.list_checkpoints(path)
    if not found:
        raise FileNotFoundError(_no_checkpoint(path))
    if step is None:
        return path, [found_path for _, found_path in reversed(found)]
    chosen = [found_path for found_step, found_path in reversed(found) if found_step == step]
    if not chosen:
        raise FileNotFoundError(f"{path / ckpt.CHECKPOINT_DIR} has no checkpoint of step "
                                f"{step}; it has steps "
                                f"{', '.join(str(s) for s in sorted({s for s, _ in found}))}")
    return path, chosen


def _no_checkpoint(run_dir: Path) -> str:
    """Why `run_dir` has nothing to consolidate, naming what it holds instead."""
    entries = sorted(entry.name + ("/" if entry.is_dir() else "")
                     for entry in run_dir.iterdir() if not entry.name.startswith("."))
    holds = f"it holds {', '.join(entries[:6])}{' ...' if len(entries) > 6 else ''}" \
        if entries else "it is empty"
    hint = (f"; {run_dir / ENCODER_DIR} is the run's final encoder, already a native "
            "directory" if (run_dir / ENCODER_DIR / CONFIG_NAME).is_file() else "")
    return (f"{run_dir} holds no training checkpoint ({ckpt.CHECKPOINT_DIR}/step_N or "
            f"step_N.pt); {holds}{hint}")


def _check_out(out: Path, run_dir: Path) -> None:
    """Refuses an output folder that would replace the run, or write among its checkpoints."""
    target, run = out.resolve(), run_dir.resolve()
    if target == run or target in run.parents or \
            target.is_relative_to(run / ckpt.CHECKPOINT_DIR):
        raise ValueError(f"the output folder {out} would replace the run directory {run_dir} "
                         f"or write among its checkpoints; choose another folder (such as "
                         f"{run_dir / ENCODER_DIR})")
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"the output folder {out} is a file")


def _recorded_encoder(run_dir: Path) -> tuple[EncoderConfig, str]:
    """The encoder config and objective type the run recorded in run_config.json."""
    path = run_dir / RUN_CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no {RUN_CONFIG_NAME}, which records the "
                                "encoder's architecture: not a vlm-vit training run directory")
    recorded = read_json(path)
    objective = str((recorded.get("objective") or {}).get("type", "unknown"))
    if not isinstance(recorded.get("encoder"), dict):
        raise ValueError(f"{path} records no encoder config: the objective {objective} does "
                         "not train a vlm-vit VisionEncoder as its `encoder`")
    try:
        return EncoderConfig.from_dict(recorded["encoder"]), objective
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from error


def _first_usable(candidates: list[Path], run_dir: Path, verify: bool | None
                  ) -> tuple[Path, dict[str, Any]]:
    """The first candidate whose files match their hashes and whose state loads, and that
    state; those that fail are logged. One candidate's failure is raised as it is."""
    failed = []
    for path in candidates:
        try:
            return path, ckpt.load_checkpoint(path, verify)
        except (ValueError, OSError) as error:
            if len(candidates) == 1:
                raise
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            logger.warning("%s is unusable: %s; trying the previous checkpoint", path.name,
                           reason)
            failed.append(f"{path.name}: {reason}")
    raise ValueError(f"none of the {len(candidates)} checkpoints in "
                     f"{run_dir / ckpt.CHECKPOINT_DIR} is usable ({'; '.join(failed)})")


def _encoder_shapes(shapes: Shapes, path: Path, objective: str, config: EncoderConfig,
                    prefix: str = ENCODER_PREFIX) -> Shapes:
    """The checkpoint's encoder tensors (named with `prefix`, `encoder.`), checked to be a
    plain VisionEncoder of `config`.

    Raises:
        ValueError: for LoRA weights, no `prefix` tensors, or tensors that do not fit.
    """
    from vlm_vit.model import VisionEncoder

    if any(".lora_" in name for name in shapes):
        raise ValueError(f"checkpoint {path} is of a LoRA (peft) objective ({objective}): "
                         "consolidate writes plain encoders and does not merge adapters; fold "
                         "the run's adapter into its encoder with `vlm-vit merge` (a finetune "
                         "--lora run) or vlm_vit.adapt.lora.merge_lora")
    encoder = {name: shape for name, shape in shapes.items() if name.startswith(prefix)}
    if not encoder and prefix != ENCODER_PREFIX:
        raise ValueError(f"checkpoint {path} holds no `{prefix}` weights: its objective "
                         f"{objective} has no {prefix[:-1]} (ibot's runs have one)")
    if not encoder:
        raise ValueError(f"checkpoint {path} holds no `{ENCODER_PREFIX}` weights: its "
                         f"objective {objective} keeps its encoder elsewhere (as the LLM "
                         "bridge's tower does); consolidate writes objectives that hold a "
                         "vlm-vit encoder as `encoder`")
    with torch.device("meta"):
        model = VisionEncoder(config)
    check_state_dict(model, {name[len(prefix):]: torch.empty(size, dtype=dtype, device="meta")
                             for name, (size, dtype) in encoder.items()},
                     f"checkpoint {path} (objective {objective})")
    return encoder


def _reader(path: Path, state: dict[str, Any], objective: str, config: EncoderConfig,
            prefix: str) -> tuple[Shapes, Callable[[list[str]], dict[str, torch.Tensor]]]:
    """The encoder's tensors in checkpoint `path` (checked by `_encoder_shapes`), and a
    function that reads the named ones whole: from a distributed checkpoint's files, or from
    the objective weights a file checkpoint's `state` holds."""
    if path.is_dir():
        shapes = _encoder_shapes(sharded_checkpoint.tensor_shapes(path), path, objective,
                                 config, prefix)

        def read(names: list[str]) -> dict[str, torch.Tensor]:
            return sharded_checkpoint.load_tensors(path, {name: shapes[name] for name in names})
        return shapes, read
    whole = state.get("objective")
    if not isinstance(whole, dict):
        raise ValueError(f"checkpoint {path} holds no objective weights: not a checkpoint of "
                         "vlm-vit's trainer, or damaged")
    shapes = _encoder_shapes({name: (tensor.shape, tensor.dtype) for name, tensor in
                              whole.items()}, path, objective, config, prefix)
    return shapes, lambda names: {name: whole[name] for name in names}
