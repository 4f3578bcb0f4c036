"""Adapting an encoder: LoRA and QLoRA through peft and bitsandbytes (`lora`), and the image
classifier a fine-tune trains and saves (`finetune`).

Its modules load on first use (`vlm_vit.adapt.lora` as an attribute imports it), as the
top-level package's names do; nothing is imported here.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = ('lora', 'finetune')


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'vlm_vit.adapt' has no attribute {name!r}")
    return importlib.import_module(f"vlm_vit.adapt.{name}")
