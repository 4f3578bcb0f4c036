"""`vlm-vit probe`: frozen-feature accuracy of an encoder on a class-labelled folder or on
labelled WebDataset tar shards."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vlm_vit.cli.common import reading_checkpoint
from vlm_vit.presets import POOLINGS


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "probe", help="few-shot, linear-probe and k-NN accuracy on a labelled folder or tar "
        "shards",
        description="Encode a folder with one sub-folder per class, or labelled WebDataset tar "
        "shards, split it into train and test (stratified, seeded) and report frozen-feature "
        "accuracy: few-shot regularised least squares (ViT paper section 4.1), a "
        "logistic-regression probe and weighted k-NN (DINO). A shard sample's label is its "
        "`cls` field (or --label-field of its json); class names come from the dataset.json "
        "beside the shards (`vlm-vit shards --classes` writes it), else 0..K-1. Shard samples "
        "without an image, or whose image or label cannot be read, are skipped and counted.")
    parser.add_argument("model", metavar="MODEL", help="any checkpoint load_encoder reads, or "
                        "a model name")
    parser.add_argument("--data", required=True, metavar="DIR_OR_SHARDS",
                        help="a folder with one sub-folder of images per class, or tar shards "
                        "(a brace pattern such as dir/{00000..00007}.tar, a glob, a folder of "
                        "tars or a URL)")
    parser.add_argument("--label-field", metavar="NAME",
                        help="with tar shards: the label is this field of each sample's json "
                        "(default: its cls field)")
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
    from vlm_vit.data.shards import expand_shards
    from vlm_vit.data.source import storage
    from vlm_vit.eval import evaluate_folder, evaluate_shards
    from vlm_vit.io.files import atomic_write
    from vlm_vit.io.loading import load_with_processor

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    shards = storage(args.data, check_folder=False) == "shards"
    if shards:  # the checks before the checkpoint is read
        expand_shards(args.data)
    elif args.label_field is not None:
        raise ValueError("--label-field is for tar shards; a folder's labels are its "
                         "sub-folders")
    elif not Path(args.data).is_dir():
        raise FileNotFoundError(f"--data {args.data} does not exist or is not a folder")
    with reading_checkpoint(args.model):
        encoder, processor = load_with_processor(args.model)
    options = dict(processor=processor, shots=args.shots, test_fraction=args.test_fraction,
                   seed=args.seed, pooling=args.pooling, batch_size=args.batch_size,
                   device=args.device, progress=not args.quiet)
    if shards:
        result = evaluate_shards(encoder, args.data, label_field=args.label_field, **options)
    else:
        result = evaluate_folder(encoder, Path(args.data), **options)
    result["encoder"] = str(args.model)
    print(f"{args.model} on {args.data}: {len(result['classes'])} classes, "
          f"{result['num_train']} train / {result['num_test']} test images, "
          f"{result['pooling']} pooling, width {result['feature_dim']}")
    if shards:
        skipped = result["skipped"]
        print(f"{result['shards']} shards; skipped {skipped['no_image']} samples without an "
              f"image, {skipped['undecodable']} undecodable; "
              f"{skipped['truncated_shards']} truncated shards")
    print(format_table(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
            handle.write("\n")
        print(f"wrote {args.json}")
    return 0
