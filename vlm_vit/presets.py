"""Named settings that commands offer as choices: a leaf that imports nothing, so each
command's `--help` is built without torch (the modules that use these re-export them)."""

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
