"""`vlm-vit pretrain`: masked-patch self-supervised pretraining on a folder of images or
tar shards."""

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

OBJECTIVES = ("mpp", "mae")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "pretrain", help="self-supervised pretraining: the paper's mpp, or mae",
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
        warmup_help="default: steps / 20", weight_decay=0.05, checkpoint_every=500)
    add_strategy_arguments(parser)
    parser.add_argument("--normalize", choices=sorted(NORMALIZATION), default="inception")
    parser.add_argument("--mask-ratio", type=float, default=0.75, help="mae only")
    parser.add_argument("--decoder-width", type=int, default=None,
                        help="mae only (default: 512 for encoders 768 wide or more, as MAE; "
                        "else the encoder's width)")
    parser.add_argument("--decoder-depth", type=int, default=None,
                        help="mae only (default: 8 for encoders 768 wide or more, as MAE; "
                        "else 4)")
    parser.add_argument("--log-samples", action="store_true",
                        help="shards: write every trained sample's key to "
                        "RUN_DIR/samples/rank_R.tsv")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier run's files in the run directory")
    parser.set_defaults(run=run)


def describe_objective(name: str, objective) -> str:
    """One line: the objective's parameters, the encoder's and the rest (decoder, heads)."""
    total = sum(p.numel() for p in objective.parameters())
    encoder = sum(p.numel() for p in objective.encoder.parameters())
    return (f"{name}: {total:,} parameters to train ({encoder:,} in the encoder, "
            f"{total - encoder:,} in the objective's own decoder and heads)")


def run(args: argparse.Namespace) -> int:
    import torch

    from vlm_vit.data.folders import Augmentation
    from vlm_vit.data.shards import ImageDecode
    from vlm_vit.data.source import open_source, storage
    from vlm_vit.pretrain.build import build_objective
    from vlm_vit.train import TrainConfig, Trainer
    from vlm_vit.train.distributed import launched_rank

    storage(args.data, "--data")  # refused before the model is built
    torch.manual_seed(args.seed)  # the same initial weights on every process
    encoder = variant_or_checkpoint(args.model, args.image_size)
    mean, std = NORMALIZATION[args.normalize]
    objective = build_objective(args.objective, encoder, mean=mean, std=std,
                                mask_ratio=args.mask_ratio, decoder_width=args.decoder_width,
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
    result = Trainer(objective, source, config, args.out, command=command,
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
