"""The `vlm-vit` command.

Subcommands are small functions; installed plugins add their own through the entry-point
group `vlm_vit.commands` (each entry is a function that takes the argparse subparsers and
adds one), read only when the command runs.

Every failure is one line on stderr and exit status 1: an error of ours (`USER_ERRORS`: bad
arguments or files, a full disk, a diverging run) says what is wrong; any other exception
says it is unexpected and where its full traceback was written (`traceback_path`). With
`-v` the traceback is printed too.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import pickle
import shlex
import sys
import tempfile
import traceback
from importlib import metadata
from pathlib import Path

from vlm_vit.registry import UnknownNameError

COMMAND_GROUP = "vlm_vit.commands"
# The subcommands, in `--help`'s order: modules of this package whose top level imports no
# torch (their `run` functions import what they need), so `vlm-vit --help` and a
# subcommand's `--help` start in a fraction of a second.
SUBCOMMANDS = ("info", "encode", "convert", "download", "probe", "pretrain", "demo", "analyze",
               "finetune", "predict", "shards", "export", "consolidate")

# Errors of ours, and of the system (OSError: permissions, a full disk, missing files), that
# a user can cause and fix: printed as their message alone. ValueError covers the image,
# config and integrity errors; ImportError says which extra to install; the trainer's
# `NonFiniteLossError` (a diverging run) is matched by `_is_user_error` without importing
# the trainer.
USER_ERRORS = (ValueError, OSError, ImportError, UnknownNameError)
# An OSError without a file name while a command writes: said to concern its --out.
_WRITE_ERRNOS = frozenset(getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EROFS", "EFBIG")
                          if hasattr(errno, name))


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an argument it does not know is reported with its own usage
    (`vlm-vit encode --bogus` shows encode's usage, not the top level's). Nested subcommands
    (plugins' `vlm-vit llm train`) are parsers of this class too."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlm-vit", description="Vision Transformer encoders for multimodal pipelines."
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log progress details; a failure prints its full traceback too")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       parser_class=CommandParser)
    for name in SUBCOMMANDS:
        importlib.import_module(f"vlm_vit.cli.{name}").add_parser(subparsers)
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
    # The command as typed, for run records (`run_config.json`, `demo.json`).
    args.command_line = shlex.join(["vlm-vit", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "device", None) is not None:  # every command's --device, plugins too
            from vlm_vit.cli.common import check_device

            args.device = check_device(args.device)  # "auto" resolved once, here
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print(f"vlm-vit {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if args.verbose:
            traceback.print_exception(error, file=sys.stderr)
        line = describe_error(error, args, sys.argv[1:] if argv is None else argv)
        print(f"vlm-vit {args.command}: error: {line}", file=sys.stderr)
        return 1


def describe_error(error: Exception, args: argparse.Namespace, argv: list[str]) -> str:
    """One line for a failure: the message of an error of ours; for any other exception its
    type and first line, and where its full traceback (after the command line `argv`) was
    written."""
    if isinstance(error, OSError) and error.strerror:  # the system's: "[Errno 28] ..." reworded
        if error.filename is not None:
            where = f"{error.filename}" + (f" -> {error.filename2}" if error.filename2 else "")
            return f"{where}: {error.strerror}"
        out = getattr(args, "out", None)
        if error.errno in _WRITE_ERRNOS and out is not None:
            return f"{error.strerror} (writing to {out})"
        return str(error.strerror)
    if _is_user_error(error):
        return _one_line(str(error)) or type(error).__name__
    from vlm_vit.optional import broken_import

    if (broken := broken_import(error)) is not None:  # an installed package fails to import
        return broken
    if isinstance(error, pickle.UnpicklingError):  # another library's torch.load refused it
        from vlm_vit.io.loading import unpickling_refusal

        needs_code, reason = unpickling_refusal(error)
        return (f"a weight file {'needs arbitrary code to load' if needs_code else 'is corrupt'}"
                f" and was refused ({reason})")
    path = traceback_path()
    try:
        path.write_text(f"vlm-vit {shlex.join(argv)}\n\n"
                        + "".join(traceback.format_exception(error)))
        where = f"the full traceback is in {path}" + ("" if args.verbose else "; -v prints it")
    except OSError as failed:
        where = f"could not write the traceback to {path} ({failed.strerror}); -v prints it"
    first = _one_line(str(error).split("\n", 1)[0]).rstrip(":")
    return f"unexpected {type(error).__name__}{f': {first}' if first else ''} ({where})"


def _is_user_error(error: Exception) -> bool:
    training = sys.modules.get("vlm_vit.train.config")  # loaded if a run raised it
    return isinstance(error, USER_ERRORS) or (
        training is not None and isinstance(error, training.NonFiniteLossError))


def traceback_path() -> Path:
    """Where an unexpected error's traceback goes: the system temp dir, one file per process."""
    return Path(tempfile.gettempdir()) / f"vlm-vit-traceback-{os.getpid()}.txt"


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
