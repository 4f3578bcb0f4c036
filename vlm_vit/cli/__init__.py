"""The `vlm-vit` command.

Subcommands are small functions; installed plugins add their own through the entry-point
group `vlm_vit.commands` (each entry is a function that takes the argparse subparsers and
adds one), read only when the command runs. A user error prints one line and exits 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import metadata

from vlm_vit.cli import (
    analyze,
    convert,
    demo,
    download,
    encode,
    finetune,
    info,
    predict,
    pretrain,
    probe,
    shards,
)
from vlm_vit.processor import ImageLoadError, ImageTooLargeError
from vlm_vit.registry import UnknownNameError

COMMAND_GROUP = "vlm_vit.commands"
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError,
               UnknownNameError, ImageLoadError, ImageTooLargeError, PermissionError)


class CliError(Exception):
    """A user error the command reports in one line."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlm-vit", description="Vision Transformer encoders for multimodal pipelines."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info.add_parser(subparsers)
    encode.add_parser(subparsers)
    convert.add_parser(subparsers)
    download.add_parser(subparsers)
    probe.add_parser(subparsers)
    pretrain.add_parser(subparsers)
    demo.add_parser(subparsers)
    analyze.add_parser(subparsers)
    finetune.add_parser(subparsers)
    predict.add_parser(subparsers)
    shards.add_parser(subparsers)
    for entry in metadata.entry_points(group=COMMAND_GROUP):
        try:
            entry.load()(subparsers)
        except Exception as error:  # a broken plugin must not break the core commands
            logging.getLogger(__name__).warning(
                "could not load command plugin %r (%s): %s", entry.name, entry.value, error)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "device", None) is not None:  # every command's --device, plugins too
            from vlm_vit.cli.common import check_device

            check_device(args.device)
        return int(args.run(args) or 0)
    except (CliError, *USER_ERRORS) as error:
        print(f"vlm-vit {args.command}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"vlm-vit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
