"""The demo's pretraining: each objective sized to 32 x 32 digits, trained on the unlabelled
training half."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from vlm_vit.config import EncoderConfig
from vlm_vit.processor import NORMALIZATION, ImageProcessor

if TYPE_CHECKING:
    from vlm_vit.recipes.demo import DemoData

logger = logging.getLogger(__name__)

MAE_SETTINGS = {"mask_ratio": 0.75, "decoder_width": 64, "decoder_depth": 2}  # sized to the demo
OBJECTIVE_NAMES = {"mpp": "masked patch prediction", "mae": "MAE reconstruction",
                   "ibot": "masked self-distillation (DINOv2)",
                   "ijepa": "latent block prediction (I-JEPA)",
                   "capi": "cluster prediction (CAPI)"}
# ibot at the demo's size: a head as wide as the encoder's MLP, 1024 prototypes, and
# DINOv2's crops scaled to 32-pixel digits (global 32, local 16: 96/224 of 32, rounded to
# the patch).
IBOT_SETTINGS = {"prototypes": 1024, "head_bottleneck": 64, "local_crops": 2, "local_size": 16}
# I-JEPA and CAPI at the demo's size (4 x 4 patches: I-JEPA's blocks hold 1 to 3 patches, so
# no minimum), with their papers' crops; lr 1e-3, measured on validation (notes/issue43_demo.md).
# Their EMA teachers lag the student over a run this short (CAPI after 1500 steps: k-NN 0.598
# for the teacher, 0.698 for the student), so the demo scores the student.
SINGLE_VIEW = {
    "ijepa": {"objective": {"predictor_width": 96, "predictor_depth": 2, "min_keep": 0},
              "crop": {"scale": (0.3, 1.0), "flip": False}, "lr": 1e-3},
    "capi": {"objective": {"clusters": 256, "predictor_depth": 2},
             "crop": {"scale": (0.6, 1.0), "flip": True}, "lr": 1e-3},
}


def _pretrain(args: argparse.Namespace, data: DemoData, steps: int, command: str):
    """Pretrains a fresh encoder on the unlabelled training half and saves it with its
    processor under `args.out/encoder`.

    Returns:
        (the pretrained encoder, a copy of its random initialisation, that copy's
        fingerprint, the trainer's result, the processor).
    """
    import torch

    from vlm_vit.model import VisionEncoder
    from vlm_vit.recipes.label_efficiency import fingerprint
    from vlm_vit.train import TrainConfig, Trainer

    out = args.out
    mean, std = NORMALIZATION["inception"]
    config = EncoderConfig(image_size=32, patch_size=args.patch_size, width=args.width,
                           depth=args.depth, heads=4, mlp_width=4 * args.width)
    processor = ImageProcessor(size=32, mean=mean, std=std)
    torch.manual_seed(args.seed)
    random_init = VisionEncoder(config)
    encoder = VisionEncoder(config)
    encoder.load_state_dict(random_init.state_dict())  # the same starting point
    start_fingerprint = fingerprint(encoder)
    print(f"{len(data.files)} digits in {len(data.classes)} classes: {len(data.train)} to "
          f"pretrain on (labels from {len(data.pool)} of them, {len(data.validation)} for "
          f"validation), {len(data.test)} held out; scoring on the {args.eval_on} images")

    objective, dataset, collate = _objective_and_data(args, encoder, steps, mean, std)
    lr = SINGLE_VIEW.get(args.objective, {}).get("lr", 2e-3)
    train_config = TrainConfig(steps=steps, batch_size=args.batch_size, lr=lr,
                               warmup_steps=max(1, steps // 10),
                               # DINOv2's start of its weight-decay cosine for ibot
                               weight_decay=0.04 if args.objective == "ibot" else 0.05,
                               checkpoint_every=0, seed=args.seed,
                               # ibot's six crops per image cost more than its step on one
                               # thread: one worker process makes them beside the training
                               num_workers=1 if args.objective == "ibot" else 0,
                               log_every=max(1, steps // 10), device="cpu")
    if args.quiet:
        logging.getLogger("vlm_vit.train").setLevel(logging.WARNING)
    print(f"pretraining with {OBJECTIVE_NAMES[args.objective]} for {steps} steps")
    # A resume continues from the newest checkpoint (a stopped run saved one); an earlier
    # run is otherwise refused or removed by `demo_state.open_run`.
    result = Trainer(objective, dataset, train_config, out / "run", command=command,
                     collate=collate, progress=not args.quiet).fit(resume=args.resume)
    scored = objective.student if args.objective in SINGLE_VIEW else objective.encoder
    encoder = scored.eval()
    encoder.save_pretrained(out / "encoder")
    processor.save_pretrained(out / "encoder")
    return encoder, random_init, start_fingerprint, result, processor


def _objective_and_data(args: argparse.Namespace, encoder, steps: int, mean, std):
    """The pretraining objective around `encoder`, its dataset of the unlabelled training half
    (`args.out / "pretrain_images"`) and its collate function (None: the default)."""
    from vlm_vit.data.folders import ImageFolder
    from vlm_vit.pretrain.build import build_objective

    collate = None
    out = args.out
    if args.objective == "ibot":
        from vlm_vit.data.multicrop import MultiCrop, collate_views
        from vlm_vit.pretrain.ibot import MaskedSelfDistillation

        settings = IBOT_SETTINGS
        objective = MaskedSelfDistillation(
            encoder, prototypes=settings["prototypes"], head_hidden=4 * args.width,
            head_bottleneck=settings["head_bottleneck"], steps=steps)
        crops = MultiCrop(patch_size=args.patch_size, global_size=32,
                          local_size=settings["local_size"], local_crops=settings["local_crops"],
                          mean=mean, std=std)
        dataset = ImageFolder(out / "pretrain_images", augmentation=crops, seed=args.seed)
        collate = collate_views
    elif args.objective in SINGLE_VIEW:
        from vlm_vit.pretrain.capi import ClusterPredictiveMasking
        from vlm_vit.pretrain.ijepa import JointEmbeddingPredictive

        settings = SINGLE_VIEW[args.objective]
        build = JointEmbeddingPredictive if args.objective == "ijepa" \
            else ClusterPredictiveMasking
        objective = build(encoder, **settings["objective"])
        dataset = ImageFolder(out / "pretrain_images", 32, mean=mean, std=std,
                              seed=args.seed, **settings["crop"])
    else:
        objective = build_objective(args.objective, encoder, mean=mean, std=std,
                                    **MAE_SETTINGS if args.objective == "mae" else {})
        dataset = ImageFolder(out / "pretrain_images", 32, mean=mean, std=std,
                              scale=(0.6, 1.0), flip=False, seed=args.seed)
    return objective, dataset, collate


