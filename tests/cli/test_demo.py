import json

import pytest
from PIL import Image

from vlm_vit import load_encoder
from vlm_vit.cli import main

pytest.importorskip("sklearn")
pytest.importorskip("skimage")
pytest.importorskip("torchvision")


def test_demo_runs_end_to_end_at_a_reduced_size(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--steps", "4", "--batch-size", "16",
                 "--images-per-class", "12", "--width", "32", "--depth", "1", "--shots", "2",
                 "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    for name in ("random_init", "pretrained"):
        assert set(report[name]) == {"few_shot_accuracy", "linear_probe_accuracy"}
        assert all(0.0 <= value <= 1.0 for value in report[name].values())
    assert report["test_images"] == 60 and report["pretraining"]["steps"] == 4
    assert report["photos"] == {"mean": [3, 32], "pixel_shuffle": [3, 16, 32]}
    assert load_encoder(out / "encoder").config.width == 32
    with Image.open(out / "loss.png") as plot:
        assert plot.size == (500, 300)
    printed = capsys.readouterr().out
    assert "random init" in printed and "pretrained" in printed
