"""An optional dependency that is installed but fails to import (issue 47, 3) is named as such:
which package, which version, which torch, and what to install; through `require` and
through the command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlm_vit.optional import require

REPO = Path(__file__).resolve().parents[1]
TORCH = torch.__version__.split("+")[0]


def broken_package(root: Path, name: str, version: str, raising: str) -> Path:
    """A package `name` under ROOT/site-packages whose import raises `raising`."""
    site = root / "site-packages"
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text(f"raise {raising}\n")
    (site / f"{name}-{version}.dist-info").mkdir()
    (site / f"{name}-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return site


def test_require_names_a_package_that_is_there_but_fails_to_import(tmp_path, monkeypatch):
    site = broken_package(tmp_path, "brokenpkg", "1.2.3", 'RuntimeError("no kernel for op")')
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(ImportError) as raised:
        require("brokenpkg.sub", "train", "the thing")
    assert str(raised.value) == (
        f"the thing: brokenpkg 1.2.3 is installed but fails to import with torch {TORCH} "
        "(RuntimeError: no kernel for op); it was probably built for another torch or "
        "Python: pip install --force-reinstall 'brokenpkg'")
    with pytest.raises(ImportError, match=r"the thing needs notthere: pip install 'vlm-vit\["
                                          r"train\]'"):
        require("notthere", "train", "the thing")  # missing: the extra, as before


def test_a_torchvision_built_for_another_torch_is_one_line_from_the_demo(tmp_path):
    site = broken_package(tmp_path, "torchvision", "0.24.1",
                          'RuntimeError("operator torchvision::nms does not exist")')
    done = subprocess.run(
        [sys.executable, "-m", "vlm_vit.cli", "demo", "--out", str(tmp_path / "demo"),
         "--quick", "--images-per-class", "20", "--labels", "1", "--quiet"], cwd=REPO,
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    minor = int(TORCH.split(".")[1]) + 15
    assert lines == [
        f"vlm-vit demo: error: training augmentation: torchvision 0.24.1 is installed but "
        f"fails to import with torch {TORCH} (RuntimeError: operator torchvision::nms does "
        "not exist); it was probably built for another torch or Python: install the "
        f"torchvision built for torch {TORCH}: pip install 'torchvision==0.{minor}.*' (with "
        "the same --index-url as torch)"], done.stderr
