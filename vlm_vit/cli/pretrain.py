"""`vlm-vit pretrain`: masked-patch self-supervised pretraining on a folder of images or
tar shards: the paper's mpp, mae, ibot (DINOv2's masked self-distillation on multi-crop
views), ijepa (I-JEPA's latent prediction of target blocks) or capi (CAPI's prediction of
online clusters); ibot, ijepa and capi at native resolution with --native."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlm_vit.commands import (
    add_model_argument,
    add_optimisation_arguments,
    add_strategy_arguments,
    optimisation_options,
    variant_or_checkpoint,
)
from vlm_vit.presets import NORMALIZATION

OBJECTIVES = ("mpp", "mae", "ibot", "ijepa", "capi")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "pretrain", help="self-supervised pretraining: the paper's mpp, mae, ibot (DINOv2), "
        "ijepa (I-JEPA) or capi (CAPI)",
        description="Pretrain an encoder on a folder of unlabelled images (searched "
        "recursively). Leaves RUN_DIR/encoder (native format) at the end; --resume continues "
        "from the last complete checkpoint in RUN_DIR. Runs data-parallel under torchrun.")
    add_model_argument(parser, help="a variant name (random init) or a checkpoint to start "
                       "from")
    parser.add_argument("--objective", choices=OBJECTIVES, required=True)
    parser.add_argument("--data", required=True, metavar="DIR_OR_SHARDS",
                        help="a folder of images, or WebDataset tar shards: "
                        "'shards/{00000..00127}.tar', a glob, a folder of .tar files, or a "
                        "URL webdataset opens (pipe:..., https://...)")
    parser.add_argument("--out", required=True, type=Path, metavar="RUN_DIR")
    parser.add_argument("--image-size", type=int, default=None, help="default: the model's")
    add_optimisation_arguments(
        parser, steps=1000, batch_size=64, lr=None,
        lr_help="peak learning rate (default: 1.5e-4 x batch / 256, as MAE)",
        warmup_help="default: steps / 20", weight_decay=None, checkpoint_every=500,
        weight_decay_help="default 0.05; ibot and ijepa: 0.04, its cosine rising to 0.4 "
        "(DINOv2, I-JEPA); capi: 0.1 (CAPI)")
    add_strategy_arguments(parser)
    parser.add_argument("--normalize", choices=sorted(NORMALIZATION), default="inception")
    parser.add_argument("--mask-ratio", type=float, nargs="+", default=None, metavar="RATIO",
                        help="mae: the masked fraction (default 0.75); capi: its inverse "
                        "block's (default 0.65); ibot: MIN MAX, each masked crop's range "
                        "(default 0.1 0.5, as DINOv2)")
    parser.add_argument("--decoder-width", type=int, default=None,
                        help="mae only (default: 512 for encoders 768 wide or more, as MAE; "
                        "else the encoder's width)")
    parser.add_argument("--decoder-depth", type=int, default=None,
                        help="mae only (default: 8 for encoders 768 wide or more, as MAE; "
                        "else 4)")
    parser.add_argument("--native", action="store_true",
                        help="ibot, ijepa and capi: each crop at its own aspect ratio within "
                        "the "
                        "tokens of a square crop, every view of a batch in one packed call")
    ibot = parser.add_argument_group("ibot (DINOv2: DINO + iBOT + KoLeo, an EMA teacher)")
    ibot.add_argument("--local-crops", type=int, default=8, help="per image (default 8); "
                      "there are always 2 global crops")
    ibot.add_argument("--local-size", type=int, default=None,
                      help="the local crops' side (default: 96/224 of the image size, a "
                      "multiple of the patch size)")
    ibot.add_argument("--prototypes", type=int, default=65536,
                      help="the head's output width (default 65536, as DINOv2)")
    ibot.add_argument("--head-hidden", type=int, default=2048)
    ibot.add_argument("--head-bottleneck", type=int, default=256)
    ibot.add_argument("--centering", choices=("sinkhorn_knopp", "softmax"),
                      default="sinkhorn_knopp")
    ibot.add_argument("--mask-probability", type=float, default=0.5,
                      help="the share of images whose global crops are masked (default 0.5)")
    ijepa = parser.add_argument_group("ijepa (I-JEPA: a predictor, an EMA target encoder)")
    ijepa.add_argument("--predictor-width", type=int, default=384,
                       help="the predictor's width (default 384, as I-JEPA)")
    ijepa.add_argument("--predictor-depth", type=int, default=None,
                       help="the predictor's blocks (default 6, as I-JEPA's code; capi: 12)")
    ijepa.add_argument("--min-keep", type=int, default=10,
                       help="a block holds more patches than this (default 10, as I-JEPA at "
                       "14 x 14 patches; lower it for small grids)")
    capi = parser.add_argument_group("capi (CAPI: online clusters, a cross-attention "
                                     "predictor, an EMA teacher)")
    capi.add_argument("--clusters", type=int, default=16384,
                      help="the online clusters (default 16384, as CAPI)")
    capi.add_argument("--predict-fraction", type=float, default=1.0,
                      help="the share of each image's masked patches scored (default 1, as "
                      "lightly; the official code 0.05)")
    parser.add_argument("--log-samples", action="store_true",
                        help="shards: write every trained sample's key to "
                        "RUN_DIR/samples/rank_R.tsv")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier run's files in the run directory")
    parser.set_defaults(run=run)


def describe_objective(name: str, objective) -> str:
    """One line: the objective's trained parameters, the encoder's (the student's, where an
    EMA teacher is exported) and the rest (decoder, heads, predictor)."""
    total = sum(p.numel() for p in objective.parameters() if p.requires_grad)
    trained = getattr(objective, "student", objective.encoder)
    encoder = sum(p.numel() for p in trained.parameters() if p.requires_grad)
    return (f"{name}: {total:,} parameters to train ({encoder:,} in the encoder, "
            f"{total - encoder:,} in the objective's own decoder and heads)")


def check_mask_ratio(args: argparse.Namespace) -> None:
    """`--mask-ratio`: one value for mae (default 0.75), MIN MAX for ibot (default 0.1 0.5),
    each in [0, 1); set to a tuple. Raises ValueError naming the flag."""
    ibot = args.objective == "ibot"
    given = args.mask_ratio
    if args.objective == "ijepa" and given:
        raise ValueError("--mask-ratio is for mae, ibot and capi; ijepa masks blocks of "
                         "I-JEPA's "
                         "scales (a context of 0.85-1, four targets of 0.15-0.2)")
    default = {"ibot": (0.1, 0.5), "capi": (0.65,)}.get(args.objective, (0.75,))
    args.mask_ratio = tuple(given) if given else default
    if len(args.mask_ratio) != (2 if ibot else 1):
        raise ValueError(f"--mask-ratio takes {'MIN MAX' if ibot else 'one value'} for "
                         f"{args.objective}, got {' '.join(map(str, given))}")
    if not all(0.0 <= ratio < 1.0 for ratio in args.mask_ratio) or (
            ibot and args.mask_ratio[0] > args.mask_ratio[1]):
        raise ValueError(f"--mask-ratio must lie in [0, 1){' with MIN <= MAX' if ibot else ''}"
                         f", got {' '.join(map(str, args.mask_ratio))}")


def ibot_parts(args: argparse.Namespace, encoder, mean, std):
    """The ibot objective, its multi-crop augmentation and the views' collate function."""
    from vlm_vit.data.multicrop import MultiCrop, collate_views
    from vlm_vit.pretrain.ibot import MaskedSelfDistillation

    patch, side = encoder.config.patch_size, encoder.config.image_size
    side = side if isinstance(side, int) else side[0]
    local = args.local_size or max(patch, round(side * 96 / 224 / patch) * patch)
    sizes = ({"global_tokens": (side // patch) ** 2, "local_tokens": (local // patch) ** 2}
             if args.native else {"global_size": side, "local_size": local})
    augmentation = MultiCrop(patch_size=patch, local_crops=args.local_crops, mean=mean,
                             std=std, **sizes)
    objective = MaskedSelfDistillation(
        encoder, prototypes=args.prototypes, head_hidden=args.head_hidden,
        head_bottleneck=args.head_bottleneck, centering=args.centering,
        mask_probability=args.mask_probability, mask_ratio=args.mask_ratio,
        packed=args.native, steps=args.steps)
    return objective, augmentation, collate_views


def ijepa_parts(args: argparse.Namespace, encoder, mean, std):
    """The ijepa objective, its crops (I-JEPA's: area 0.3-1, no flip) and their collate."""
    from vlm_vit.pretrain.ijepa import JointEmbeddingPredictive

    config = encoder.config
    objective = JointEmbeddingPredictive(encoder, predictor_width=args.predictor_width,
                                         predictor_depth=args.predictor_depth or 6,
                                         min_keep=args.min_keep, packed=args.native)
    return (objective, *single_crops(args, config, mean, std, scale=(0.3, 1.0), flip=False))


def capi_parts(args: argparse.Namespace, encoder, mean, std):
    """The capi objective, its crops (CAPI's: area 0.6-1, flipped) and their collate."""
    from vlm_vit.pretrain.capi import ClusterPredictiveMasking

    objective = ClusterPredictiveMasking(
        encoder, clusters=args.clusters, predictor_depth=args.predictor_depth or 12,
        mask_ratio=args.mask_ratio[0], predict_fraction=args.predict_fraction,
        packed=args.native)
    return (objective, *single_crops(args, encoder.config, mean, std, scale=(0.6, 1.0),
                                     flip=True))


def single_crops(args: argparse.Namespace, config, mean, std, *, scale, flip):
    """One crop per image and its collate: square (`Augmentation`, the default collate) or,
    with --native, at its own aspect ratio within a square crop's tokens (`NativeCrop`)."""
    from vlm_vit.data.folders import Augmentation
    from vlm_vit.data.native_crop import NativeCrop
    from vlm_vit.data.samples import collate_native

    if not args.native:
        return Augmentation(config.image_size, mean=mean, std=std, scale=scale,
                            flip=flip), None
    side = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
    tokens = (side // config.patch_size) ** 2
    return NativeCrop(patch_size=config.patch_size, tokens=tokens, scale=scale, flip=flip,
                      mean=mean, std=std), collate_native


def run(args: argparse.Namespace) -> int:
    import torch

    from vlm_vit.data.folders import Augmentation
    from vlm_vit.data.shards import ImageDecode
    from vlm_vit.data.source import open_source, storage
    from vlm_vit.pretrain.build import build_objective
    from vlm_vit.train import TrainConfig, Trainer
    from vlm_vit.train.distributed import launched_rank

    storage(args.data, "--data")  # refused before the model is built
    check_mask_ratio(args)
    if args.native and args.objective not in ("ibot", "ijepa", "capi"):
        raise ValueError(f"--native is for ibot, ijepa and capi; {args.objective} trains on "
                         "square crops")
    if args.weight_decay is None:
        args.weight_decay = {"ibot": 0.04, "ijepa": 0.04, "capi": 0.1}.get(args.objective,
                                                                             0.05)
    torch.manual_seed(args.seed)  # the same initial weights on every process
    encoder = variant_or_checkpoint(args.model, args.image_size)
    mean, std = NORMALIZATION[args.normalize]
    collate = None
    if args.objective == "ibot":
        objective, augmentation, collate = ibot_parts(args, encoder, mean, std)
    elif args.objective == "ijepa":
        objective, augmentation, collate = ijepa_parts(args, encoder, mean, std)
    elif args.objective == "capi":
        objective, augmentation, collate = capi_parts(args, encoder, mean, std)
    else:
        objective = build_objective(args.objective, encoder, mean=mean, std=std,
                                    mask_ratio=args.mask_ratio[0],
                                    decoder_width=args.decoder_width,
                                    decoder_depth=args.decoder_depth)
        augmentation = Augmentation(encoder.config.image_size, mean=mean, std=std)
    source = open_source(args.data, ImageDecode(augmentation, seed=args.seed), seed=args.seed)
    config = TrainConfig(
        **optimisation_options(args, lr=1.5e-4 * args.batch_size / 256,
                               warmup_steps=args.steps // 20),
        log_samples=args.log_samples, strategy=args.strategy, cpu_offload=args.cpu_offload)
    command = getattr(args, "command_line", None)
    if launched_rank() == 0:
        print(describe_objective(args.objective, objective))
    result = Trainer(objective, source, config, args.out, command=command, collate=collate,
                     progress=not args.quiet).fit(
        resume=args.resume, overwrite=args.overwrite)
    if launched_rank() != 0:  # under torchrun, rank 0 reports
        return 0
    print(f"trained {result.step} steps, final loss {result.losses[-1]:.4f}; encoder in "
          f"{args.out / 'encoder'}"
          + (f"; {len(result.undecodable_paths)} undecodable images skipped"
             if result.undecodable_paths else "")
          + (f"; {result.without_image} samples without an image skipped"
             if result.without_image else "")
          + (f"; {len(result.truncated_shards)} truncated shards"
             if result.truncated_shards else ""))
    return 0
