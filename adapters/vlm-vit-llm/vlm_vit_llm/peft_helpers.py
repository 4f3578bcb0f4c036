"""peft's models as the bridge handles them: LoRA put on a `MultimodalLM`, a module's base
without its LoRA, its state without the LoRA tensors, LoRA folded into the weights, and peft's
wrapping without the warning transformers 5 makes it print.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from vlm_vit_llm.deepstack import train_projectors


def split_peft(module: nn.Module) -> tuple[nn.Module, Any]:
    """A module and its peft wrapper apart.

    Returns:
        (the base model, the peft model on it), or (`module`, None) when peft does not wrap
        `module`.
    """
    base = getattr(module, "get_base_model", None)
    if base is not None and hasattr(module, "peft_config"):
        return base(), module
    return module, None


def add_llm_and_encoder_lora(mm: Any, *, r: int, alpha: float, dropout: float,
                             llm_targets: Sequence[str],
                             encoder_targets: str | Sequence[str] | None) -> None:
    """`MultimodalLM.add_lora` (see there): LoRA on `mm`'s LLM and optionally its encoder,
    the projectors trained fully, the rest frozen."""
    from vlm_vit.adapt.lora import apply_lora, import_peft

    peft = import_peft("LoRA on the LLM")  # bitsandbytes' kernel warnings held back
    if isinstance(mm.llm, peft.PeftModel) or isinstance(mm.tower.encoder, peft.PeftModel):
        raise ValueError("LoRA is already on this model; merge it or load it without")
    mm.requires_grad_(False)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, bias="none",
                             target_modules=list(llm_targets), task_type="CAUSAL_LM")
    with quiet_peft():
        mm.llm = peft.get_peft_model(mm.llm, config)
    mm._packed_attention = None  # checked again, on the wrapped LLM
    if encoder_targets is not None:
        mm.tower.encoder = apply_lora(mm.tower.encoder, r=r, alpha=alpha,
                                      dropout=dropout, targets=encoder_targets)
        # Blocks past the tower's feature layer never run: their LoRA would get no
        # gradient (and DDP would wait for one), so it stays frozen at its no-op start.
        unused = re.compile(r"\.blocks\.(\d+)\.")
        for name, parameter in mm.tower.encoder.named_parameters():
            found = unused.search(name)
            if found and ".lora_" in name and int(found[1]) >= mm.tower.blocks_used:
                parameter.requires_grad_(False)
    train_projectors(mm)


def base_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's state dict without LoRA: peft's LoRA tensors dropped and its wrapped
    layers (`x.base_layer.weight`) under their own names again (`x.weight`)."""
    return {name.replace(".base_layer.", "."): tensor
            for name, tensor in module.state_dict().items() if ".lora_" not in name}


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Within the block peft wraps a model without a warning the user can do nothing about
    (peft reads `is_gradient_checkpointing`, a property transformers 5 deprecates)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        yield


def merged_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's weights with its active LoRA adapters folded in, under the plain module's
    names (`x.weight`, not `x.base_layer.weight`); `module` itself is not changed.

    Only the weights LoRA wraps are new tensors, `W + scaling * B @ A` one at a time (peft's
    own `get_delta_weight`, with the layer's own per-adapter `scaling`); every other tensor is
    the module's own, shared, not copied. A fused qkv under the `attn_qv` preset needs nothing
    special: its lora_B key rows are zero, so the key rows of the sum are the base's exactly.
    Dropout acts on the LoRA branch's input while training and has no part in the weight.

    Args:
        module: a plain module (its state dict is returned), or a peft model on one.

    Raises:
        ValueError: for an adapter that does not merge by addition (DoRA and other variants).
    """
    base, adapter = split_peft(module)
    if adapter is None:
        return module.state_dict()
    from peft.tuners.lora import LoraLayer

    state = base_state(base)
    with torch.no_grad():
        for name, layer in base.named_modules():
            if not isinstance(layer, LoraLayer) or layer.disable_adapters:
                continue
            for active in layer.active_adapters:
                if active in layer.merged_adapters or not (
                        active in layer.lora_A or active in layer.lora_embedding_A):
                    continue  # merged already (in the base weight), or not on this layer
                if layer.use_dora.get(active) or active in getattr(layer, "lora_variant", {}):
                    raise ValueError(f"{name}: adapter {active!r} is not plain LoRA (DoRA or "
                                     "another variant) and does not merge by addition")
                weight = state[f"{name}.weight"]
                # As peft's merge: the sum in the wider dtype, stored in the weight's.
                state[f"{name}.weight"] = (weight + layer.get_delta_weight(active)).to(weight.dtype)
                if getattr(layer, "lora_bias", {}).get(active):
                    bias = state[f"{name}.bias"]
                    delta = layer.lora_B[active].bias * layer.scaling[active]
                    state[f"{name}.bias"] = (bias + delta).to(bias.dtype)
    return state


def merged_tied_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """`merged_state`, with every name the module ties to one parameter (the output head of
    a `tie_word_embeddings` LLM) mapped to one tensor object, as a writer of one tensor for
    both needs.

    Raises:
        ValueError: when LoRA changes one of two tied weights but not the other.
    """
    state = merged_state(module)
    for alias, name in _tied_names(split_peft(module)[0]).items():
        if not _same_values(state[alias], state[name]):
            raise ValueError(f"the LLM ties {alias!r} to {name!r}, but its LoRA changes them "
                             "differently; a written model holds one tensor for both")
        state[alias] = state[name]
    return state


def _tied_names(module: nn.Module) -> dict[str, str]:
    """{a second name of a parameter: its first name}, in plain names (as `base_state`)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        name = name.replace(".base_layer.", ".")
        if id(parameter) in first:
            aliases[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return aliases


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    same_memory = (a.data_ptr() == b.data_ptr() and a.shape == b.shape
                   and a.stride() == b.stride() and a.dtype == b.dtype)
    return same_memory or torch.equal(a, b)
