"""One CAPI training step (`--objective capi`) against lightly's CAPI, on the same images,
weights and masks.

    python benchmarks/capi_step_vs_lightly.py            # vit-s/16, batch 8, 224 x 224
    python benchmarks/capi_step_vs_lightly.py --batch-size 4 --repeats 3

A step is what a run of each does per batch: the teacher on the whole images, the clustering
head and the position-wise Sinkhorn-Knopp; the student on the visible patches, the predictor
and the student head; both cross-entropies; backward; an AdamW update; the EMA update of the
teacher's encoder.

- vlm-vit: `ClusterPredictiveMasking(packed=True)` (every image in one packed call per
  network, the predictor's attention per image).
- lightly: the step of lightly's CAPI example (`examples/pytorch/capi.py`) on timm's
  `VisionTransformer` in `MaskedVisionTransformerTIMM`: `CAPIProjectionHead` (the clustering
  head, with bias; the student head, weight-normalised), `CAPIPredictorTIMM`, `CAPILoss` for
  both terms and `update_momentum`.

Same weights: the timm ViT is built and loaded into our `VisionEncoder` through our timm
converter; the heads' and the predictor's weights are ours, carried to lightly's names
(`capi_predictor.lightly_state_dict`). Same masks: one fixed draw of CAPI's inverse block
masks on every step. Same images: scikit-image's photos. The first step of each is checked
before timing (also the warm-up): the losses must agree within
`lightly_steps.LOSS_TOLERANCE` (relative).
The candidates then alternate (`timing.alternate`); figures are ratios of medians. Peak
memory is measured per library in a fresh process (`--child`), after its model is built.
"""

from __future__ import annotations

import argparse
import copy
import os
import warnings
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
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
from vlm_vit.pretrain.capi import ClusterPredictiveMasking  # noqa: E402
from vlm_vit.pretrain.capi_predictor import lightly_state_dict  # noqa: E402
from vlm_vit.pretrain.inverse_block_masking import (  # noqa: E402
    InverseBlockMask,
    batch_inverse_block_masks,
)

LEARNING_RATE, MOMENTUM = 1e-3, 0.996


class LightlyCAPI(torch.nn.Module):
    """The model of lightly's CAPI example, on a timm ViT."""

    def __init__(self, backbone, predictor, student_head, teacher_head) -> None:
        super().__init__()
        self.student = backbone
        self.teacher = copy.deepcopy(backbone).requires_grad_(False).eval()
        self.predictor, self.student_head = predictor, student_head
        self.teacher_head = teacher_head


def build_pair(config: EncoderConfig, args: argparse.Namespace
               ) -> tuple[ClusterPredictiveMasking, LightlyCAPI]:
    from lightly.models.modules import (
        CAPIPredictorTIMM,
        CAPIProjectionHead,
    )

    backbone, encoder = timm_and_ours(config)
    ours = ClusterPredictiveMasking(encoder, clusters=args.clusters,
                                    predictor_depth=args.predictor_depth,
                                    predictor_heads=args.predictor_heads, packed=True)
    grid = side_of(config) // config.patch_size
    predictor = CAPIPredictorTIMM(config.width, grid, depth=args.predictor_depth,
                                  num_heads=args.predictor_heads)
    predictor.load_state_dict(lightly_state_dict(ours.predictor))
    with warnings.catch_warnings():  # lightly's student head uses the old weight_norm
        warnings.simplefilter("ignore", FutureWarning)
        student_head = CAPIProjectionHead(config.width, args.clusters, weight_norm=True)
    student_head.layer.weight_v.data.copy_(ours.prototypes.detach())
    teacher_head = CAPIProjectionHead(config.width, args.clusters, bias=True)
    teacher_head.load_state_dict({"layer.weight": ours.clustering.weight.detach(),
                                  "layer.bias": ours.clustering.bias.detach()})
    return ours, LightlyCAPI(backbone, predictor, student_head, teacher_head)


def lightly_step(model: LightlyCAPI, images: torch.Tensor, masks: list[InverseBlockMask],
                 args: argparse.Namespace) -> Callable[[], float]:
    """The training step of lightly's CAPI example, on fixed masks (timm's class token kept
    in the student's input, as index 0, and dropped from every output)."""
    from lightly.loss import CAPILoss
    from lightly.models.utils import update_momentum
    from lightly.utils.scheduler import cosine_schedule

    model.student.train()
    criterion = CAPILoss()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=LEARNING_RATE)
    device = images.device
    visible = torch.stack([m.visible for m in masks]).to(device)
    masked = torch.stack([m.masked for m in masks]).to(device)
    keep = torch.cat([visible.new_zeros(len(masks), 1), visible + 1], dim=1)
    dtype, done = getattr(torch, args.dtype), [0]

    def step() -> float:
        with autocast(args.device, dtype):
            with torch.no_grad():
                features = model.teacher.encode(images)[:, 1:]
            teacher_logits = model.teacher_head(features)
            context = model.student.encode(images, idx_keep=keep)[:, 1:]
            predicted = model.predictor(context, visible, masked)
            student_logits = model.student_head(predicted)
            loss = criterion(teacher_logits, student_logits, teacher_index=masked) \
                + criterion(teacher_logits, teacher_logits)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        momentum = cosine_schedule(done[0], args.schedule_steps, MOMENTUM, 1.0)
        update_momentum(model.student, model.teacher, m=momentum)
        done[0] += 1
        return float(loss.detach())

    return synchronized(step, args.device)


def steps_for(libraries: tuple[str, ...], args: argparse.Namespace
              ) -> dict[str, Callable[[], float]]:
    config = config_from_args(args)
    images = photos(args.batch_size, side_of(config)).to(args.device)
    grid = side_of(config) // config.patch_size
    masks = batch_inverse_block_masks([(grid, grid)] * args.batch_size,
                                      torch.Generator().manual_seed(0))
    ours, theirs = build_pair(config, args)
    steps: dict[str, Callable[[], float]] = {}
    if "vlm-vit" in libraries:
        steps["vlm-vit"] = ours_step(ours.to(args.device), images, masks, args,
                                     lr=LEARNING_RATE)
    if "lightly" in libraries:
        steps["lightly"] = lightly_step(theirs.to(args.device), images, masks, args)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "vit-s/16", image_size=224)
    parser.add_argument("--clusters", type=int, default=16384)
    parser.add_argument("--predictor-depth", type=int, default=2,
                        help="lightly's example: 2")
    parser.add_argument("--predictor-heads", type=int, default=6)
    add_comparison_arguments(parser)
    args = parser.parse_args()
    compare(args, __file__, "capi step",
            f"{args.image_size} x {args.image_size}, K {args.clusters}, predictor depth "
            f"{args.predictor_depth}",
            steps_for, model_arguments(args, ("clusters", "predictor_depth",
                                              "predictor_heads")))


if __name__ == "__main__":
    main()
