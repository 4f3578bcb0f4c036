import argparse

import pytest
import torch

from vlm_vit.cli import build_parser, main


def test_every_command_is_registered():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {"info", "encode", "convert", "probe", "pretrain", "demo", "analyze"} <= set(
        subparsers.choices)


def commands_with_a_device() -> dict[str, list[str]]:
    """Every subcommand (plugins' included) with a --device option, and an argv that gets
    it past argparse (each required argument filled with a placeholder)."""
    found = {}

    def walk(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*prefix, name])
        options = {o for a in parser._actions for o in a.option_strings}
        if "--device" in options and prefix:
            argv = list(prefix)
            for action in parser._actions:
                value = str(action.choices[0]) if action.choices else "1"
                if not action.option_strings and not isinstance(
                        action, argparse._SubParsersAction):
                    argv.append(value)
                elif action.required:
                    argv += [action.option_strings[0], value]
            found[" ".join(prefix)] = argv

    walk(build_parser(), [])
    return found


def test_every_command_with_a_device_is_found():
    assert {"encode", "probe", "analyze", "pretrain", "finetune"} <= set(commands_with_a_device())


@pytest.mark.parametrize("command", sorted(commands_with_a_device()))
@pytest.mark.parametrize("device, message", [
    ("gpu", "--device 'gpu' is not a device; use auto, cpu, cuda or cuda:N"),
    ("cuda", "CUDA is not available on this machine"),
])
def test_a_device_that_is_not_there_is_one_line(command, device, message, capsys):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    argv = commands_with_a_device()[command]
    assert main([*argv, "--device", device]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
