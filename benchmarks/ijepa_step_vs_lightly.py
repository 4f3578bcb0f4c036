"""One I-JEPA training step (`--objective ijepa`) against lightly's I-JEPA, on the same
images, weights and masks.

    python benchmarks/ijepa_step_vs_lightly.py           # vit-b/16, batch 8, 224 x 224
    python benchmarks/ijepa_step_vs_lightly.py --variant vit-s/16 --batch-size 4 --repeats 3

A step is what a run of each does per batch: the target encoder on the whole images, its
features layer-normalised and gathered at the four target blocks; the context encoder on the
context patches; the predictor; smooth L1; backward; an AdamW update; the EMA update of the
target encoder.

- vlm-vit: `JointEmbeddingPredictive(packed=False)` (the stacked, official layout).
- lightly: the step of lightly's I-JEPA example (`examples/pytorch/ijepa.py`) on timm's
  `VisionTransformer` in `MaskedVisionTransformerTIMM` (lightly's own `IJEPABackbone` is a
  torchvision ViT whose class token shifts every patch index by one, so it cannot take the
  same masks): `encode(images, idx_keep=...)` for the context, `IJEPAPredictorTIMM`,
  `apply_masks`, `repeat_interleave_batch`, `SmoothL1Loss` and `update_momentum`.

Same weights: the timm ViT is built, its state dict loaded into our `VisionEncoder` through
our timm converter; lightly's predictor gets our predictor's weights. Same masks: one fixed
draw of I-JEPA's multi-block masks (the official collator's, cut to common lengths) on every
step. Same images: scikit-image's photos, resized. The first step of each is checked before
timing (also the warm-up): the losses must agree within `lightly_steps.LOSS_TOLERANCE`
(relative). The
candidates then alternate (`timing.alternate`); figures are ratios of medians. Peak memory is
measured per library in a fresh process (`--child`), after its model is built.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightly_steps import (  # noqa: E402
    add_comparison_arguments,
    compare,
    model_arguments,
    ours_step,
    photos,
    side_of,
    timm_and_ours,
)
from timing import (  # noqa: E402
    add_model_arguments,
    autocast,
    config_from_args,
    synchronized,
)

from vlm_vit import EncoderConfig  # noqa: E402
from vlm_vit.pretrain.ijepa import JointEmbeddingPredictive  # noqa: E402
from vlm_vit.pretrain.jepa_predictor import lightly_state_dict  # noqa: E402
from vlm_vit.pretrain.multiblock_masking import (  # noqa: E402
    BlockMasks,
    batch_masks,
    common_length,
)

WEIGHT_DECAY, LEARNING_RATE, MOMENTUM = 0.04, 1e-3, 0.996


def fixed_masks(grid: tuple[int, int], images: int) -> list[BlockMasks]:
    return common_length(batch_masks([grid] * images, torch.Generator().manual_seed(0)))


class LightlyIJEPA(torch.nn.Module):
    """The model of lightly's I-JEPA example, on a timm ViT: context and target encoders (the
    target frozen) and the predictor."""

    def __init__(self, backbone: torch.nn.Module, predictor: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = backbone
        self.target_encoder = copy.deepcopy(backbone).requires_grad_(False).eval()
        self.predictor = predictor


def build_pair(config: EncoderConfig, args: argparse.Namespace
               ) -> tuple[JointEmbeddingPredictive, LightlyIJEPA]:
    from lightly.models.modules import IJEPAPredictorTIMM

    backbone, encoder = timm_and_ours(config)
    ours = JointEmbeddingPredictive(encoder, predictor_width=args.predictor_width,
                                    predictor_depth=args.predictor_depth, packed=False)
    grid = side_of(config) // config.patch_size
    predictor = IJEPAPredictorTIMM(num_patches=grid * grid, depth=args.predictor_depth,
                                   mlp_dim=config.width,
                                   predictor_embed_dim=args.predictor_width,
                                   num_heads=config.heads)
    state = lightly_state_dict(ours.predictor)
    state["decoder.pos_embed"] = predictor.state_dict()["decoder.pos_embed"]
    predictor.load_state_dict(state)
    return ours, LightlyIJEPA(backbone, predictor)


def lightly_step(model: LightlyIJEPA, images: torch.Tensor, masks: list[BlockMasks],
                 args: argparse.Namespace) -> Callable[[], float]:
    """The training step of lightly's I-JEPA example, on fixed masks (the class token of
    timm's ViT kept in the context, as index 0, and dropped from every output)."""
    from lightly.models.utils import apply_masks, repeat_interleave_batch, update_momentum

    model.encoder.train()
    criterion = torch.nn.SmoothL1Loss()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    device = images.device
    context = torch.stack([m.context for m in masks]).to(device)
    targets = [torch.stack([m.targets[j] for m in masks]).to(device)
               for j in range(len(masks[0].targets))]
    keep = torch.cat([context.new_zeros(len(masks), 1), context + 1], dim=1)
    dtype, done, batch = getattr(torch, args.dtype), [0], len(images)

    def step() -> float:
        with autocast(args.device, dtype):
            with torch.no_grad():
                h = model.target_encoder.encode(images)[:, 1:]
                h = F.layer_norm(h, (h.size(-1),))
                h = repeat_interleave_batch(apply_masks(h, targets), batch, repeat=1)
            z = model.encoder.encode(images, idx_keep=keep)[:, 1:]
            z = model.predictor(z, [context], targets)
            loss = criterion(z.float(), h.float())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        momentum = MOMENTUM + (1.0 - MOMENTUM) * done[0] / args.schedule_steps
        update_momentum(model.encoder, model.target_encoder, m=momentum)
        done[0] += 1
        return float(loss.detach())

    return synchronized(step, args.device)


def steps_for(libraries: tuple[str, ...], args: argparse.Namespace
              ) -> dict[str, Callable[[], float]]:
    config = config_from_args(args)
    images = photos(args.batch_size, side_of(config)).to(args.device)
    grid = side_of(config) // config.patch_size
    masks = fixed_masks((grid, grid), args.batch_size)
    ours, theirs = build_pair(config, args)
    steps: dict[str, Callable[[], float]] = {}
    if "vlm-vit" in libraries:
        steps["vlm-vit"] = ours_step(ours.to(args.device), images, masks, args,
                                     lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    if "lightly" in libraries:
        steps["lightly"] = lightly_step(theirs.to(args.device), images, masks, args)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "vit-b/16", image_size=224)
    parser.add_argument("--predictor-width", type=int, default=384)
    parser.add_argument("--predictor-depth", type=int, default=6)
    add_comparison_arguments(parser)
    args = parser.parse_args()
    compare(args, __file__, "ijepa step",
            f"{args.image_size} x {args.image_size}, predictor {args.predictor_width} x "
            f"{args.predictor_depth}",
            steps_for, model_arguments(args, ("predictor_width", "predictor_depth")))


if __name__ == "__main__":
    main()
