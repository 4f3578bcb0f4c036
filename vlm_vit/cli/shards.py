"""`vlm-vit shards FOLDER --out DIR`: an image folder as WebDataset tar shards."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "shards", help="write an image folder as WebDataset tar shards",
        description="Copy the images under FOLDER (searched recursively; bytes unchanged) into "
        "DIR/00000.tar, DIR/00001.tar, ... with a `json` per sample (its path, and its class, "
        "caption or LLaVA record) and DIR/dataset.json, which lists the shards and every "
        "image skipped: missing, not decodable, over the pixel bound, or (named by --captions "
        "or --llava) outside FOLDER.")
    parser.add_argument("folder", metavar="FOLDER", type=Path,
                        help="the images, or the folder the records' image paths are "
                        "relative to")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="the output folder, not FOLDER nor inside it (missing or empty, "
                        "unless --overwrite)")
    parser.add_argument("--per-shard", type=int, default=1000, metavar="N",
                        help="samples per shard (default 1000)")
    # Not an argparse mutually exclusive group: conflicts are a one-line error, exit 1.
    parser.add_argument("--classes", action="store_true",
                        help="FOLDER's sub-folders are the classes: write `cls` (the index)")
    parser.add_argument("--captions", type=Path, metavar="FILE",
                        help='a JSON Lines file of {"image": path in FOLDER, "caption": text}: '
                        "write `txt`")
    parser.add_argument("--llava", type=Path, metavar="FILE",
                        help="a LLaVA JSON file (an array, or one record per line); records "
                        "without an image are written as their json only")
    parser.add_argument("--seed", type=int, default=0, help="the shuffle's seed (default 0)")
    parser.add_argument("--no-shuffle", dest="shuffle", action="store_false",
                        help="keep the sorted order (or the file's) instead of shuffling")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the shards and dataset.json an earlier run left in DIR")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vlm_vit.data.shards.writer import write_shards

    index = write_shards(args.folder, args.out, per_shard=args.per_shard, classes=args.classes,
                         captions=args.captions, llava=args.llava, shuffle=args.shuffle,
                         seed=args.seed, overwrite=args.overwrite, progress=not args.quiet)
    print(f"wrote {index['samples']} samples in {len(index['shards'])} shards to {args.out} "
          f"({len(index['skipped'])} skipped)")
    return 0
