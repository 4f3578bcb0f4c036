"""`vlm-vit probe`: frozen-feature accuracy of an encoder on a class-labelled folder."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vlm_vit.evaluate import POOLINGS, evaluate_folder
from vlm_vit.files import atomic_write
from vlm_vit.loading import load_with_processor


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "probe", help="few-shot, linear-probe and k-NN accuracy on a labelled folder",
        description="Encode a folder with one sub-folder per class, split it into train and "
        "test (stratified, seeded) and report frozen-feature accuracy: few-shot regularised "
        "least squares (ViT paper section 4.1), a logistic-regression probe and weighted "
        "k-NN (DINO).")
    parser.add_argument("encoder", metavar="ENCODER", help="any checkpoint load_encoder reads")
    parser.add_argument("--data", required=True, type=Path, metavar="DIR",
                        help="a folder with one sub-folder of images per class")
    parser.add_argument("--pooling", choices=POOLINGS,
                        help="image representation (default: cls when the model has a class "
                        "token, else mean)")
    parser.add_argument("--shots", type=int, nargs="+", default=[1, 5, 10], metavar="K",
                        help="training images per class for few-shot accuracy")
    parser.add_argument("--test-fraction", type=float, default=0.5,
                        help="each class's share held out for testing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the results here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def format_table(result: dict) -> str:
    """The results as a small text table, accuracies in percent."""
    rows = [(f"few-shot {shots}", accuracy) for shots, accuracy in result["few_shot"].items()]
    rows += [("linear probe", result["linear_probe"]),
             (f"k-NN (k={result['knn_k']})", result["knn"])]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'metric':<{width}}  accuracy"]
    lines += [f"{name:<{width}}  {100 * accuracy:7.1f}%" for name, accuracy in rows]
    lines.append(f"{'chance':<{width}}  {100 * result['chance']:7.1f}%")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    if not args.data.is_dir():  # before the checkpoint is read
        raise FileNotFoundError(f"--data {args.data} does not exist or is not a folder")
    encoder, processor = load_with_processor(args.encoder)
    result = evaluate_folder(
        encoder, args.data, processor=processor, shots=args.shots,
        test_fraction=args.test_fraction, seed=args.seed, pooling=args.pooling,
        batch_size=args.batch_size, device=args.device, progress=not args.quiet)
    result["encoder"] = str(args.encoder)
    print(f"{args.encoder} on {args.data}: {len(result['classes'])} classes, "
          f"{result['num_train']} train / {result['num_test']} test images, "
          f"{result['pooling']} pooling, width {result['feature_dim']}")
    print(format_table(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
            handle.write("\n")
        print(f"wrote {args.json}")
    return 0
