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
    from vlm_vit.files import atomic_directory

    target = tmp_path / "model"
    target.mkdir()
    (target / "old.json").write_text("old")
    with pytest.raises(RuntimeError), atomic_directory(target) as temp:
        (temp / "new.json").write_text("half")
        raise RuntimeError("crash mid-write")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert [p.name for p in target.iterdir()] == ["old.json"]
    with atomic_directory(target) as temp:
        (temp / "new.json").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert [p.name for p in target.iterdir()] == ["new.json"]


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    from vlm_vit.files import atomic_write

    target = tmp_path / "config.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_write(target, "w") as handle:
        handle.write("half")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["config.json"]
