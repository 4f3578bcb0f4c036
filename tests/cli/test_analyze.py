import json

import pytest
import torch
from PIL import Image

from vlm_vit.cli import main
from vlm_vit.config import EncoderConfig
from vlm_vit.model import VisionEncoder

# figure -> PNG (width, height): figsize in inches x 100 dpi (vlm_vit.analysis.figures)
FIGURES = {
    "mean_attention_distance.png": (600, 450),
    "position_similarity.png": (700, 600),
    "embedding_filters.png": (700, 450),
}
ROLLOUT_SIZE = (600, 300)
PHOTOS = ("astronaut", "coffee", "chelsea")


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Real photographs from scikit-image, saved as PNGs of their own sizes."""
    from skimage import data

    root = tmp_path_factory.mktemp("photos")
    for name in PHOTOS:
        Image.fromarray(getattr(data, name)()).save(root / f"{name}.png")
    return root


def _checkpoint(directory, **overrides):
    torch.manual_seed(0)
    config = EncoderConfig(image_size=32, patch_size=8, width=32, depth=2, heads=4,
                           mlp_width=64, **overrides)
    return VisionEncoder(config).save_pretrained(directory)


def test_analyze_writes_every_figure_and_the_json(photos, tmp_path, capsys):
    checkpoint = _checkpoint(tmp_path / "ckpt")
    out = tmp_path / "analysis"
    assert main(["analyze", str(checkpoint), "--images", str(photos), "--out", str(out),
                 "--quiet"]) == 0
    assert f"analysed 3 images with {checkpoint}: 6 figures" in capsys.readouterr().out
    rollouts = {f"rollout/{i:03d}_{name}.png": ROLLOUT_SIZE
                for i, name in enumerate(sorted(PHOTOS))}
    expected = {**FIGURES, **rollouts}
    for name, size in expected.items():
        with Image.open(out / name) as image:
            assert image.format == "PNG" and image.size == size, name

    result = json.loads((out / "analysis.json").read_text())
    assert sorted(result["figures"]) == sorted(expected)
    assert result["images"] == [str(photos / f"{name}.png") for name in sorted(PHOTOS)]
    distances = result["mean_attention_distance"]
    assert len(distances) == 2 and all(len(layer) == 4 for layer in distances)
    # 4 x 4 grid of 8-pixel patches: no two patch centres lie more than 8 * hypot(3, 3) apart
    assert all(0 < value < 8 * 18**0.5 for layer in distances for value in layer)
    assert result["attention_rollout"]["source"] == "class_token"
    maps = result["attention_rollout"]["maps"]
    assert len(maps) == 3 and all(len(m["map"]) == 4 and len(m["map"][0]) == 4 for m in maps)
    similarity = result["position_similarity"]
    assert similarity["grid"] == [4, 4] and len(similarity["matrix"]) == 16
    filters = result["embedding_filters"]
    # 28 components of [3, 8, 8] (D = 32 rows, so at most 32 exist)
    assert len(filters["components"]) == 28 and len(filters["components"][0]) == 3
    assert len(filters["explained_variance_ratio"]) == 28


def test_a_model_without_class_token_uses_the_mean_of_patch_rows(photos, tmp_path):
    checkpoint = _checkpoint(tmp_path / "ckpt", class_token=False)
    out = tmp_path / "analysis"
    assert main(["analyze", str(checkpoint), "--images", str(photos / "coffee.png"),
                 "--out", str(out), "--quiet"]) == 0
    result = json.loads((out / "analysis.json").read_text())
    assert result["attention_rollout"]["source"] == "mean_of_patch_rows"
    assert result["prefix_attention"] == [[0.0] * 4] * 2
    with Image.open(out / "rollout/000_coffee.png") as image:
        assert image.size == ROLLOUT_SIZE


@pytest.mark.parametrize("images, message", [
    ("missing", "PHOTOS/missing does not exist"),
    ("", "folder EMPTY holds no image files"),
])
def test_bad_images_paths_are_one_line_errors(photos, tmp_path, capsys, images, message):
    checkpoint = _checkpoint(tmp_path / "ckpt")
    empty = tmp_path / "empty"
    empty.mkdir()
    path = photos / images if images else empty
    assert main(["analyze", str(checkpoint), "--images", str(path), "--out",
                 str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vlm-vit analyze: error: ")
    assert message.replace("PHOTOS", str(photos)).replace("EMPTY", str(empty)) in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_missing_encoder_is_a_one_line_error(photos, tmp_path, capsys):
    assert main(["analyze", str(tmp_path / "nope"), "--images", str(photos), "--out",
                 str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "nope does not exist" in err and len(err.strip().splitlines()) == 1
