"""LoRA folded into the weights it adapts: a plain `MultimodalLM` again (`vlm-vit llm merge`).

A stage-2 model carries its LoRA as adapters beside the frozen base (`llm_adapter/`,
`vision_adapter/`). Merged, it is one set of weights that stage 2 can put new LoRA on, that
loads without peft, and that `MultimodalLM.from_pretrained` reads as any stage-1 model.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vlm_vit_llm.peft_helpers import split_peft

if TYPE_CHECKING:
    from vlm_vit_llm.model import MultimodalLM

logger = logging.getLogger(__name__)


def has_adapters(mm: MultimodalLM) -> bool:
    """Whether LoRA is on the LLM or the encoder."""
    return any(split_peft(part)[1] is not None for part in (mm.llm, mm.tower.encoder))


def merge_adapters(mm: MultimodalLM) -> MultimodalLM:
    """Folds every LoRA adapter of `mm` into its base weights, in place (peft's
    `merge_and_unload`: `W + scaling * B @ A` in the weight's dtype), so no second copy of
    the model is made; unlike `MultimodalLM.merged`, `mm` itself changes.

    Returns:
        `mm`, its LLM and encoder plain modules.

    Raises:
        ValueError: when `mm` has no adapter, or one that does not merge by addition.
    """
    if not has_adapters(mm):
        raise ValueError("the model has no LoRA adapter: nothing to merge")
    for owner, name in ((mm, "llm"), (mm.tower, "encoder")):
        adapter = split_peft(getattr(owner, name))[1]
        if adapter is None:
            continue
        from peft.tuners.lora import LoraLayer

        for module_name, layer in adapter.named_modules():
            if isinstance(layer, LoraLayer) and any(
                    layer.use_dora.get(active) for active in layer.active_adapters):
                raise ValueError(f"{name}: {module_name} holds a DoRA adapter; only plain "
                                 "LoRA is merged here")
        setattr(owner, name, adapter.merge_and_unload())
        logger.info("merged the %s's LoRA into its weights", name)
    return mm
