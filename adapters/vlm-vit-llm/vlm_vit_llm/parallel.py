"""The LLM bridge under data parallelism: DDP, or FSDP2 (`TrainConfig(strategy="fsdp")`).

Two things differ from training on one process.

Every rank must join the same collectives at every step: FSDP2 all-gathers each block's
parameters as the block runs, and DDP all-reduces the gradient of every trainable parameter.
A rank whose batch holds no image (LLaVA's text-only records) would skip the tower and the
projector, and the ranks that did run them would wait for it. So such a rank runs them on
one blank image (`idle_image_features`), and `MultimodalLM.embed` adds `0.0 *` the sum of
those tokens to the input embeddings: the loss and every gradient stay exactly what they
were, and the projector's gradient is zero instead of missing. One process skips this,
except in stage 1 (only the tower trains), where without it such a batch's loss would have
no gradient at all and its backward pass would fail.

The final export receives the objective's whole state gathered from the shards, and writes
it through the same `save_pretrained` as an unsharded run (`whole_parameters`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from vlm_vit.processor.anyres import num_views
from vlm_vit_llm.batch_types import TiledImage


def several_processes() -> bool:
    """Whether this process is one of several in a `torch.distributed` process group."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def idle_image_features(mm: Any) -> torch.Tensor | None:
    """The projected tokens `[M, D]` of one blank image at the processor's size (a tiled
    tower's: one tile-sized image, as its views and size), for a batch without images, when
    the tower must run all the same: on one of several processes (its tower and projector
    join the step's collectives), or when only the tower trains (the loss needs a gradient);
    else None, at no cost.

    Args:
        mm: the `MultimodalLM`.
    """
    if not (several_processes() or _only_the_tower_trains(mm)):
        return None
    channels = mm.tower.encoder.config.in_channels
    tiling = mm.tower.tiling
    if tiling is None:
        return mm.image_features([torch.zeros(channels, *mm.processor.size)])[0]
    side = (tiling.tile_size, tiling.tile_size)
    blank = TiledImage(torch.zeros(num_views(tiling, side), channels, *side), side)
    return mm.image_features([blank])[0]


def _only_the_tower_trains(mm: Any) -> bool:
    """Whether gradients are on and the tower (the projector, at least) trains, the LLM not."""
    return (torch.is_grad_enabled() and any(p.requires_grad for p in mm.tower.parameters())
            and not any(p.requires_grad for p in mm.llm.parameters()))


@contextlib.contextmanager
def whole_parameters(module: nn.Module, state: dict[str, torch.Tensor]) -> Iterator[None]:
    """Within the block, every parameter of `module` is the whole tensor `state` holds under
    its name (a sharded module's parameters are this rank's shards); the module's own
    parameters come back after it. Tied parameters stay tied; buffers are not sharded, and
    stay.

    Args:
        module: the (sharded) module.
        state: its whole state dict, as `nn.Module.state_dict` names it.

    Raises:
        ValueError: naming the parameters `state` lacks.
    """
    slots = []  # (owner, attribute, the parameter it holds now, its name in `state`)
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for attribute, parameter in owner._parameters.items():
            if parameter is not None:
                name = f"{prefix}.{attribute}" if prefix else attribute
                slots.append((owner, attribute, parameter, name))
    missing = sorted({name for *_, name in slots if name not in state})
    if missing:
        raise ValueError(f"the gathered state lacks {len(missing)} of the model's parameters "
                         f"(first: {', '.join(missing[:3])}): an export needs the whole state "
                         "of every parameter, frozen ones too, not the checkpoint's tensors")
    whole: dict[int, nn.Parameter] = {}  # by the live parameter: a tied one is swapped once
    for _, _, parameter, name in slots:
        if id(parameter) not in whole:
            whole[id(parameter)] = nn.Parameter(state[name].detach(),
                                                requires_grad=parameter.requires_grad)
    try:
        for owner, attribute, parameter, _ in slots:
            owner._parameters[attribute] = whole[id(parameter)]
        yield
    finally:
        for owner, attribute, parameter, _ in slots:
            owner._parameters[attribute] = parameter
