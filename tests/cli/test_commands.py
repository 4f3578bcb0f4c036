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


@pytest.mark.parametrize("command", sorted(commands_with_a_device()))
def test_auto_reaches_every_command_as_a_real_device(command, monkeypatch):
    """`--device auto` is resolved once, in `main`, for every command (plugins' included):
    the command's body receives a device torch accepts, never the word "auto"."""
    import vlm_vit.cli as cli

    parser = build_parser()
    seen = {}
    sub = parser
    for name in command.split():
        action = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction))
        sub = action.choices[name]
    sub.set_defaults(run=lambda args: seen.setdefault("device", args.device) and 0)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert main([*commands_with_a_device()[command], "--device", "auto"]) == 0
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert seen["device"] == expected and torch.device(seen["device"]).type == expected


def test_encode_runs_with_device_auto(tmp_path, capsys):
    """The crash users met: `encode --device auto` gave "unexpected RuntimeError ... device
    string: auto" after checking the flag."""
    from PIL import Image

    from vlm_vit.model import VisionEncoder

    from ..conftest import tiny_config

    torch.manual_seed(0)
    VisionEncoder(tiny_config()).save_pretrained(tmp_path / "ckpt")
    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(tmp_path / "imgs" / "a.png")
    out = tmp_path / "tokens.safetensors"
    assert main(["encode", str(tmp_path / "ckpt"), str(tmp_path / "imgs"), "-o", str(out),
                 "--device", "auto", "--quiet"]) == 0, capsys.readouterr().err
    assert out.is_file()


@pytest.mark.parametrize("command", ["encode", "probe", "llm train"])
def test_a_mistyped_flag_shows_the_subcommand_s_usage(command, capsys):
    """Issue 27, 9: argparse reports a subcommand's unknown flag from the top level, with
    the top-level usage; ours names the subcommand and shows its own usage."""
    argv = {"encode": ["encode", "m", "x", "-o", "o"], "probe": ["probe", "m", "--data", "d"],
            "llm train": ["llm", "train", "m", "--data", "d", "--out", "o"]}[command]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--bogus", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: vlm-vit {command} ")
    assert err.strip().endswith(f"vlm-vit {command}: error: unrecognized arguments: --bogus 1")


def test_every_description_ends_with_its_sentence():
    """`vlm-vit demo --help` once stopped mid-sentence (issue 27, 9)."""
    def walk(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield " ".join([*prefix, name]), (sub.description or "").strip()
                    yield from walk(sub, [*prefix, name])

    for command, description in walk(build_parser(), []):
        assert not description or description[-1] in ".)", (command, description[-60:])
