import json
import subprocess
import sys
from pathlib import Path

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
    assert main(["encode", str(checkpoint), str(folder), "-o", str(out), "--feature-layer", "-2",
                 "--feature-layer", "0", "--no-keep-prefix", "--quiet"]) == 0
    tensors, metadata = read(out)
    assert set(tensors) == {"layer_-2", "layer_0"}
    assert tensors["layer_-2"].shape == (3, 16, 32) and metadata["num_prefix_tokens"] == "0"


@pytest.mark.parametrize("argv, message", [
    (["encode", "vit-ti/16", "IMGS", "-o", "x.safetensors"], "add --random-init"),
    (["encode", "CKPT", "missing.png", "-o", "x.safetensors"], "missing.png does not exist"),
    (["encode", "CKPT", "IMGS/notes.txt", "-o", "x.safetensors"], "notes.txt"),
    (["encode", "CKPT", "IMGS", "-o", "x.pt"], "--out must end in .safetensors"),
    (["encode", "CKPT", "IMGS", "-o", "x.safetensors", "--feature-layer", "9"], "out of range"),
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


@pytest.fixture
def photo_folder(tmp_path):
    """Real photos of different shapes (scikit-image's), portrait, landscape and square."""
    data = pytest.importorskip("skimage.data")
    (tmp_path / "photos").mkdir()
    for name, array in [("astronaut", data.astronaut()), ("coffee", data.coffee()),
                        ("rocket", data.rocket()), ("chelsea", data.chelsea())]:
        Image.fromarray(array).resize((array.shape[1] // 8, array.shape[0] // 8)).save(
            tmp_path / "photos" / f"{name}.png")
    return tmp_path / "photos"


@pytest.mark.parametrize("drop_prefix", [False, True])
def test_encode_at_native_resolution_matches_each_image_alone(tmp_path, checkpoint,
                                                              photo_folder, drop_prefix, capsys):
    out = tmp_path / "native.safetensors"
    argv = ["encode", str(checkpoint), str(photo_folder), "-o", str(out), "--native-resolution",
            "--max-tokens", "120", "--feature-layer", "-2", "--quiet"]
    assert main(argv + (["--no-keep-prefix"] if drop_prefix else [])) == 0
    tensors, metadata = read(out)
    files = json.loads(metadata["files"])
    encoder = load_encoder(checkpoint).eval()
    processor = ImageProcessor.from_dict(ImageProcessor.from_pretrained(checkpoint).to_dict()
                                         | {"resize_mode": "native", "patch_multiple": 8,
                                            "max_output_pixels": (120 - 1) * 64})
    prefix = 0 if drop_prefix else 1
    start = 0
    shapes = set()
    for index, image in enumerate(processor(files)):
        shapes.add(tuple(image.shape[1:]))
        with torch.no_grad():
            expected = encoder(image[None], feature_layers=[-2]).features[0][0, 1 - prefix:]
        length = int(tensors["lengths"][index])
        assert length == expected.shape[0]
        assert tensors["grids"][index].tolist() == [image.shape[1] // 8, image.shape[2] // 8]
        torch.testing.assert_close(tensors["layer_-2"][start:start + length], expected,
                                   atol=1e-5, rtol=1e-5)
        start += length
    assert start == tensors["layer_-2"].shape[0] and len(shapes) > 2  # really native sizes
    assert metadata["packed"] == "true" and metadata["num_prefix_tokens"] == str(prefix)
    packs = int(capsys.readouterr().out.split(" packs ")[0].split()[-1])
    assert 1 < packs < len(files)  # the budget made packs of several images


@pytest.mark.parametrize("extra, message", [
    (["--max-tokens", "1"], "--max-tokens must be more than the 1 prefix tokens"),
    (["--image-size", "32"], "drop --image-size"),
])
def test_native_resolution_user_errors(tmp_path, checkpoint, photo_folder, capsys, extra,
                                       message):
    argv = ["encode", str(checkpoint), str(photo_folder), "-o", str(tmp_path / "x.safetensors"),
            "--native-resolution", "--quiet", *extra]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def native_error(tmp_path, checkpoint, photo_folder, capsys, *extra):
    """Runs a native-resolution encode expected to fail (--strict: a bad image stops it);
    returns its one error line."""
    argv = ["encode", str(checkpoint), str(photo_folder), "-o", str(tmp_path / "x.safetensors"),
            "--native-resolution", "--quiet", "--strict", *extra]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "unexpected" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x.safetensors").exists()
    return err


def test_native_resolution_refuses_a_decompression_bomb_as_too_large(tmp_path, checkpoint,
                                                                      photo_folder, capsys):
    from tests.hostile_images import huge_png

    (photo_folder / "bomb.png").write_bytes(huge_png())  # 45 bytes, 60000 x 60000
    err = native_error(tmp_path, checkpoint, photo_folder, capsys)
    assert "bomb.png" in err and "too large" in err


@pytest.mark.parametrize("size, extra, message", [
    ((2, 500), [], "aspect ratio 250"),  # too thin for any budget
    ((8, 1600), ["--max-tokens", "120"], "1232"),  # one patch high, still over 119 patches
])
def test_native_resolution_errors_name_the_image(tmp_path, checkpoint, photo_folder, capsys,
                                                 size, extra, message):
    Image.new("RGB", size[::-1], (9, 9, 9)).save(photo_folder / "strip.png")
    err = native_error(tmp_path, checkpoint, photo_folder, capsys, *extra)
    assert "strip.png" in err and message in err


def test_a_max_tokens_no_image_can_have_names_the_flag(tmp_path, checkpoint, photo_folder,
                                                       capsys):
    err = native_error(tmp_path, checkpoint, photo_folder, capsys,
                       "--max-tokens", "1000000000000")
    assert "--max-tokens 1000000000000" in err and "max_output_pixels" not in err
    assert f"{16384 ** 2 // 64 + 1}" in err  # patches of 8 in a 16384 x 16384 image, + 1



def test_a_folder_encode_skips_and_names_bad_images_and_keeps_the_rest(tmp_path, checkpoint,
                                                                       capsys):
    """Issue 27, 2: a bad image in the last of 4 batches used to stop the encode with nothing
    written; now every bad image is skipped, named on stderr and in the metadata, and the
    others are encoded exactly as the library encodes them."""
    rng = np.random.default_rng(1)
    folder = tmp_path / "many"
    folder.mkdir()
    for index in range(7):
        Image.fromarray(rng.integers(0, 255, (36, 44, 3), dtype=np.uint8)).save(
            folder / f"{index}.png")
    (folder / "3.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")  # undecodable
    (folder / "8.jpg").write_text("not an image")  # alone in the last batch
    out = tmp_path / "tokens.safetensors"
    argv = ["encode", str(checkpoint), str(folder), "-o", str(out), "--batch-size", "2",
            "--quiet"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "wrote 6 images" in captured.out and "2 skipped" in captured.out
    tensors, metadata = read(out)
    files = json.loads(metadata["files"])
    assert [Path(f).name for f in files] == ["0.png", "1.png", "2.png", "4.png", "5.png",
                                              "6.png"]
    skipped = json.loads(metadata["skipped"])
    assert [Path(entry["file"]).name for entry in skipped] == ["3.png", "8.jpg"]
    assert all(entry["reason"] for entry in skipped)
    encoder = load_encoder(checkpoint).eval()
    with torch.no_grad():
        expected = encoder(ImageProcessor.from_pretrained(checkpoint)(files)).tokens
    torch.testing.assert_close(tensors["tokens"], expected, atol=1e-6, rtol=1e-6)

    out.unlink()
    assert main([*argv, "--strict"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "3.png" in err[0] and not out.exists()


def test_a_folder_of_only_bad_images_writes_nothing(tmp_path, checkpoint, capsys):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.png").write_text("not an image")
    out = tmp_path / "tokens.safetensors"
    assert main(["encode", str(checkpoint), str(tmp_path / "bad"), "-o", str(out),
                 "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "no image could be encoded: all 1 were skipped" in err[-1] and "a.png" in err[-1]
    assert not out.exists()


def test_native_resolution_skips_an_image_no_budget_fits(tmp_path, checkpoint, photo_folder,
                                                         capsys):
    Image.new("RGB", (500, 2), (9, 9, 9)).save(photo_folder / "strip.png")
    out = tmp_path / "x.safetensors"
    assert main(["encode", str(checkpoint), str(photo_folder), "-o", str(out),
                 "--native-resolution", "--quiet"]) == 0
    _, metadata = read(out)
    skipped = json.loads(metadata["skipped"])
    assert [Path(entry["file"]).name for entry in skipped] == ["strip.png"]
    assert "aspect ratio 250" in skipped[0]["reason"]
    assert "strip.png" not in metadata["files"]
