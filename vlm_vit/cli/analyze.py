"""`vlm-vit analyze`: the ViT paper's section 4.5 figures of an encoder, and their numbers."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlm_vit.cli.common import reading_checkpoint


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "analyze", help="attention distance, rollout, position and filter figures",
        description="Inspect an encoder as the ViT paper's section 4.5 does and write PNG "
        "figures with analysis.json (the numbers behind them) into --out: mean attention "
        "distance per head and layer, attention rollout over each image, position-embedding "
        "similarity and the principal components of the patch embedding.")
    parser.add_argument("model", metavar="MODEL", help="any checkpoint load_encoder reads, or "
                        "a model name")
    parser.add_argument("--images", required=True, nargs="+", metavar="IMAGE_OR_DIR",
                        help="image files or folders (searched recursively)")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="folder for the figures and analysis.json")
    parser.add_argument("--filters", type=int, default=28, metavar="K",
                        help="principal components of the patch embedding to draw")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vlm_vit import analysis
    from vlm_vit.analysis.report import JSON_NAME
    from vlm_vit.cli.encode import find_images
    from vlm_vit.io.loading import load_with_processor

    if args.filters < 1:
        raise ValueError(f"--filters must be at least 1, got {args.filters}")
    files = find_images(args.images)  # a missing path fails before the checkpoint is read
    with reading_checkpoint(args.model):
        encoder, processor = load_with_processor(args.model)
    encoder = encoder.to(args.device).eval()
    result = analysis.analyze(encoder, files, args.out, processor=processor,
                              filter_count=args.filters, progress=not args.quiet)
    print(f"analysed {len(result['images'])} images with {args.model}: "
          f"{len(result['figures'])} figures and {JSON_NAME} in {args.out}")
    return 0
