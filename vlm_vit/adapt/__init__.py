"""Adapting an encoder: LoRA and QLoRA through peft and bitsandbytes (`lora`), and the image
classifier a fine-tune trains and saves (`finetune`).

Its modules load on first use (`vlm_vit.adapt.lora` as an attribute imports it), as the
top-level package's names do; no sub-module is imported here.
"""

from vlm_vit.optional import lazy_submodules

__getattr__ = lazy_submodules(__name__, ("lora", "finetune"))
