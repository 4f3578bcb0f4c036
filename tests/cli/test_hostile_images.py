"""One bad image never stops a job (issue 26, section 4): files PIL fails on with exceptions
other than OSError are skipped and counted by folder `pretrain`, as a corrupt JPEG is."""

import numpy as np
import pytest
import torch
from PIL import Image

from tests.hostile_images import HOSTILE
from vlm_vit import VisionEncoder
from vlm_vit.cli import main

from ..conftest import tiny_config

pytest.importorskip("torchvision")


@pytest.mark.filterwarnings("ignore:IM image format is deprecated")
def test_folder_pretrain_skips_files_pil_fails_on_with_any_exception(tmp_path, capsys):
    rng = np.random.default_rng(0)
    (tmp_path / "images").mkdir()
    for index in range(6):
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(
            tmp_path / "images" / f"{index}.png")
    for kind, build in HOSTILE.items():  # NotImplementedError (DDS), TypeError (IM)
        (tmp_path / "images" / f"{kind}.jpg").write_bytes(build())
    torch.manual_seed(0)
    VisionEncoder(tiny_config()).save_pretrained(tmp_path / "start")
    argv = ["pretrain", "--objective", "mpp", str(tmp_path / "start"), "--data",
            str(tmp_path / "images"), "--out", str(tmp_path / "run"), "--batch-size", "4",
            "--num-workers", "0", "--steps", "3", "--checkpoint-every", "3"]
    assert main(argv) == 0  # 3 steps of 4 read all 8 files
    captured = capsys.readouterr()
    assert "2 undecodable images skipped" in captured.out
    assert (tmp_path / "run" / "encoder").is_dir()
