"""`vlm-vit predict`: a fine-tuned classifier directory (RUN_DIR/classifier of `vlm-vit
finetune`, `vlm-vit merge`'s output or `ImageClassifier.save_pretrained`) on images or folders,
one line per image."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "predict", help="classify images with a fine-tuned classifier directory",
        description=" ".join(__doc__.split()))
    parser.add_argument("classifier", type=Path, metavar="CLASSIFIER_DIR")
    parser.add_argument("inputs", nargs="+", metavar="IMAGE_OR_DIR")
    parser.add_argument("--top", type=int, default=1, metavar="K",
                        help="the K most likely classes per image (default 1)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from vlm_vit.adapt.finetune import CLASSIFIER_CONFIG_NAME, ImageClassifier
    from vlm_vit.cli.common import reading_checkpoint
    from vlm_vit.cli.encode import find_images
    from vlm_vit.cli.finetune import run_dir_hint
    from vlm_vit.processor import ImageProcessor

    if not (args.classifier / CLASSIFIER_CONFIG_NAME).is_file():
        hint = run_dir_hint(args.classifier)
        if hint is not None:
            raise FileNotFoundError(f"{args.classifier / CLASSIFIER_CONFIG_NAME} does not "
                                    f"exist: {hint}")
    files = find_images(args.inputs)
    with reading_checkpoint(args.classifier):
        classifier = ImageClassifier.from_pretrained(args.classifier).to(args.device)
    names = classifier.classes or [str(k) for k in range(classifier.head.out_features)]
    if not 1 <= args.top <= len(names):
        raise ValueError(f"--top must lie in [1, {len(names)}], got {args.top}")
    processor = ImageProcessor.from_pretrained(args.classifier)
    with torch.inference_mode():
        for start in range(0, len(files), args.batch_size):
            chunk = files[start:start + args.batch_size]
            probabilities = classifier(processor(chunk).to(args.device)).softmax(-1)
            values, indices = probabilities.topk(args.top, dim=-1)
            for path, row_values, row_indices in zip(chunk, values, indices, strict=True):
                best = "  ".join(f"{names[i]} {v:.3f}" for v, i in
                                 zip(row_values.tolist(), row_indices.tolist(), strict=True))
                print(f"{path}\t{best}")
    return 0
