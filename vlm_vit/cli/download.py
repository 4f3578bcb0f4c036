"""`vlm-vit download NAME`: fill the Hugging Face cache before going offline."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "download", help="fetch a model name into the Hugging Face cache",
        description="Fetch what vlm-vit reads of a model (configs and safetensors weights) into "
        "the Hugging Face cache (HF_HOME / HF_HUB_CACHE), and print where it is and its "
        "format; afterwards HF_HUB_OFFLINE=1 loads it by name.")
    parser.add_argument("name", metavar="NAME", help="org/name[@revision], hf-hub:org/name, or "
                        "open_clip's MODEL/TAG (e.g. ViT-B-32/laion2b_s34b_b79k)")
    parser.add_argument("--revision", help="a branch, tag or commit (default: main)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vlm_vit.convert import detect_format
    from vlm_vit.io import hub
    from vlm_vit.io.loading import read_checkpoint

    if Path(args.name).exists():
        raise ValueError(f"{args.name} is a local path; download takes a model name")
    try:
        location = hub.locate(args.name, args.revision)
    except hub.NotCachedError as error:  # its advice would be to run this very command
        then = ("unset HF_HUB_OFFLINE and run it again" if hub.offline() else
                "check the name and revision, the network and HF_ENDPOINT")
        raise hub.NotCachedError(error.problem, then) from error
    fmt = location.format or detect_format(read_checkpoint(location)).name
    print(f"{location.directory}\t{fmt}")
    return 0
