"""The demo's pretraining: each objective sized to 32 x 32 digits, trained on the unlabelled
training half."""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from vlm_vit.config import EncoderConfig
from vlm_vit.processor import ImageProcessor

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


def random_init(args: argparse.Namespace):
    """The demo's encoder at random initialisation (seed `args.seed`): where every arm
    starts."""
    import torch

    from vlm_vit.model import VisionEncoder

    config = EncoderConfig(image_size=32, patch_size=args.patch_size, width=args.width,
                           depth=args.depth, heads=4, mlp_width=4 * args.width)
    torch.manual_seed(args.seed)
    return VisionEncoder(config).eval()


def pretrain(args: argparse.Namespace, arm: str, start, steps: int, command: str,
             processor: ImageProcessor) -> tuple:
    """Pretrains a copy of `start` with the objective `arm` on the unlabelled training half
    (`args.out/pretrain_images`), its run in `args.out/runs/ARM`, and saves the result with
    its processor under `args.out/encoders/ARM`.

    Returns:
        (the pretrained encoder, the report's record of the pretraining, its losses).
    """
    import copy

    from vlm_vit.train import TrainConfig, Trainer

    out = args.out
    started = time.perf_counter()
    import torch

    encoder = copy.deepcopy(start).train()  # the same starting point for every arm
    # and the same RNG for its objective's own layers, whichever arms ran before
    torch.manual_seed(args.seed)
    objective, dataset, collate = _objective_and_data(args, arm, encoder, steps,
                                                      processor.mean, processor.std)
    lr = SINGLE_VIEW.get(arm, {}).get("lr", 2e-3)
    train_config = TrainConfig(steps=steps, batch_size=args.batch_size, lr=lr,
                               warmup_steps=max(1, steps // 10),
                               # DINOv2's start of its weight-decay cosine for ibot
                               weight_decay=0.04 if arm == "ibot" else 0.05,
                               checkpoint_every=0, seed=args.seed,
                               # ibot's six crops per image cost more than its step on one
                               # thread: one worker process makes them beside the training
                               num_workers=1 if arm == "ibot" else 0,
                               log_every=max(1, steps // 10), device="cpu")
    if args.quiet:
        logging.getLogger("vlm_vit.train").setLevel(logging.WARNING)
    print(f"{arm}: pretraining with {OBJECTIVE_NAMES[arm]} for {steps} steps")
    # A resume continues from the arm's newest checkpoint (a stopped run saved one); an
    # earlier run is otherwise refused or removed by `demo_state.open_run`.
    run_dir = out / "runs" / arm
    result = Trainer(objective, dataset, train_config, run_dir, command=command,
                     collate=collate, progress=not args.quiet).fit(
                         resume=args.resume and run_dir.is_dir())
    encoder = (objective.student if arm in SINGLE_VIEW else objective.encoder).eval()
    encoder.save_pretrained(out / "encoders" / arm)
    processor.save_pretrained(out / "encoders" / arm)
    record = {"objective": arm, "steps": result.step, "lr": lr,
              "first_loss": result.losses[0], "last_loss": result.losses[-1],
              "final_loss_mean_of_last_10": float(np.mean(result.losses[-10:])),
              "seconds": round(time.perf_counter() - started, 1)}
    return encoder, record, result.losses


def _objective_and_data(args: argparse.Namespace, arm: str, encoder, steps: int, mean, std):
    """The pretraining objective around `encoder`, its dataset of the unlabelled training half
    (`args.out / "pretrain_images"`) and its collate function (None: the default)."""
    from vlm_vit.data.folders import ImageFolder
    from vlm_vit.pretrain.build import build_objective

    collate = None
    out = args.out
    if arm == "ibot":
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
    elif arm in SINGLE_VIEW:
        from vlm_vit.pretrain.capi import ClusterPredictiveMasking
        from vlm_vit.pretrain.ijepa import JointEmbeddingPredictive

        settings = SINGLE_VIEW[arm]
        build = JointEmbeddingPredictive if arm == "ijepa" \
            else ClusterPredictiveMasking
        objective = build(encoder, **settings["objective"])
        dataset = ImageFolder(out / "pretrain_images", 32, mean=mean, std=std,
                              seed=args.seed, **settings["crop"])
    else:
        objective = build_objective(arm, encoder, mean=mean, std=std,
                                    **MAE_SETTINGS if arm == "mae" else {})
        dataset = ImageFolder(out / "pretrain_images", 32, mean=mean, std=std,
                              scale=(0.6, 1.0), flip=False, seed=args.seed)
    return objective, dataset, collate


