"""The package's own promises: a light, silent import and optional extras named on failure."""

import subprocess
import sys

import pytest

from vlm_vit.optional import require

HEAVY = ["transformers", "open_clip", "timm", "peft", "bitsandbytes", "matplotlib", "sklearn"]


def test_import_is_silent_and_light():
    code = ("import sys, vlm_vit; "
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n" and result.stderr == ""


def test_missing_extra_names_the_extra():
    with pytest.raises(ImportError, match=r"pip install 'vlm-vit\[hf\]'"):
        require("surely_not_a_module_xyz", "hf", "loading a Hugging Face checkpoint")


def test_atomic_directory_replaces_the_folder_whole_or_not_at_all(tmp_path):
    from vlm_vit.io.files import atomic_directory

    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("old")  # a model's folder (a user's is refused)
    with pytest.raises(RuntimeError), atomic_directory(target) as temp:
        (temp / "new.json").write_text("half")
        raise RuntimeError("crash mid-write")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert [p.name for p in target.iterdir()] == ["config.json"]
    with atomic_directory(target) as temp:
        (temp / "new.json").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert [p.name for p in target.iterdir()] == ["new.json"]


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    from vlm_vit.io.files import atomic_write

    target = tmp_path / "config.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_write(target, "w") as handle:
        handle.write("half")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_the_command_table_and_every_subcommand_s_help_load_no_torch():
    """Issue 47, 9: `vlm-vit --help` took about 4 s of CPU importing torch; the command table
    and each subcommand's --help (the plugins' too) now import neither torch nor any
    optional library."""
    code = f"""
import contextlib, io, sys
from vlm_vit.cli import build_parser
parser = build_parser()
commands = parser._subparsers._group_actions[0].choices
helps = [["--help"]] + [[name, "--help"] for name in commands]
helps += [["llm", sub, "--help"] for sub in
          commands["llm"]._subparsers._group_actions[0].choices] if "llm" in commands else []
for argv in helps:
    with contextlib.redirect_stdout(io.StringIO()) as shown:
        try:
            build_parser().parse_args(argv)
        except SystemExit as done:
            assert done.code == 0, argv
    assert "usage:" in shown.getvalue(), argv
print(len(helps), sorted(m for m in ["torch", *{HEAVY!r}] if m in sys.modules))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    count, loaded = result.stdout.split(" ", 1)
    assert int(count) >= 14 and loaded == "[]\n", result.stdout
