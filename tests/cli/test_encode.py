import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from vlm_vit import ImageProcessor, load_encoder
from vlm_vit.cli import main
from vlm_vit.model import VisionEncoder

from ..conftest import tiny_config


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    VisionEncoder(tiny_config()).save_pretrained(tmp_path / "ckpt")
    ImageProcessor.for_family("clip", size=32).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.fixture
def folder(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "imgs" / "sub").mkdir(parents=True)
    for name in ["b.png", "a.jpg", "sub/c.png"]:
        Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(
            tmp_path / "imgs" / name)
    (tmp_path / "imgs" / "notes.txt").write_text("not an image")
    return tmp_path / "imgs"


def read(path):
    with safe_open(path, "pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}, handle.metadata()  # noqa: SIM118


def test_encode_a_folder_matches_the_library(tmp_path, checkpoint, folder, capsys):
    out = tmp_path / "tokens.safetensors"
    assert main(["encode", str(checkpoint), str(folder), "-o", str(out), "--batch-size", "2",
                 "--quiet"]) == 0
    tensors, metadata = read(out)
    files = json.loads(metadata["files"])
    assert [f.split("imgs/")[1] for f in files] == ["a.jpg", "b.png", "sub/c.png"]
    encoder = load_encoder(checkpoint).eval()
    pixels = ImageProcessor.from_pretrained(checkpoint)(files)
    with torch.no_grad():
        expected = encoder(pixels).tokens
    torch.testing.assert_close(tensors["tokens"], expected, atol=1e-6, rtol=1e-6)
    assert "wrote 3 images" in capsys.readouterr().out


def test_encode_layers_and_drop_prefix(tmp_path, checkpoint, folder):
    out = tmp_path / "layers.safetensors"
    assert main(["encode", str(checkpoint), str(folder), "-o", str(out), "--layer", "-2",
                 "--layer", "0", "--drop-prefix", "--quiet"]) == 0
    tensors, metadata = read(out)
    assert set(tensors) == {"layer_-2", "layer_0"}
    assert tensors["layer_-2"].shape == (3, 16, 32) and metadata["num_prefix_tokens"] == "0"


@pytest.mark.parametrize("argv, message", [
    (["encode", "vit-ti/16", "IMGS", "-o", "x.safetensors"], "add --random-init"),
    (["encode", "CKPT", "missing.png", "-o", "x.safetensors"], "missing.png does not exist"),
    (["encode", "CKPT", "IMGS/notes.txt", "-o", "x.safetensors"], "notes.txt"),
    (["encode", "CKPT", "IMGS", "-o", "x.pt"], "--out must end in .safetensors"),
    (["encode", "CKPT", "IMGS", "-o", "x.safetensors", "--layer", "9"], "out of range"),
    (["encode", "CKPT", "IMGS", "-o", "x.safetensors", "--image-size", "30"],
     "not a multiple of patch size 8"),
])
def test_encode_user_errors(tmp_path, checkpoint, folder, capsys, argv, message):
    argv = [a.replace("CKPT", str(checkpoint)).replace("IMGS", str(folder)) for a in argv]
    argv = [str(tmp_path / a) if a.startswith("x.") else a for a in argv]
    assert main([*argv, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.safetensors").exists()


def test_console_script_exits_non_zero_without_traceback():
    result = subprocess.run([sys.executable, "-m", "vlm_vit.cli", "info", "nope/16"],
                            capture_output=True, text=True)
    assert result.returncode == 1 and "unknown variant" in result.stderr
    assert "Traceback" not in result.stderr
