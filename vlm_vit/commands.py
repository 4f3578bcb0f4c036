"""Helpers for `vlm-vit` subcommands, the core's and plugins' alike.

A plugin adds a subcommand through the entry-point group `vlm_vit.commands` (a function that
takes the argparse subparsers); this module is the public API such a command uses to read
checkpoints and check its arguments the way the core's commands do, so that plugins never
import `vlm_vit.cli`. `vlm_vit.cli.common` re-exports every name here.
"""

from __future__ import annotations

import contextlib
import pickle
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from vlm_vit.config import EncoderConfig, available_variants
from vlm_vit.registry import UnknownNameError

if TYPE_CHECKING:  # torch and the model load only when a command runs
    from vlm_vit.model import VisionEncoder


def check_device(device: str) -> str:
    """The `--device` every command runs on: "auto" becomes "cuda" when CUDA is available,
    else "cpu" (a bare "cuda" still means each torchrun process's own GPU); any other
    device is returned as given once it is known to be on this machine.

    Raises:
        ValueError: for a device that is not one, or not on this machine, naming it and
            what to use instead.
    """
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device!r} is not a device; use auto, cpu, cuda or "
                         f"cuda:N") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device} asked for, but CUDA is not available on this "
                             f"machine; use --device cpu (or auto)")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    elif resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device} asked for, but MPS is not available; use --device "
                         f"cpu")
    elif resolved.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {device}: vlm-vit runs on cpu, cuda or mps")
    return device


def image_size(values: list[int] | None) -> tuple[int, int] | None:
    """`--image-size SIDE` or `--image-size HEIGHT WIDTH` as (height, width); None if absent."""
    if not values:
        return None
    if len(values) not in (1, 2):
        raise ValueError(f"--image-size takes SIDE or HEIGHT WIDTH, got {values}")
    return (values[0], values[-1])


def is_variant(model: str) -> bool:
    """Whether a command that takes variants and checkpoints reads `model` as a variant: an
    existing path wins, then a known variant name (`vit-b/16`); anything else, and any
    `hf-hub:` name, is a checkpoint or a model name (`vlm_vit.io.hub`)."""
    return model in available_variants() and not Path(model).exists()


def variant_or_checkpoint(model: str, size: tuple[int, int] | int | None) -> VisionEncoder:
    """A named variant at random init (see `is_variant`), else a checkpoint's encoder."""
    overrides = {"image_size": size} if size else {}
    if is_variant(model):
        from vlm_vit.model import VisionEncoder

        return VisionEncoder(EncoderConfig.from_name(model, **overrides))
    from vlm_vit.io.loading import load_encoder

    with reading_checkpoint(model):
        return load_encoder(model, **overrides)


@contextlib.contextmanager
def not_a_variant_either(model: str) -> Iterator[None]:
    """Adds the variant names to the error of a name that is no path, variant or cached
    model, since a mistyped variant (`vit-b/17`) ends there too."""
    from vlm_vit.io.hub import NotCachedError

    try:
        yield
    except NotCachedError as error:
        try:
            EncoderConfig.from_name(model)
        except (KeyError, ValueError) as unknown:  # UnknownNameError, with close matches
            raise NotCachedError(error.problem, f"{error.fetch}. Nor a variant: {unknown}") \
                from error
        raise


# What a weight file that is no checkpoint at all makes the readers of other libraries raise
# (torch.load of text gives `KeyError: 101`, of a cut file `EOFError`).
_GARBAGE_ERRORS = (pickle.UnpicklingError, KeyError, IndexError, EOFError, struct.error,
                   UnicodeDecodeError)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


@contextlib.contextmanager
def reading_checkpoint(model: str | Path) -> Iterator[None]:
    """Reading (and building from) the checkpoint `model`: a file that is not a checkpoint
    becomes one ValueError naming it, whatever the reader below raised; and the error of a
    name that is no path, variant or cached model lists the variants (`not_a_variant_either`).

    Raises:
        ValueError: `MODEL is not a readable checkpoint` for a file none of the readers can
            read, `MODEL is a pickle that needs arbitrary code` for one that would run code.
    """
    from vlm_vit.io.loading import unpickling_refusal

    try:
        with not_a_variant_either(str(model)):
            yield
    except UnknownNameError:  # a KeyError, but ours
        raise
    except _GARBAGE_ERRORS as error:
        if isinstance(error, pickle.UnpicklingError) and unpickling_refusal(error)[0]:
            raise ValueError(f"{model} is a pickle that needs arbitrary code to load, and "
                             f"vlm-vit never runs code from a checkpoint "
                             f"({unpickling_refusal(error)[1]})") from error
        raise ValueError(f"{model} is not a readable checkpoint: no safetensors, PyTorch or "
                         f".npz file that loads ({type(error).__name__}: {error})") from error


@contextlib.contextmanager
def refusing_pickles(directory: str | Path, what: str) -> Iterator[None]:
    """Loading `directory` through another library (transformers, peft) that reads `.bin`
    files with torch's weights-only unpickler: its refusal becomes one ValueError naming
    `what` (the argument, e.g. MODEL) and the pickle files there.

    Raises:
        ValueError: for a weight file that needs code to load or is no pickle at all.
    """
    from vlm_vit.io.loading import unpickling_refusal

    try:
        yield
    except pickle.UnpicklingError as error:
        directory = Path(directory)
        pickles = sorted(str(path.relative_to(directory)) for path in directory.rglob("*")
                         if path.suffix in PICKLE_SUFFIXES and path.is_file()) \
            if directory.is_dir() else [directory.name]
        files = ", ".join(pickles) or "a weight file"
        needs_code, reason = unpickling_refusal(error)
        problem = ("is a pickle that needs arbitrary code to load, and vlm-vit never runs code "
                   "from a checkpoint; re-save its weights as safetensors" if needs_code else
                   "is not a readable PyTorch file (truncated or corrupt?)")
        raise ValueError(f"{what} {directory}: {files} {problem} ({reason})") from error


def check_output_apart(out: Path, model: str | Path, inputs: Iterable[str | Path], *,
                       inputs_are: str = "one of the inputs", flag: str = "-o",
                       replaced: bool = False) -> None:
    """Refuses an output path that would overwrite what the command reads: the model (its
    file, or anything inside its folder) or one of `inputs` (those that exist).

    Args:
        out: the -o path (a file or a folder).
        model: the model argument; only a local path can be overwritten.
        inputs: the paths read; an output equal to one of them is refused.
        inputs_are: how the message calls such an input.
        flag: how the message calls the output (`-o`, `DST`).
        replaced: `out` is a folder the command replaces whole, so a model inside it is
            refused too.

    Raises:
        ValueError: naming the output and what it would overwrite.
    """
    target = out.resolve()
    model_path = Path(str(model))
    if model_path.exists():
        root = model_path.resolve()
        if model_path.is_dir() and target.is_relative_to(root):
            raise ValueError(f"{flag} {out} is inside the model folder {model}; write the "
                             "output elsewhere")
        if target == root:
            raise ValueError(f"{flag} {out} is the model file {model}; write the output "
                             "elsewhere")
        if replaced and root.is_relative_to(target):
            raise ValueError(f"{flag} {out} holds the model {model}, which writing {flag} "
                             "would replace; write the output elsewhere")
    if target in {Path(item).resolve() for item in inputs if Path(item).exists()}:
        raise ValueError(f"{flag} {out} is {inputs_are}; write the output elsewhere")


def add_strategy_arguments(parser) -> None:
    """`--strategy ddp|fsdp` and `--cpu-offload`, for every training command (they become
    `TrainConfig.strategy` and `TrainConfig.cpu_offload`)."""
    parser.add_argument(
        "--strategy", choices=["ddp", "fsdp"], default="ddp",
        help="under torchrun: ddp replicates the model on every process (the default; use it "
        "while the model, its gradients and AdamW's moments, 16 bytes per parameter, fit one "
        "device); fsdp shards all three over the processes (FSDP2) and writes distributed "
        "checkpoints that resume at any number of processes")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="fsdp only: keep parameters and optimizer state in host memory")


def add_model_argument(parser, *, optional: bool = False, help: str) -> None:
    """The model a command starts from: its first positional argument, `MODEL`, in every
    command (a checkpoint, a model name, or a variant where the command builds one)."""
    parser.add_argument("model", metavar="MODEL", nargs="?" if optional else None,
                        help=help)


def add_lora_arguments(parser, *, targets_help: str, default_targets: list[str] | None,
                       switch: bool) -> None:
    """LoRA's flags, one shape in every command: `--lora-r`, `--lora-alpha`,
    `--lora-dropout`, `--lora-targets` (and `--lora`, which turns it on, where LoRA is a
    choice rather than the stage's)."""
    group = parser.add_argument_group("LoRA")
    if switch:
        group.add_argument("--lora", action="store_true",
                           help="train LoRA adapters (and the head) instead of every weight")
    group.add_argument("--lora-r", type=int, default=16, metavar="R", help="the rank")
    group.add_argument("--lora-alpha", type=float, default=32.0, metavar="ALPHA",
                       help="the scale numerator: updates are scaled by alpha / r")
    group.add_argument("--lora-dropout", type=float, default=0.0, metavar="P")
    group.add_argument("--lora-targets", nargs="+", default=default_targets, metavar="NAME",
                       help=targets_help)


def lora_options(args) -> dict:
    """The LoRA flags as `apply_lora` keyword arguments (a single preset name as a string).

    Raises:
        ValueError: a rank below 1, an alpha or dropout out of range, naming the flag.
    """
    if args.lora_r < 1:
        raise ValueError(f"--lora-r must be at least 1, got {args.lora_r}")
    if args.lora_alpha <= 0:
        raise ValueError(f"--lora-alpha must be positive, got {args.lora_alpha}")
    if not 0 <= args.lora_dropout < 1:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    targets = args.lora_targets
    if targets is not None and len(targets) == 1:
        targets = targets[0]
    return {"r": args.lora_r, "alpha": args.lora_alpha, "dropout": args.lora_dropout,
            **({"targets": targets} if targets is not None else {})}


def add_optimisation_arguments(parser, *, steps: int, batch_size: int, lr: float | None,
                               lr_help: str, warmup_help: str, weight_decay: float | None,
                               checkpoint_every: int | None, num_workers: int = 2,
                               weight_decay_help: str | None = None) -> None:
    """The optimisation flags every training command takes, with the command's defaults:
    steps, batch, accumulation, learning rate and warmup, weight decay, seed, checkpoint
    interval, precision, compile, activation checkpointing, loader workers, device."""
    group = parser.add_argument_group("optimisation")
    group.add_argument("--steps", type=int, default=steps)
    group.add_argument("--batch-size", type=int, default=batch_size,
                       help="global batch per step")
    group.add_argument("--grad-accumulation", type=int, default=1, metavar="N",
                       help="micro-batches per step (the batch is split N ways)")
    group.add_argument("--lr", type=float, default=lr, help=lr_help)
    group.add_argument("--warmup-steps", type=int, default=None, help=warmup_help)
    group.add_argument("--weight-decay", type=float, default=weight_decay,
                       help=weight_decay_help)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--checkpoint-every", type=int, default=checkpoint_every, metavar="N",
                       help="steps between checkpoints (default "
                       f"{checkpoint_every or 'a fifth of the steps'}; Ctrl-C or SIGTERM "
                       "also saves one, at the step it stops)")
    group.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                       type=precision_name,
                       help="autocast precision, also spelled float32, bfloat16, float16 "
                       "(default: bf16 on a GPU, fp32 on a CPU)")
    group.add_argument("--compile", action="store_true", help="torch.compile the model")
    group.add_argument("--grad-checkpointing", action="store_true",
                       help="recompute activations in the backward pass (less memory)")
    group.add_argument("--num-workers", type=int, default=num_workers)
    group.add_argument("--device", default="auto")


def optimisation_options(args, *, lr: float, warmup_steps: int,
                         checkpoint_every: int | None = None) -> dict:
    """`TrainConfig` keyword arguments from `add_optimisation_arguments`' flags, with the
    command's defaults for the learning rate, warmup and checkpoint interval where they were
    not given."""
    import torch

    cuda = torch.cuda.is_available() and args.device in ("auto", "cuda")
    return {"steps": args.steps, "batch_size": args.batch_size,
            "grad_accumulation": args.grad_accumulation,
            "lr": lr if args.lr is None else args.lr,
            "warmup_steps": warmup_steps if args.warmup_steps is None else args.warmup_steps,
            "weight_decay": args.weight_decay,
            "precision": args.precision or ("bf16" if cuda else "fp32"),
            "grad_checkpointing": args.grad_checkpointing, "compile": args.compile,
            "checkpoint_every": checkpoint_every if args.checkpoint_every is None
            else args.checkpoint_every, "seed": args.seed,
            "num_workers": args.num_workers, "device": args.device}


# `--precision` (training autocast) takes the short names, `--dtype` (stored weights) the long;
# each accepts every spelling of `vlm_vit.presets.DTYPE_SPELLINGS`.
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def precision_name(text: str) -> str:
    """`--precision`'s value as its short name (`bfloat16` -> `bf16`); an unknown one is left
    for argparse's choices to refuse."""
    from vlm_vit.presets import DTYPE_SPELLINGS

    return _SHORT.get(DTYPE_SPELLINGS.get(text.lower(), ""), text)


def dtype_name(text: str) -> str:
    """`--dtype`'s value as its long name (`bf16` -> `bfloat16`); an unknown one is left for
    argparse's choices to refuse."""
    from vlm_vit.presets import DTYPE_SPELLINGS

    return DTYPE_SPELLINGS.get(text.lower(), text)
