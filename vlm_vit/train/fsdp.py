"""The "fsdp" strategy: PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each transformer block is one unit (its parameters are gathered just before it runs and
freed after), and the root takes everything else (patch embedding, norms, heads, poolers,
an LLM's embeddings). A rank then holds 1/world_size of every parameter, gradient and AdamW
moment instead of all of them. Gradients are reduce-scattered as the backward pass leaves
each block, averaged over ranks as DDP averages them.

The units are the objective's own `fsdp_units()` when it has one, else every
`vlm_vit.model.Block` (the encoder's blocks, an MAE or MPP decoder's) and every module of a
class a Hugging Face model lists in `_no_split_modules` (an LLM's decoder layers). Frozen
parameters (a stage-1 LLM, a frozen tower) are sharded too; they get no gradients and the
optimiser never sees them.

With `precision="bf16"`, parameters are gathered in bf16 and gradients reduced in fp32
(`MixedPrecisionPolicy`); `cpu_offload` keeps the sharded parameters, their gradients and the
optimiser state in host memory (`CPUOffloadPolicy`). Activation checkpointing composes: a
recomputed block gathers its parameters again.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from vlm_vit.adapt.lora import FROZEN_ROWS
from vlm_vit.model import Block

logger = logging.getLogger(__name__)


def units(objective: nn.Module) -> list[nn.Module]:
    """The modules sharded one by one, innermost first (FSDP2 wants children before their
    parents): `objective.fsdp_units()`, or the blocks and decoder layers found inside."""
    own = getattr(objective, "fsdp_units", None)
    if callable(own):
        chosen = list(own())
    else:
        layer_classes: set[str] = set()
        for module in objective.modules():
            layer_classes.update(getattr(module, "_no_split_modules", None) or ())
        chosen = [module for module in objective.modules()
                  if isinstance(module, Block) or type(module).__name__ in layer_classes]
    order = {id(module): index for index, module in enumerate(objective.modules())}
    return sorted(chosen, key=lambda module: -order.get(id(module), -1))


def shard(objective: nn.Module, mesh_device: torch.device, *, precision: str = "fp32",
          cpu_offload: bool = False) -> int:
    """Applies `fully_shard` to every unit of `objective` and then to the objective itself,
    in place (the objective's class becomes an `FSDPModule`; its parameters, DTensors).

    Needs a process group (`vlm_vit.train.distributed.setup`). Every parameter and buffer is
    first broadcast from rank 0, as DDP does, so all ranks shard the same model.

    Args:
        objective: on `mesh_device` (or on the CPU with `cpu_offload`).
        mesh_device: this rank's device; the mesh spans every rank.
        precision: "bf16" gathers parameters in bf16 and reduces gradients in fp32.
        cpu_offload: keep parameters, gradients and optimiser state on the CPU.

    Returns:
        The number of units sharded besides the root.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(mesh_device.type, (dist.get_world_size(),))
    options: dict = {"mesh": mesh}
    if precision == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.float32)
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    _broadcast_from_rank0(objective)
    frozen_rows = {name: getattr(parameter, FROZEN_ROWS)
                   for name, parameter in objective.named_parameters()
                   if hasattr(parameter, FROZEN_ROWS)}
    found = units(objective)
    for unit in found:
        fully_shard(unit, **options)
    fully_shard(objective, **options)
    for name, parameter in objective.named_parameters():  # new Parameters: marks carried over
        if name in frozen_rows:
            setattr(parameter, FROZEN_ROWS, frozen_rows[name])
    if dist.get_rank() == 0:
        logger.info("FSDP2: %d units and the root sharded over %d ranks%s%s", len(found),
                    dist.get_world_size(), ", bf16 parameters" if precision == "bf16" else "",
                    ", offloaded to the CPU" if cpu_offload else "")
    return len(found)


def _broadcast_from_rank0(objective: nn.Module) -> None:
    """Every parameter and buffer takes rank 0's values, as DDP's constructor does, so ranks
    that built their models from different seeds still train one model."""
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in [*objective.parameters(), *objective.buffers()]:
            dist.broadcast(tensor.data, src=0)


def zero_frozen_gradients(objective: nn.Module) -> None:
    """Zeroes the gradient rows a parameter's `FROZEN_ROWS` mark holds frozen (LoRA's key
    rows under `attn_qv`) in this rank's shard of it. Tensor hooks do that for whole
    parameters, but FSDP2 writes a sharded parameter's gradient after its reduce-scatter,
    where no hook sees it; the step calls this before clipping."""
    for parameter in objective.parameters():
        rows, grad = getattr(parameter, FROZEN_ROWS, None), parameter.grad
        if rows is None or grad is None or not hasattr(grad, "to_local"):
            continue
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh,
                                                          grad.placements)
        zero_frozen_rows(grad.to_local(), offset[0], rows)


def zero_frozen_rows(local: torch.Tensor, offset: int, rows: tuple[int, int]) -> None:
    """Zeroes, in place, the part of the whole tensor's rows `[start, stop)` that lies in
    `local`, a shard of it along dim 0 whose first row is the whole tensor's row `offset`
    (none, some or all of `local`'s rows)."""
    start, stop = rows[0] - offset, rows[1] - offset
    local[max(start, 0):max(min(stop, local.shape[0]), 0)] = 0


def is_sharded(module: nn.Module) -> bool:
    """Whether `fully_shard` was applied to `module`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def local_number(value: torch.Tensor) -> float:
    """A scalar that may be a DTensor (a gradient norm over sharded gradients), as a float."""
    full = getattr(value, "full_tensor", None)
    return float((full() if callable(full) else value).item())


def full_state(objective: nn.Module) -> dict[str, torch.Tensor]:
    """The sharded objective's whole state: every parameter and buffer under
    `nn.Module.state_dict`'s names (not what an objective's own `state_dict()` checkpoints:
    the LLM bridge's holds only what trains), gathered onto rank 0's CPU one tensor at a time
    (the other ranks get an empty dict); every rank calls it."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    main = dist.get_rank() == 0
    state: dict[str, torch.Tensor] = {}
    for name, tensor in nn.Module.state_dict(objective).items():
        if isinstance(tensor, DTensor):
            if tensor.device.type != tensor.device_mesh.device_type:  # offloaded to the CPU
                tensor = tensor.to(tensor.device_mesh.device_type)
            tensor = tensor.full_tensor()
        if main:
            state[name] = tensor.detach().cpu()
    return state
