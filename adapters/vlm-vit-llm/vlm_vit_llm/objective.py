"""`BridgeObjective`: a `MultimodalLM` as vlm-vit's trainer sees it, with checkpoints that
hold what trains and not the frozen LLM.

    mm.add_lora(r=16)                                # or train_projector_only(): set up first
    objective = MyObjective(mm)                      # a BridgeObjective with a forward
    Trainer(objective, data, config, "runs/s2").fit()

The trainer checkpoints `objective.state_dict()` and resumes through `load_state_dict`. Here
those hold the saved tensors only (every trainable parameter, the buffers of modules that own
one, and every LoRA tensor, trained or held frozen): for a 7B LLM, the projector and LoRA's
tens of MB instead of the LLM's 14 GB again in every checkpoint. A fingerprint of the frozen
rest goes with them, so a resume onto another base is refused, not silently trained on.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from vlm_vit import VisionEncoder
from vlm_vit_llm.model import MultimodalLM
from vlm_vit_llm.parallel import whole_parameters
from vlm_vit_llm.peft_helpers import split_peft

logger = logging.getLogger(__name__)

MODEL_DIR = "model"  # where `export` writes the trained multimodal model, under the run
FINGERPRINT_KEY = "_frozen_base_fingerprint"


class IncompatibleKeys(NamedTuple):
    """What `BridgeObjective.load_state_dict` did not match (empty when strict)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class BridgeObjective(nn.Module):
    """Base class of the trainer objectives on a `MultimodalLM`; subclasses add `forward`.

    Set up the training stage on `mm` (`train_projector_only()`, `add_lora(...)`) and load
    its weights before building the objective: the frozen base is fingerprinted here, once.
    The fingerprint costs one read of every frozen tensor, at memory speed (0.05 s for the
    540 MB of a 135M-parameter LLM on two CPU cores: `benchmarks/checkpoint_size.py`), at
    construction only; `state_dict()` then costs nothing more.

    Args:
        mm: the model to train.
    """

    def __init__(self, mm: MultimodalLM):
        super().__init__()
        self.mm = mm
        saved = self._saved_names()
        full = nn.Module.state_dict(self, keep_vars=True)
        frozen = {name: tensor for name, tensor in full.items() if name not in saved}
        self._parts, self._fingerprint = frozen_fingerprint(frozen)

    @property
    def encoder(self) -> nn.Module:  # what the trainer records in run_config.json
        return self.mm.tower.encoder

    # -- checkpoints --------------------------------------------------------------------------

    def _saved_names(self) -> set[str]:
        """The state dict names a checkpoint holds: trainable parameters, the persistent
        buffers of modules owning one, and every adapter tensor (LoRA on encoder blocks past
        the feature layer is held frozen, but it is the run's, not the base's)."""
        full = nn.Module.state_dict(self, keep_vars=True)
        names = {name for name, tensor in full.items()
                 if isinstance(tensor, nn.Parameter) and tensor.requires_grad}
        tuner_layer = _peft_tuner_layer()
        for module_name, module in self.named_modules(remove_duplicate=False):
            prefix = module_name + "." if module_name else ""
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                names.update(prefix + name for name, _ in module.named_buffers(recurse=False))
            if tuner_layer is not None and isinstance(module, tuner_layer):
                for attribute in module.adapter_layer_names:
                    names.update(f"{prefix}{attribute}.{name}" for name, _ in
                                 getattr(module, attribute).named_parameters(
                                     remove_duplicate=False))
        return names & full.keys()  # non-persistent buffers are in no state dict

    def state_dict(self, *, destination: dict[str, Any] | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        """The saved tensors (see the module docstring) under their usual names, and the
        frozen base's fingerprint under `FINGERPRINT_KEY` (a `[parts, 32]` uint8 tensor)."""
        full = nn.Module.state_dict(self, keep_vars=keep_vars)
        saved = self._saved_names()
        out = OrderedDict() if destination is None else destination
        for name, tensor in full.items():
            if name in saved:
                out[prefix + name] = tensor
        out[prefix + FINGERPRINT_KEY] = self._fingerprint.clone()
        return out

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True,
                        assign: bool = False) -> IncompatibleKeys:
        """Loads what `state_dict` wrote, after checking the frozen base is the same.

        A state without a fingerprint is a whole module's state dict (as the trainer wrote
        before this class) and is loaded as `nn.Module.load_state_dict` loads it.

        Raises:
            ValueError: when the frozen LLM or encoder differs from the one the state was
                saved from, or (strict) naming the saved tensors missing or unexpected.
            RuntimeError: from torch, for a tensor of another shape.
        """
        state = dict(state_dict)
        fingerprint = state.pop(FINGERPRINT_KEY, None)
        if fingerprint is None:
            return IncompatibleKeys(*super().load_state_dict(state, strict, assign))
        self._check_fingerprint(fingerprint)
        saved = self._saved_names()
        missing, unexpected = sorted(saved - state.keys()), sorted(state.keys() - saved)
        if strict and (missing or unexpected):
            raise ValueError(f"the checkpoint does not match this model's trainable tensors "
                             f"(set up the same stage and LoRA before building the objective):"
                             f" missing {missing}, unexpected {unexpected}")
        super().load_state_dict({name: state[name] for name in saved & state.keys()},
                                strict=False, assign=assign)
        return IncompatibleKeys(missing, unexpected)

    def _check_fingerprint(self, fingerprint: torch.Tensor) -> None:
        ours = self._fingerprint
        fingerprint = fingerprint.to("cpu", torch.uint8)
        if fingerprint.shape == ours.shape and torch.equal(fingerprint, ours):
            return
        if fingerprint.shape == ours.shape:
            changed = [part for part, a, b in zip(self._parts, fingerprint, ours, strict=True)
                       if not torch.equal(a, b)]
            what = f"{', '.join(changed)} changed"
        else:
            what = (f"the checkpoint fingerprints {fingerprint.shape[0]} frozen parts, this "
                    f"model {ours.shape[0]} ({', '.join(self._parts)})")
        raise ValueError(f"the frozen LLM/encoder differs from the one this checkpoint was "
                         f"trained on: {what} ({FINGERPRINT_KEY!r}, a hash of the frozen "
                         f"tensors' names, shapes, dtypes and bit sums). Resume on the same "
                         f"base weights, with the same stage and LoRA set-up.")

    # -- training set-up ------------------------------------------------------------------

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recomputes activations in backward (less memory, about a third more compute) in
        the LLM's decoder layers and the encoder's blocks, or stops doing so.

        The LLM gets Hugging Face's checkpointing, non-reentrant: gradients reach the LoRA
        weights inside a checkpointed layer and flow back to the projector through the input
        embeddings even when no input of the layer needs a gradient. Nothing needs
        `enable_input_require_grads` (which transformers 5 turns on by itself): the spliced
        input embeddings carry the projector's gradient anyway.

        Raises:
            ValueError: from transformers, for an LLM without checkpointing support.
        """
        llm = split_peft(self.mm.llm)[0]  # peft's wrapper forwards these to the base
        if enabled:
            kwargs = {"use_reentrant": False}
            if hasattr(llm, "activation_checkpointing_enable"):  # the old name warns there
                llm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        elif hasattr(llm, "activation_checkpointing_disable"):
            llm.activation_checkpointing_disable()
        else:
            llm.gradient_checkpointing_disable()
        encoders = [m for m in self.mm.tower.encoder.modules() if isinstance(m, VisionEncoder)]
        for encoder in encoders:
            encoder.gradient_checkpointing = enabled
        logger.info("gradient checkpointing %s in the LLM and %d encoder(s)",
                    "on" if enabled else "off", len(encoders))

    # -- the end of a run ---------------------------------------------------------------------

    def export(self, run_dir: str | Path,
               state_dict: dict[str, torch.Tensor] | None = None) -> Path:
        """Writes the whole multimodal model to `run_dir/model` (the trainer calls this).

        Args:
            run_dir: the run directory.
            state_dict: for an objective sharded over processes (FSDP2), its whole state
                gathered onto this rank (every parameter, frozen ones too, under
                `nn.Module.state_dict`'s names): the model is written from it, as an
                unsharded run writes its own. None: from the live module.

        Raises:
            ValueError: when `state_dict` lacks a parameter (naming it).
        """
        directory = Path(run_dir) / MODEL_DIR
        if state_dict is None:
            return self.mm.save_pretrained(directory)
        with whole_parameters(self, state_dict):
            return self.mm.save_pretrained(directory)


def frozen_fingerprint(tensors: dict[str, torch.Tensor]) -> tuple[list[str], torch.Tensor]:
    """A sha256 per part of a model (the first two name components, `mm.llm`, `mm.tower`)
    over its tensors' names, shapes, dtypes and bit sums.

    The bit sum adds up a tensor's bytes read as integers (`bit_sum`): exact, so the same on
    any device, thread count or reduction order, and changed by any change of a value (a
    permutation of a tensor's elements would pass). One read of every tensor.

    Returns:
        (the part names, sorted; a `[parts, 32]` uint8 tensor of their digests).
    """
    parts: dict[str, Any] = {}  # part -> its running sha256
    sums: dict[int, int] = {}  # a tied weight appears under two names; read it once
    for name in sorted(tensors):
        tensor = tensors[name]
        part = ".".join(name.split(".")[:2])
        key = id(tensor)
        if key not in sums:
            sums[key] = bit_sum(tensor)
        line = f"{name}\t{tuple(tensor.shape)}\t{tensor.dtype}\t{sums[key]}\n"
        parts.setdefault(part, hashlib.sha256()).update(line.encode())
    names = sorted(parts)
    digests = [torch.frombuffer(bytearray(parts[p].digest()), dtype=torch.uint8) for p in names]
    return names, torch.stack(digests) if digests else torch.zeros(0, 32, dtype=torch.uint8)


def bit_sum(tensor: torch.Tensor) -> int:
    """The sum of a tensor's bytes read as 64-bit integers, modulo 2**64 (integer addition
    wraps), plus its trailing bytes: exact, so order-free, and at memory speed (a native
    int64 sum; a float64 or widening integer sum runs ~20x slower on a CPU)."""
    if tensor.is_meta:  # nothing to read: the shape and dtype still count
        return 0
    raw = tensor.detach().reshape(-1)
    if not raw.is_contiguous():
        raw = raw.contiguous()
    raw = raw.view(torch.uint8)
    if raw.storage_offset() % 8:  # an int64 view needs aligned memory
        raw = raw.clone()
    whole = raw.numel() // 8 * 8
    total = int(raw[:whole].view(torch.int64).sum()) if whole else 0
    return total + int(raw[whole:].sum())


def _peft_tuner_layer() -> type | None:
    # peft layers exist only once peft is imported; do not import it just to look.
    if "peft" not in sys.modules:
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer

    return BaseTunerLayer
