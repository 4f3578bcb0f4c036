"""`vlm-vit consolidate RUN_DIR --out DIR [--step N] [--module student]`: a training run's
checkpoint as a native encoder directory, read one transformer block at a time
(`vlm_vit.train.consolidate`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "consolidate", help="write a training run's checkpoint as an encoder directory",
        description="Write the encoder of a training run's checkpoint (the newest whose files "
        "match their sha256, or --step's) as a native encoder directory, which every command "
        "and vlm_vit.load_encoder read. A distributed checkpoint (--strategy fsdp, any number "
        "of ranks) is read one transformer block at a time, so this needs the memory of one "
        "block, not of the model; the weights are written as save_pretrained writes them "
        "(one file under --max-shard-size). A 'ddp' checkpoint (one step_N.pt) is read "
        "whole. The directory appears at once; its config.json records the checkpoint it "
        "came from.")
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                        help="a training run directory (pretrain, finetune --out), or one "
                        "checkpoint in its checkpoints/")
    parser.add_argument("--out", required=True, type=Path,
                        help="the encoder directory to write: new, empty, or a model's (replaced); "
                        "not a link, a folder of your own files, nor RUN_DIR's checkpoints")
    parser.add_argument("--step", type=int, metavar="N",
                        help="the checkpoint of step N (default: the newest usable one)")
    parser.add_argument("--module", choices=("encoder", "student"), default="encoder",
                        help="which of the run's encoders: `encoder` (default; for ibot the "
                        "EMA teacher, which run_dir/encoder holds, as DINOv2 releases it) "
                        "or ibot's `student`")
    parser.add_argument("--max-shard-size", metavar="SIZE", default="5GB",
                        help="the largest weight file (default 5GB, as transformers): an "
                        "encoder under it is one model.safetensors, a larger one shards of "
                        "whole blocks and an index")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vlm_vit.io.files import read_json
    from vlm_vit.io.native import CONFIG_NAME
    from vlm_vit.io.weights import parse_size
    from vlm_vit.train.consolidate import SOURCE_KEY, consolidate

    try:
        limit = parse_size(args.max_shard_size)
    except ValueError as error:
        raise ValueError(f"--max-shard-size: {error}") from None
    out = consolidate(args.run_dir, args.out, step=args.step, max_shard_size=limit,
                      module=args.module)
    source = read_json(out / CONFIG_NAME).get(SOURCE_KEY, {})
    print(f"wrote {out} from {args.run_dir} ({source.get('checkpoint')}, step "
          f"{source.get('step')}" + (f", the {args.module}" if args.module != "encoder" else "")
          + ")")
    return 0
