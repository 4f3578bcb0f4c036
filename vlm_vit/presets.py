"""Named settings that commands offer as choices, and `parse_dtype`: a leaf that imports
nothing at import time, so each command's `--help` is built without torch (the modules that
use these re-export them)."""

from __future__ import annotations

#: (mean, std) per model family.
NORMALIZATION: dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    "clip": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "inception": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}
# How an image's tokens become one vector for a probe or a classifier head.
POOLINGS = ("cls", "mean")
# `encode --dtype`: weights in that dtype, or int8 dynamic quantization of the block Linears.
ENCODE_DTYPES = ("float32", "bfloat16", "float16", "int8")

#: Each usual spelling of a dtype and its canonical name (`parse_dtype`).
DTYPE_SPELLINGS: dict[str, str] = {
    "float32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16",
    "int8": "int8",  # dynamic quantization, where an API offers it
}
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def parse_dtype(value, allowed: tuple[str, ...] = FLOAT_DTYPES):
    """A `torch.dtype` from a `torch.dtype` or its usual string (`float32`/`fp32`,
    `bfloat16`/`bf16`, `float16`/`fp16`, `int8`), as every Python API that takes a dtype
    reads it; None stays None (as stored).

    Args:
        value: a `torch.dtype`, a spelling from `DTYPE_SPELLINGS` (any case), or None.
        allowed: the canonical names the caller takes (default: the float dtypes;
            `torch.int8` stands for int8 quantization where that is offered).

    Returns:
        The `torch.dtype`, or None.

    Raises:
        ValueError: naming the value and the spellings the caller takes.
    """
    import torch  # here: this module stays a leaf that `--help` imports without torch

    if value is None:
        return None
    name = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) \
        else DTYPE_SPELLINGS.get(value.lower()) if isinstance(value, str) else None
    if name not in allowed:
        known = ", ".join("/".join(s for s, c in DTYPE_SPELLINGS.items() if c == canonical)
                          for canonical in allowed)
        raise ValueError(f"unknown dtype {value!r} (known: {known}, or their torch.dtype)")
    return getattr(torch, name)
