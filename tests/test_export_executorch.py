"""ExecuTorch programs (`vlm_vit.deploy.executorch`, issue 46): a tower's `.pte` has a
`vision_encoder` method taking pixels to the projected tokens, lowered to XNNPACK, and run by
ExecuTorch's own runtime it equals eager at the native size and at another frozen size; the
command line writes it and refuses what it cannot hold in one line."""

import pytest
import torch

pytest.importorskip("executorch", reason="ExecuTorch is the dev extra's; pip install "
                                         "'vlm-vit[executorch]'")

from vlm_vit import EncoderConfig, VisionEncoder, VisionTower, build_pooler  # noqa: E402
from vlm_vit.deploy.executorch import METHOD, executorch_runner, export_executorch  # noqa: E402

TOLERANCE = 1e-4  # the issue's; measured about 1e-7 (XNNPACK's float32 sums in another order)


def tiny_tower() -> VisionTower:
    config = EncoderConfig(image_size=32, patch_size=8, width=64, depth=2, heads=2,
                           mlp_width=128)
    torch.manual_seed(0)
    encoder = VisionEncoder(config)
    with torch.no_grad():  # a position table far from zero, so a wrong resize would show
        encoder.pos_embed.add_(torch.randn_like(encoder.pos_embed))
    return VisionTower(encoder.eval(), build_pooler("mlp2x_gelu", in_dim=64, out_dim=48),
                       feature_layer=-2).eval()


@pytest.mark.parametrize("size", [(32, 32), (32, 48)], ids=["native", "resized"])
def test_the_program_runs_in_executorch_equal_to_eager(tmp_path, size):
    tower = tiny_tower()
    report = export_executorch(tower, tmp_path / "tower.pte", image_size=size)
    assert report.format == "executorch" and report.max_abs_difference < TOLERANCE
    from executorch.runtime import Runtime

    assert METHOD in Runtime.get().load_program(tmp_path / "tower.pte").method_names
    pixels = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = tower(pixels)
    got = executorch_runner(tmp_path / "tower.pte")(pixels)
    assert got.shape == expected.shape == (1, size[0] // 8 * size[1] // 8, 48)
    torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE)


def test_pixels_of_another_shape_are_refused_before_running(tmp_path):
    export_executorch(tiny_tower(), tmp_path / "tower.pte")
    with pytest.raises(ValueError, match=r"takes pixels of shape \(1, 3, 32, 32\) \(frozen at "
                                         r"export\), got \(2, 3, 32, 32\)"):
        executorch_runner(tmp_path / "tower.pte")(torch.zeros(2, 3, 32, 32))


def test_the_command_writes_a_program_and_refuses_dynamic_in_one_line(tmp_path, capsys):
    from vlm_vit.cli import main

    out = tmp_path / "tower.pte"
    assert main(["export", "vit-ti/16", "--random-init", "--pooler", "mlp2x_gelu",
                 "--out-dim", "32", "--format", "executorch", "--image-size", "32",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "maximum difference" in printed and out.is_file()
    assert main(["export", "vit-ti/16", "--random-init", "--format", "executorch", "--dynamic",
                 "--out", str(tmp_path / "other.pte")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "frozen at one size" in err[0], err
    assert not (tmp_path / "other.pte").exists()
