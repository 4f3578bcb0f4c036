"""One DINOv2 training step (`--objective ibot`) against lightly's DINOv2, on the same crops,
weights and masks.

    python benchmarks/ibot_step_vs_lightly.py            # vit-s/16, batch 8, 2 x 224 + 8 x 96
    python benchmarks/ibot_step_vs_lightly.py --batch-size 2 --repeats 3
    python benchmarks/ibot_step_vs_lightly.py --device cuda --dtype bfloat16 --batch-size 64

A step is what a run of each does per batch: the teacher's forward on the global crops, the
student's on every crop (its global crops masked), the DINO, iBOT and KoLeo losses (weights
1, 1, 0.1), backward, an AdamW update with the weight-decay schedule, and the EMA update of
the teacher (encoder and head).

- vlm-vit: `MaskedSelfDistillation(packed=False)`: each crop size one batched call, as
  lightly does, so both do the same work (the packed, native-resolution path is
  `ibot_native_vs_square.py`'s).
- lightly: the training step of lightly's DINOv2 example (`examples/pytorch/dinov2.py`, and
  `benchmarks/imagenet/vitb16/dinov2.py`): timm's `VisionTransformer` (`dynamic_img_size`)
  in `MaskedVisionTransformerTIMM(antialias=False)`, one `DINOv2ProjectionHead` for DINO
  and iBOT (its default `ibot_separate_head=False`), `DINOLoss`, `IBOTPatchLoss`,
  `KoLeoLoss`, `update_momentum`, `cosine_schedule` and `linear_warmup_schedule`. Unlike the
  example, the student has no drop path (it is random, and ours has none) and the teacher's
  head starts as a copy of the student's (the example initialises the two apart; DINOv2
  copies).

Same weights: the timm ViT is built and wrapped (lightly's wrapper re-initialises it), its
state dict saved and loaded into our `VisionEncoder` through our timm converter
(`load_encoder`, position table resized as lightly's: bicubic, no antialias); the head's
weights are copied into ours. Same crops: `MultiCrop` in square mode on scikit-image's photos
(seeded). Same masks: one fixed set of block masks (`batch_block_masks`, seed 0) on every
step, handed to both.

The first step of each is checked before timing (it is also the warm-up): the loss and each
term must agree within `LOSS_TOLERANCE` (relative). For that check ours uses DINO's softmax
centering (`centering="softmax"`, a zero initial centre), which is what lightly's losses do;
DINOv2's default Sinkhorn-Knopp would give other targets. The candidates then alternate
(`timing.alternate`); the figures are ratios of medians. Peak memory is measured per library
in a fresh process (`--child`), after its model is built.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

# scikit-image's photos that ship with it (no download); image i is PHOTOS[i % 7].
from lightly_steps import LIBRARIES, PHOTOS  # noqa: E402
from timing import (  # noqa: E402
    add_model_arguments,
    alternate,
    autocast,
    config_from_args,
    cpu_name,
    flush_denormals,
    peak_memory_in_child,
    peak_memory_mib,
    synchronized,
    write_json,
)
from torch import nn  # noqa: E402

from vlm_vit import EncoderConfig, load_encoder  # noqa: E402
from vlm_vit.data.multicrop import MultiCrop, ViewBatch, collate_views  # noqa: E402
from vlm_vit.pretrain.block_masking import batch_block_masks  # noqa: E402
from vlm_vit.pretrain.ibot import MaskedSelfDistillation  # noqa: E402

# Relative agreement of the first step's loss and its terms. Measured at the reference preset
# (float32, CPU): 4e-7 at most; the same weights in two libraries differ only in the order of
# float32 sums (attention, LayerNorm, the 65536-way softmax).
LOSS_TOLERANCE = 1e-4
WEIGHT_DECAY, LEARNING_RATE = 0.04, 5e-4  # DINOv2's starting weight decay


# -- the crops and masks both libraries get -------------------------------------------------

def photo_views(multicrop: MultiCrop, images: int) -> ViewBatch:
    """`images` photos' crops (image i: `PHOTOS[i % 7]`, seed i), collated by view index."""
    from skimage import data

    photos = [multicrop.decoder.load(getattr(data, name)(), name) for name in PHOTOS]
    views = [multicrop(photos[index % len(photos)], seed=index) for index in range(images)]
    return collate_views(views).pixel_values


def fixed_masks(grids: list[tuple[int, int]], seed: int = 0) -> list[torch.Tensor]:
    """DINOv2's block masks for the global crops (`grids`, view-major), drawn once: every
    step masks these."""
    return batch_block_masks(grids, torch.Generator().manual_seed(seed))


def square_masks(args: argparse.Namespace, patch_size: int) -> list[torch.Tensor]:
    """`fixed_masks` for the 2 x B square global crops."""
    grid = args.global_size // patch_size
    return fixed_masks([(grid, grid)] * (2 * args.batch_size))


def use_masks(objective: MaskedSelfDistillation, masks: list[torch.Tensor]) -> None:
    """Makes `objective` mask `masks` (already on its device) on every step instead of
    drawing its own: its `draw_masks(grids, ...)` returns them."""
    def draw_masks(grids: list[tuple[int, int]], *_: Any) -> list[torch.Tensor]:
        if [tuple(mask.shape) for mask in masks] != [tuple(grid) for grid in grids]:
            raise ValueError(f"fixed masks on grids {[tuple(m.shape) for m in masks]} do not "
                             f"fit the crops' grids {grids}")
        return masks

    objective.draw_masks = draw_masks


# -- lightly's DINOv2 ----------------------------------------------------------------------

class LightlyDINOv2(nn.Module):
    """The model of lightly's DINOv2 example: student and teacher backbones and heads, one
    head serving DINO and iBOT, the teacher frozen."""

    def __init__(self, backbone: nn.Module, head: nn.Module, teacher_head: nn.Module) -> None:
        super().__init__()
        self.teacher_backbone = backbone
        self.student_backbone = copy.deepcopy(backbone)
        self.student_head, self.teacher_head = head, teacher_head
        for module in (self.teacher_backbone, self.teacher_head):
            module.requires_grad_(False).eval()

    def forward_teacher(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.teacher_backbone.encode(x)
        return features[:, 0], features

    def forward_student(self, x: torch.Tensor, mask: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        features = self.student_backbone.encode(x, mask=mask)
        return features[:, 0], None if mask is None else features[mask]


def lightly_head(width: int, args: argparse.Namespace) -> nn.Module:
    from lightly.models.modules import DINOv2ProjectionHead

    with warnings.catch_warnings():  # lightly's head uses the old torch weight_norm
        warnings.simplefilter("ignore", FutureWarning)
        return DINOv2ProjectionHead(input_dim=width, hidden_dim=args.head_hidden,
                                    bottleneck_dim=args.head_bottleneck,
                                    output_dim=args.prototypes)


def head_state_for_ours(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """lightly's `DINOv2ProjectionHead` weights under our `DINOHead`'s names (the same MLP;
    the old `weight_norm`'s g and v are the parametrization's original0 and original1)."""
    renamed = {"last_layer.weight_g": "last_layer.parametrizations.weight.original0",
               "last_layer.weight_v": "last_layer.parametrizations.weight.original1"}
    return {renamed.get(key, key.replace("layers.", "mlp.")): value.clone()
            for key, value in state.items()}


def build_pair(config: EncoderConfig, args: argparse.Namespace
               ) -> tuple[MaskedSelfDistillation, LightlyDINOv2]:
    """Ours and lightly's model on the same weights (see the module docstring)."""
    from lightly.models.modules import MaskedVisionTransformerTIMM

    from vlm_vit.convert.timm import build_timm_model
    from vlm_vit.io.files import write_safetensors

    torch.manual_seed(0)
    vit = build_timm_model(config, dynamic_img_size=True, init_values=args.layer_scale)
    backbone = MaskedVisionTransformerTIMM(vit=vit, antialias=False,
                                           pos_embed_initialization="skip")
    head = lightly_head(config.width, args)
    teacher_head = lightly_head(config.width, args)
    teacher_head.load_state_dict(head.state_dict())
    theirs = LightlyDINOv2(backbone, head, teacher_head)

    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "timm.safetensors")
        write_safetensors({k: v.contiguous() for k, v in vit.state_dict().items()}, path)
        encoder = load_encoder(path, heads=config.heads, pos_resize_antialias=False)
    ours = MaskedSelfDistillation(
        encoder, prototypes=args.prototypes, head_hidden=args.head_hidden,
        head_bottleneck=args.head_bottleneck, centering="softmax", packed=False,
        steps=args.schedule_steps)
    state = head_state_for_ours(head.state_dict())
    ours.head.load_state_dict(state)
    ours.teacher_head.load_state_dict(state)
    return ours, theirs


# -- one training step of each --------------------------------------------------------------

def ours_step(objective: MaskedSelfDistillation, views: ViewBatch, args: argparse.Namespace
              ) -> Callable[[], dict[str, float]]:
    """A step of ours as the trainer takes it (`vlm_vit.train.step`): forward, backward,
    AdamW, then `after_optimizer_step` (EMA teacher, next step's schedules)."""
    objective.train()  # as the trainer: the student in training mode, the teacher in eval
    optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad],
                                  lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    dtype, done = getattr(torch, args.dtype), [0]

    def step() -> dict[str, float]:
        with autocast(args.device, dtype):
            out = objective(views)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        objective.after_optimizer_step(done[0], args.schedule_steps, optimizer)
        done[0] += 1
        return {"loss": float(out.loss.detach()), **{name: out.metrics[name]
                                                      for name in ("dino", "ibot", "koleo")}}

    return synchronized(step, args.device)


def lightly_step(model: LightlyDINOv2, views: ViewBatch, masks: list[torch.Tensor],
                 args: argparse.Namespace) -> Callable[[], dict[str, float]]:
    """The training step of lightly's DINOv2 example, on fixed masks."""
    from lightly.loss import DINOLoss, IBOTPatchLoss, KoLeoLoss
    from lightly.models.utils import update_momentum
    from lightly.utils.scheduler import cosine_schedule, linear_warmup_schedule

    dino_criterion = DINOLoss(output_dim=args.prototypes).to(args.device)
    ibot_criterion = IBOTPatchLoss(output_dim=args.prototypes).to(args.device)
    koleo_criterion = KoLeoLoss()
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    global_views = torch.cat(list(views.global_views))  # (2B, 3, G, G), view-major as ours
    local_views = torch.cat(list(views.local_views))
    view_count = len(views.global_views) + len(views.local_views)
    block_mask = torch.stack(masks).to(args.device)  # (2B, H, W)
    mask = torch.cat([block_mask.new_zeros(len(masks), 1), block_mask.flatten(1)], dim=1)
    dtype, done, steps = getattr(torch, args.dtype), [0], args.schedule_steps

    def step() -> dict[str, float]:
        global_step = done[0]
        with autocast(args.device, dtype):
            with torch.no_grad():
                teacher_cls_token, teacher_features = model.forward_teacher(global_views)
                teacher_cls_out = model.teacher_head(teacher_cls_token)
                teacher_masked_out = model.teacher_head(teacher_features[mask])
            student_global_cls_token, student_global_masked_features = \
                model.forward_student(global_views, mask=mask)
            student_global_cls_out = model.student_head(student_global_cls_token)
            student_global_masked_out = model.student_head(student_global_masked_features)
            student_local_cls_token, _ = model.forward_student(local_views, mask=None)
            student_local_cls_out = model.student_head(student_local_cls_token)
            student_cls_out = torch.cat([student_global_cls_out, student_local_cls_out])
            teacher_temp = linear_warmup_schedule(step=global_step,
                                                  warmup_steps=int(0.3 * steps),
                                                  start_value=0.04, end_value=0.07)
            dino_loss = dino_criterion(teacher_out=teacher_cls_out.chunk(2),
                                       student_out=student_cls_out.chunk(view_count),
                                       teacher_temp=teacher_temp)
            ibot_loss = ibot_criterion(teacher_out=teacher_masked_out,
                                       student_out=student_global_masked_out,
                                       mask=block_mask, teacher_temp=teacher_temp)
            koleo_loss = sum(koleo_criterion(t) for t in student_global_cls_token.chunk(2))
            loss = dino_loss + ibot_loss + 0.1 * koleo_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        weight_decay = cosine_schedule(step=global_step, max_steps=steps,
                                       start_value=WEIGHT_DECAY, end_value=0.4)
        for group in optimizer.param_groups:
            if group["weight_decay"] != 0.0:
                group["weight_decay"] = weight_decay
        optimizer.step()
        momentum = cosine_schedule(step=global_step, max_steps=steps, start_value=0.992,
                                   end_value=1.0)
        update_momentum(model.student_backbone, model.teacher_backbone, m=momentum)
        update_momentum(model.student_head, model.teacher_head, m=momentum)
        done[0] += 1
        return {"loss": float(loss.detach()), "dino": float(dino_loss.detach()),
                "ibot": float(ibot_loss.detach()), "koleo": float(koleo_loss.detach())}

    return synchronized(step, args.device)


def steps_for(libraries: tuple[str, ...], args: argparse.Namespace
              ) -> dict[str, Callable[[], dict[str, float]]]:
    """One step function per library in `libraries`, on the same crops, weights and masks;
    the other library's model is dropped before returning (the memory children)."""
    config = config_from_args(args)
    multicrop = MultiCrop(patch_size=config.patch_size, global_size=args.global_size,
                          local_size=args.local_size, local_crops=args.local_crops)
    views = photo_views(multicrop, args.batch_size).to(args.device)
    masks = square_masks(args, config.patch_size)
    ours, theirs = build_pair(config, args)
    steps: dict[str, Callable[[], dict[str, float]]] = {}
    if "vlm-vit" in libraries:
        use_masks(ours, [mask.to(args.device) for mask in masks])
        steps["vlm-vit"] = ours_step(ours.to(args.device), views, args)
    if "lightly" in libraries:
        steps["lightly"] = lightly_step(theirs.to(args.device), views, masks, args)
    return steps


def check_first_step(first: dict[str, dict[str, float]]) -> float:
    """The largest relative difference of the first step's loss and terms; beyond
    `LOSS_TOLERANCE` the script stops (the two would not be the same step)."""
    ours, theirs = first["vlm-vit"], first["lightly"]
    difference = max(abs(ours[name] - theirs[name]) / max(abs(theirs[name]), 1e-12)
                     for name in ours)
    if difference > LOSS_TOLERANCE:
        raise RuntimeError(f"first-step losses differ by {difference:.2e} (relative) > "
                           f"{LOSS_TOLERANCE}: ours {ours}, lightly {theirs}")
    return difference


def child_arguments(args: argparse.Namespace) -> list[str]:
    arguments = ["--variant", args.variant, "--image-size", str(args.global_size),
                 "--depth", str(args.depth or 0), "--device", args.device,
                 "--dtype", args.dtype]
    for name in ("batch_size", "local_size", "local_crops", "prototypes", "head_hidden",
                 "head_bottleneck", "schedule_steps"):
        arguments += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.layer_scale:
        arguments += ["--layer-scale", str(args.layer_scale)]
    return arguments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "vit-s/16", image_size=224)
    parser.add_argument("--batch-size", type=int, default=8, help="images per step")
    parser.add_argument("--local-size", type=int, default=96)
    parser.add_argument("--local-crops", type=int, default=8)
    parser.add_argument("--prototypes", type=int, default=65536, help="the heads' K")
    parser.add_argument("--head-hidden", type=int, default=2048)
    parser.add_argument("--head-bottleneck", type=int, default=256)
    parser.add_argument("--layer-scale", type=float, default=None,
                        help="LayerScale's start value (lightly's example: 1e-5); off, so the "
                        "first-step check sees every block move the tokens")
    parser.add_argument("--schedule-steps", type=int, default=1000,
                        help="the run length the schedules assume")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1,
                        help="rounds before timing, besides the checked first step")
    parser.add_argument("--keep-denormals", action="store_true",
                        help="do not flush denormal floats to zero (see timing.flush_denormals)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--child", choices=LIBRARIES, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    args.depth = args.depth or None  # the children pass 0 for the variant's depth
    args.global_size = args.image_size
    flush_denormals(args.keep_denormals)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        step = steps_for((args.child,), args)[args.child]
        print(peak_memory_mib(lambda: (step(), step()), args.device))
        return

    steps = steps_for(LIBRARIES, args)
    first = {name: step() for name, step in steps.items()}  # the check, and a warm-up
    difference = check_first_step(first)
    medians = alternate(steps, args.repeats, args.warmup)
    memory = {} if args.no_memory else {
        name: peak_memory_in_child(__file__, ["--child", name, *child_arguments(args)])
        for name in LIBRARIES}
    config = config_from_args(args)
    local_text = f" + {args.local_crops} x {args.local_size}" if args.local_crops else ""
    result: dict[str, Any] = {
        "variant": args.variant, "depth": config.depth, "batch_size": args.batch_size,
        "settings_note": f"2 x {args.global_size}{local_text} crops, K {args.prototypes}",
        "device": args.device, "dtype": args.dtype,
        "cpu": cpu_name(), "threads": torch.get_num_threads(), "repeats": args.repeats,
        "global_size": args.global_size, "local_size": args.local_size,
        "local_crops": args.local_crops, "prototypes": args.prototypes,
        "head_hidden": args.head_hidden, "head_bottleneck": args.head_bottleneck,
        "layer_scale": args.layer_scale,
        "masked_patches": sum(int(m.sum()) for m in square_masks(args, config.patch_size)),
        "centering": "softmax with a zero initial centre (ours: centering='softmax'), as "
                     "lightly's DINOLoss and IBOTPatchLoss",
        "first_step_losses": first, "loss_relative_difference": difference,
        "loss_tolerance": LOSS_TOLERANCE,
        "step_seconds": medians,
        "time_ratio_vlm_vit_over_lightly": medians["vlm-vit"] / medians["lightly"],
        "speed_ratio_vlm_vit_over_lightly": medians["lightly"] / medians["vlm-vit"],
        "peak_memory_mib": memory,
    }
    if memory:
        result["memory_ratio_vlm_vit_over_lightly"] = memory["vlm-vit"] / memory["lightly"]

    print(f"ibot step, {args.variant} (depth {config.depth}), batch {args.batch_size} x "
          f"({result['settings_note']}), {args.device} {args.dtype}, {result['cpu']}, "
          f"{result['threads']} threads, median of {args.repeats}")
    print(f"  first step: loss {first['vlm-vit']['loss']:.6f} (ours) vs "
          f"{first['lightly']['loss']:.6f} (lightly), relative difference {difference:.1e}")
    for name in LIBRARIES:
        extra = f", peak memory {memory[name]:8.0f} MiB" if memory else ""
        print(f"  {name:<8} {medians[name]:7.3f} s/step{extra}")
    print(f"  speed ratio vlm-vit / lightly: {result['speed_ratio_vlm_vit_over_lightly']:.3f}"
          + (f", memory ratio {result['memory_ratio_vlm_vit_over_lightly']:.3f}"
             if memory else ""))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
