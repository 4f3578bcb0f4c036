import argparse

from vlm_vit.cli import build_parser


def test_every_command_is_registered():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {"info", "encode", "convert", "probe", "pretrain", "demo", "analyze"} <= set(
        subparsers.choices)
