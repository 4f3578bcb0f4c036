"""LoRA and QLoRA fine-tuning of an encoder, a tower or a pretraining objective, through peft.

LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022) learns
W + (alpha / r) B A beside each frozen target Linear; QLoRA (Dettmers et al., NeurIPS 2023)
keeps the frozen block Linears in 4-bit NF4 with double quantisation. peft does the LoRA;
this module picks the targets by full module name, keeps the fused qkv's key slice frozen for
the `attn_qv` preset, and merges or saves the result.

    model = apply_lora(encoder, r=16, targets="attn")   # a peft.PeftModel, base frozen
    ... train ...
    save_adapter(model, "adapter/")                      # peft's format, a few MB
    merged = merge_lora(model)                           # the plain encoder again
    merged.save_pretrained("merged/")                    # a native checkpoint
"""

from __future__ import annotations

import copy
import json
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from vlm_vit.model import VisionEncoder
from vlm_vit.optional import require

if TYPE_CHECKING:
    from peft import PeftModel

logger = logging.getLogger(__name__)


def import_peft(purpose: str, quiet: bool = True):
    """peft, imported with bitsandbytes' import-time warnings held back when `quiet`.

    peft imports bitsandbytes whenever it is installed, and bitsandbytes warns at import
    about kernels only 4-bit layers use (a missing optional CPU kernel, the CUDA library it
    picked): noise on every LoRA run without QLoRA. A QLoRA run passes `quiet=False`.

    Raises:
        ImportError: without peft, naming the extra.
    """
    bnb_logger = logging.getLogger("bitsandbytes")
    level = bnb_logger.level
    if quiet and "bitsandbytes" not in sys.modules:
        bnb_logger.setLevel(logging.ERROR)
    try:
        return require("peft", "lora", purpose)
    finally:
        bnb_logger.setLevel(level)

# Module names are matched whole; `(?:.*\.)?blocks\.N\.` is a transformer block of the encoder
# at any depth of nesting (`blocks.0`, `encoder.blocks.0`) but not `decoder_blocks.0` (MAE's
# decoder) nor a pooler's own `proj`.
_BLOCK = r"(?:.*\.)?blocks\.\d+\."
PRESETS = {
    "attn": r"attn\.(?:qkv|proj)",
    "attn_qv": r"attn\.qkv",  # with the key rows of every lora_B held at zero
    "mlp": r"mlp\.(?:fc1|fc1_g|fc1_x|fc2)",  # SwiGLU's gate, value and output too
    "all": r".+",  # narrowed to the Linears found there
}
QV_ONLY_FILE = "vlm_vit_lora.json"  # beside peft's files: marks an `attn_qv` adapter
# Set on a lora_B weight whose key-row gradient is zeroed: (start, stop) of those rows. The
# FSDP2 strategy carries it onto the sharded parameter, whose gradient no tensor hook sees.
FROZEN_ROWS = _KEY_HOOK = "_vlm_vit_key_rows"


def apply_lora(
    model: nn.Module,
    *,
    r: int = 16,
    alpha: float = 32,
    dropout: float = 0.0,
    targets: str | Sequence[str] = "attn",
    train_modules: Sequence[str] = (),
    adapter_name: str = "default",
    quantize: bool = False,
) -> PeftModel:
    """Wraps `model` in a peft LoRA model; only the LoRA weights and `train_modules` train.

    Presets, on the Linears of the encoder's blocks only (never the patch embedding, the
    position or class embeddings, the norms, or anything outside the blocks):
    `"attn"` (`attn.qkv`, `attn.proj`), `"attn_qv"` (the query and value slices of the fused
    `attn.qkv`: LoRA on qkv whose lora_B rows D..2D, the key slice, start at zero and have
    their gradient zeroed by a hook, so the key output never changes), `"mlp"` (`mlp.fc1`,
    `mlp.fc2`, and SwiGLU's `mlp.fc1_g`, `mlp.fc1_x`), `"all"` (every Linear in the blocks).
    A list names modules exactly, by full name (`"encoder.blocks.0.attn.qkv"`,
    `"pooler.0"`), anywhere in the model.

    Args:
        model: a `VisionEncoder`, a `VisionTower`, or an objective holding an encoder.
        r: the LoRA rank.
        alpha: the LoRA scale numerator (the update is scaled by alpha / r).
        dropout: dropout on the LoRA branch's input.
        targets: a preset name or a list of full module names.
        train_modules: full names of modules trained fully beside LoRA (`("pooler",)`), as
            peft's `modules_to_save`.
        adapter_name: the adapter's name, for several adapters on one base.
        quantize: QLoRA; first replace every Linear in the blocks by a 4-bit NF4 Linear (see
            `quantize_blocks`).

    Returns:
        The `peft.PeftModel`; call it as `model` was called.

    Raises:
        ValueError: for an unknown preset, r < 1, a target or train module that is not in
            the model, or a preset that finds no Linear.
        ImportError: without peft (or bitsandbytes, for `quantize`).
        RuntimeError: when bitsandbytes cannot run 4-bit layers on this device.
    """
    peft = import_peft("LoRA fine-tuning", quiet=not quantize)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA rank r must be an integer >= 1, got {r!r}")
    train_modules = list(train_modules)
    _check_train_modules(model, train_modules)
    if quantize:
        quantize_blocks(model)
    names, pattern = _resolve_targets(model, targets)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, bias="none",
                             target_modules=pattern, modules_to_save=train_modules or None)
    wrapped = peft.get_peft_model(model, config, adapter_name=adapter_name)
    if targets == "attn_qv":
        _hold_key_rows(wrapped, adapter_name)
    logger.info("LoRA r=%d on %d modules (%s): %s", r, len(names), _describe_targets(targets),
                describe_trainable(wrapped))
    return wrapped


def quantize_blocks(model: nn.Module) -> nn.Module:
    """Replaces every `nn.Linear` in the encoder's blocks by a bitsandbytes `Linear4bit`.

    NF4 with double quantisation, bfloat16 compute (QLoRA's recipe). The patch embedding,
    norms, position and class embeddings, poolers and heads keep their precision. The
    weights are quantised on the device they are on.

    Returns:
        `model`, changed in place.

    Raises:
        ImportError: without bitsandbytes.
        RuntimeError: when bitsandbytes cannot run 4-bit layers on that device.
        ValueError: when the model has no Linear in blocks.
    """
    bnb = require("bitsandbytes", "qlora", "QLoRA (4-bit NF4 base weights)")
    block_linears = [(name, module) for name, module in model.named_modules()
                     if re.fullmatch(_BLOCK + ".+", name) and type(module) is nn.Linear]
    if not block_linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear inside `blocks.N` to quantise")
    _check_4bit_runs(bnb, block_linears[0][1].weight.device)
    for name, linear in block_linears:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, _to_4bit(bnb, linear))
    # transformers' flag, which peft reads to wrap a Linear4bit in its 4-bit LoRA layer.
    model.is_loaded_in_4bit = True
    logger.info("quantised %d block Linears to 4-bit NF4", len(block_linears))
    return model


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """Counts parameters, a 4-bit weight as the elements it stands for.

    Returns:
        (trainable, total).
    """
    trainable = total = 0
    for parameter in model.parameters():
        quant_state = getattr(parameter, "quant_state", None)  # packed: 2 weights per byte
        count = quant_state.shape.numel() if quant_state is not None else parameter.numel()
        total += count
        trainable += count if parameter.requires_grad else 0
    return trainable, total


def describe_trainable(model: nn.Module) -> str:
    """E.g. "trainable 294,912 of 5,703,498 parameters (5.17%)"."""
    trainable, total = trainable_parameters(model)
    share = 100 * trainable / total if total else 0.0
    return f"trainable {trainable:,} of {total:,} parameters ({share:.2f}%)"


def merge_lora(model: PeftModel, *, report: bool = False) -> nn.Module | tuple[nn.Module, float]:
    """Folds the active adapter into the base weights and returns the plain module.

    The result is the encoder, tower or objective that `apply_lora` wrapped, with
    W + (alpha / r) B A in each target Linear (exact in the fused qkv) and the trained copies
    of `train_modules`; an encoder's or tower's `save_pretrained` writes a native checkpoint
    of it. A 4-bit model is first dequantised to float Linears and the adapter merged onto
    those: its merge error (rounding in bfloat16 compute that the float model no longer has)
    is always logged. `model` is consumed: use the returned module.

    Args:
        model: what `apply_lora` returned.
        report: also return the merge error, max |merged - adapted| over the encoder's
            tokens for a fixed random image of the encoder's size.

    Returns:
        The merged module, or (module, error) with `report`.

    Raises:
        ValueError: with `report` (or a 4-bit model) when no `VisionEncoder` is found at the
            model or its `.encoder` to probe.
    """
    bnb = _bitsandbytes_if_loaded()
    quantized = bnb is not None and any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    probe = _probe(model.get_base_model()) if report or quantized else None
    if probe is not None:
        with torch.no_grad():
            adapted = probe()
    if quantized:
        model = _dequantized_copy_of_adapter(model, bnb)
    merged = model.merge_and_unload()
    if probe is None:
        return merged
    with torch.no_grad():
        error = (_probe(merged)() - adapted).abs().max().item()
    logger.info("merged LoRA into %s; max |merged - adapted| = %.3g%s", type(merged).__name__,
                error, " (4-bit base dequantised)" if quantized else "")
    return (merged, error) if report else merged


def save_adapter(model: PeftModel, directory: str | Path, adapter_name: str | None = None) -> Path:
    """Writes one adapter in peft's format (`adapter_config.json`, `adapter_model.safetensors`);
    the base weights are not written.

    peft puts an adapter not named "default" in `directory/<adapter_name>`; the folder
    actually written is returned, and is what `load_adapter` takes. A small
    `vlm_vit_lora.json` beside peft's files records whether it is an `attn_qv` adapter.

    Args:
        model: what `apply_lora` returned.
        directory: created if needed.
        adapter_name: which adapter; the active one by default.

    Returns:
        The folder holding the adapter.
    """
    name = adapter_name or model.active_adapter
    _check_adapter(model, name)
    model.save_pretrained(str(directory), selected_adapters=[name])
    folder = Path(directory) / name if name != "default" else Path(directory)
    qv_only = any(hasattr(p, _KEY_HOOK) for p in _qkv_lora_b_weights(model, name))
    (folder / QV_ONLY_FILE).write_text(json.dumps({"attn_qv": qv_only}) + "\n")
    logger.info("saved LoRA adapter %r to %s", name, folder)
    return folder


def load_adapter(model: nn.Module, directory: str | Path, adapter_name: str = "default", *,
                 trainable: bool = False) -> PeftModel:
    """Loads an adapter written by `save_adapter` onto a plain base or beside the adapters a
    `PeftModel` holds.

    On a plain base the adapter is active; beside others it is not (see `set_adapter`). An
    `attn_qv` adapter gets its key-row gradient hooks again.

    Args:
        model: the base module (the same architecture the adapter was trained on; for a
            QLoRA adapter, first quantised with `quantize_blocks`), or a `PeftModel` on it.
        directory: the folder `save_adapter` returned.
        adapter_name: the name to give it; must be new.
        trainable: load it for further training rather than inference only.

    Returns:
        The `PeftModel` (`model` itself when it was one).

    Raises:
        ValueError: when `adapter_name` is taken.
    """
    peft = import_peft("loading a LoRA adapter")
    if not isinstance(model, peft.PeftModel):
        model = peft.PeftModel.from_pretrained(model, str(directory), adapter_name=adapter_name,
                                               is_trainable=trainable)
    elif adapter_name in model.peft_config:
        raise ValueError(f"adapter name {adapter_name!r} is taken (have "
                         f"{sorted(model.peft_config)})")
    else:
        model.load_adapter(str(directory), adapter_name, is_trainable=trainable)
    marker = Path(directory) / QV_ONLY_FILE
    if marker.exists() and json.loads(marker.read_text()).get("attn_qv"):
        _hold_key_rows(model, adapter_name)
    logger.info("loaded LoRA adapter %r from %s", adapter_name, directory)
    return model


def set_adapter(model: PeftModel, adapter_name: str) -> PeftModel:
    """Makes `adapter_name` the active adapter (the others stay loaded but unused).

    Returns:
        `model`.

    Raises:
        ValueError: for an adapter the model does not hold.
    """
    _check_adapter(model, adapter_name)
    model.set_adapter(adapter_name)
    if any(hasattr(p, _KEY_HOOK) for p in _qkv_lora_b_weights(model, adapter_name)):
        _hold_key_rows(model, adapter_name)  # idempotent: re-applies a missing hook only
    return model


# -- targets -----------------------------------------------------------------------------------

def _resolve_targets(model: nn.Module, targets: str | Sequence[str]) -> tuple[list[str], str]:
    """The module names LoRA goes on, and the regex peft gets (matched with re.fullmatch)."""
    modules = dict(model.named_modules())
    if isinstance(targets, str):
        if targets not in PRESETS:
            raise ValueError(f"unknown LoRA target preset {targets!r}; choose one of "
                             f"{sorted(PRESETS)} or pass a list of module names")
        names = [name for name, module in modules.items()
                 if re.fullmatch(_BLOCK + PRESETS[targets], name) and isinstance(module, nn.Linear)]
        if not names:
            raise ValueError(f"LoRA target preset {targets!r} matches no Linear in "
                             f"{type(model).__name__} (it looks inside `blocks.N`)")
        # The paths of the found Linears inside their block, so "all" stays exact.
        inner = sorted({re.sub(_BLOCK, "", name, count=1) for name in names})
        return names, _BLOCK + "(?:" + "|".join(map(re.escape, inner)) + ")"
    names = list(targets)
    if not names:
        raise ValueError("LoRA targets is an empty list")
    missing = [name for name in names if not name or name not in modules]
    if missing:
        linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
        raise ValueError(f"LoRA targets {missing} are not modules of {type(model).__name__} "
                         f"(full names, e.g. {linears[:4]})")
    return names, "(?:" + "|".join(map(re.escape, names)) + ")"


def _check_train_modules(model: nn.Module, train_modules: list[str]) -> None:
    # peft finds modules_to_save by suffix; a name must be a module and the only suffix match.
    names = [name for name, _ in model.named_modules()]
    for wanted in train_modules:
        if wanted not in names:
            raise ValueError(f"train module {wanted!r} is not a module of "
                             f"{type(model).__name__}")
        clashes = [name for name in names if name.endswith(wanted) and name != wanted]
        if clashes:
            raise ValueError(f"train module {wanted!r} would also catch {clashes[:4]}; "
                             "peft matches modules_to_save by suffix")


def _describe_targets(targets: str | Sequence[str]) -> str:
    return targets if isinstance(targets, str) else ", ".join(targets)


# -- attn_qv: the key slice of the fused qkv stays frozen ------------------------------------

def _qkv_lora_b_weights(model: nn.Module, adapter_name: str) -> list[nn.Parameter]:
    """The lora_B weights `[3D, r]` of `adapter_name` on the fused `attn.qkv` Linears."""
    weights = []
    for name, module in model.named_modules():
        lora_b = getattr(module, "lora_B", None)
        if (re.fullmatch(r"(?:.*\.)?attn\.qkv", name) and isinstance(lora_b, nn.ModuleDict)
                and adapter_name in lora_b):
            weights.append(lora_b[adapter_name].weight)
    return weights


def _hold_key_rows(model: nn.Module, adapter_name: str) -> None:
    """Zeroes lora_B's key rows D..2D and zeroes their gradient from now on.

    With B's key rows at zero and no gradient, any optimizer (SGD, Adam, decoupled weight
    decay) leaves them at zero, so B A adds nothing to the key projection.
    """
    weights = _qkv_lora_b_weights(model, adapter_name)
    if not weights:
        raise ValueError(f"adapter {adapter_name!r} has no LoRA on an `attn.qkv` Linear")
    for weight in weights:
        width = weight.shape[0] // 3
        if weight.shape[0] != 3 * width:
            raise ValueError(f"attn.qkv's lora_B has {weight.shape[0]} rows, not 3 x width")
        with torch.no_grad():
            weight[width:2 * width].zero_()
        if weight.requires_grad and not hasattr(weight, _KEY_HOOK):  # not for inference
            weight.register_hook(_zero_rows_hook(width, 2 * width))
            setattr(weight, _KEY_HOOK, (width, 2 * width))


def _zero_rows_hook(start: int, stop: int):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[start:stop] = 0
        return grad
    return hook


# -- QLoRA -------------------------------------------------------------------------------------

def _to_4bit(bnb, linear: nn.Linear) -> nn.Module:
    device = linear.weight.device
    quantized = bnb.nn.Linear4bit(
        linear.in_features, linear.out_features, bias=linear.bias is not None,
        compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4", device="meta",
    )
    quantized.weight = bnb.nn.Params4bit(linear.weight.data.clone(), requires_grad=False,
                                         quant_type="nf4", compress_statistics=True)
    if linear.bias is not None:
        quantized.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=False)
    if linear.in_features % quantized.weight.blocksize:
        # bitsandbytes (0.50) repacks 4-bit weights for inference on CPUs with AVX512-BF16,
        # assuming whole quantisation blocks per row; a narrower layer crashes there
        # ("shape '[96, 0]' is invalid"), so such a layer keeps the portable kernel.
        quantized.support_avx512bf16_for_cpu = False
    return quantized.to(device)  # Params4bit quantises when moved, also to its own device


def _check_4bit_runs(bnb, device: torch.device) -> None:
    """Quantises and runs one small layer, so an unsupported device fails here, clearly."""
    try:
        layer = _to_4bit(bnb, nn.Linear(64, 64).to(device))
        if not layer.weight.bnb_quantized:
            raise RuntimeError("the weight was not quantised when moved to the device")
        layer(torch.zeros(1, 64, device=device))
    except Exception as error:  # bitsandbytes raises many kinds for a missing backend
        raise RuntimeError(
            f"bitsandbytes {getattr(bnb, '__version__', '?')} cannot run 4-bit NF4 layers on "
            f"{device}: its {device.type} backend is missing or failed ({error})"
        ) from error


def _bitsandbytes_if_loaded():
    # No 4-bit layer can exist unless bitsandbytes was imported; never import it just to look.
    import sys
    return sys.modules.get("bitsandbytes")


def _dequantized_copy_of_adapter(model: PeftModel, bnb) -> PeftModel:
    """Rebuilds the active adapter on a float copy of the base: every Linear4bit becomes an
    nn.Linear with the dequantised weight, so the merge is exact float arithmetic."""
    peft = import_peft("LoRA merging")
    name = model.active_adapter
    config = copy.deepcopy(model.peft_config[name])
    state = peft.get_peft_model_state_dict(model, adapter_name=name)
    base = model.unload()  # the trained copies of train_modules stay in place
    for module_name, module in list(base.named_modules()):
        if isinstance(module, bnb.nn.Linear4bit):
            weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
            dense = nn.Linear(module.in_features, module.out_features,
                              bias=module.bias is not None, device=weight.device,
                              dtype=weight.dtype)
            with torch.no_grad():
                dense.weight.copy_(weight)
                if module.bias is not None:
                    dense.bias.copy_(module.bias)
            parent_name, _, child = module_name.rpartition(".")
            setattr(base.get_submodule(parent_name), child, dense)
    if "is_loaded_in_4bit" in vars(base):
        del base.is_loaded_in_4bit
    rebuilt = peft.get_peft_model(base, config, adapter_name=name)
    peft.set_peft_model_state_dict(rebuilt, state, adapter_name=name)
    return rebuilt


# -- helpers -----------------------------------------------------------------------------------

def _check_adapter(model: PeftModel, adapter_name: str) -> None:
    if adapter_name not in model.peft_config:
        raise ValueError(f"no adapter named {adapter_name!r}; the model has "
                         f"{sorted(model.peft_config)}")


def _probe(module: nn.Module):
    """A closure giving the encoder's tokens for one fixed random image."""
    encoder = module if isinstance(module, VisionEncoder) else getattr(module, "encoder", None)
    if not isinstance(encoder, VisionEncoder):
        raise ValueError(f"cannot measure the merge error: {type(module).__name__} is not a "
                         "VisionEncoder and holds none as `.encoder`")
    config = encoder.config
    height, width = config.grid[0] * config.patch_size, config.grid[1] * config.patch_size
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(1, config.in_channels, height, width, generator=generator)
    parameter = next(p for p in encoder.parameters() if p.is_floating_point())
    pixels = pixels.to(parameter.device, parameter.dtype)

    def run() -> torch.Tensor:
        training = encoder.training
        encoder.eval()  # no dropout in the comparison
        try:
            return encoder(pixels).tokens.float()
        finally:
            encoder.train(training)
    return run
