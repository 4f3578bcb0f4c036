import json

import pytest

from vlm_vit.cli import main
from vlm_vit.model import VisionEncoder

from ..conftest import tiny_config


def test_info_of_a_variant_reports_paper_counts(capsys):
    assert main(["info", "vit-b/16", "--json", "--image-size", "224", "--image-size", "384",
                 "512"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"] == 85_798_656
    first, second = report["resolutions"]
    assert first["tokens"] == 197 and first["grid"] == [14, 14]
    assert second["image_size"] == [384, 512] and second["tokens"] == 24 * 32 + 1
    assert first["gflops"] == pytest.approx(35.1, abs=0.1)  # 17.6 G multiply-adds


def test_info_of_a_checkpoint_table(tmp_path, capsys):
    VisionEncoder(tiny_config(num_register_tokens=4)).save_pretrained(tmp_path)
    assert main(["info", str(tmp_path), "--image-size", "32", "--image-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "registers 4" in out
    assert " 21 " in out and " 69 " in out  # 16 + 5 and 64 + 5 tokens


@pytest.mark.parametrize("argv, message", [
    (["info", "vit-b/61"], "unknown variant 'vit-b/61'; did you mean vit-b/16"),
    (["info", "vit-b/16", "--image-size", "225"], "225x225 is not a multiple of patch size 16"),
])
def test_info_user_errors_are_one_line(capsys, argv, message):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_info_of_another_family_reads_its_config(tmp_path, capsys):
    from vlm_vit.files import write_safetensors

    encoder = VisionEncoder(tiny_config(width=64, heads=1, mlp_width=128))
    write_safetensors(encoder.state_dict(), tmp_path / "timm.safetensors")  # a timm state dict
    assert main(["info", str(tmp_path / "timm.safetensors"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"] == sum(p.numel() for p in encoder.parameters())


def test_a_folder_with_encoders_inside_names_them(tmp_path, capsys):
    """Issue 27, 9: `info` on a run directory or a saved multimodal model says where the
    encoder is, in its one line."""
    from vlm_vit import VisionTower, build_pooler

    encoder = VisionEncoder(tiny_config())
    encoder.save_pretrained(tmp_path / "run" / "encoder")
    (tmp_path / "run" / "run_config.json").write_text("{}")
    VisionTower(encoder, build_pooler("mlp2x_gelu", in_dim=32, out_dim=16)).save_pretrained(
        tmp_path / "mm" / "tower")
    (tmp_path / "lora" / "adapter").mkdir(parents=True)
    (tmp_path / "lora" / "adapter" / "adapter_config.json").write_text("{}")
    expected = {"run": f"the encoders inside it: {tmp_path / 'run' / 'encoder'} "
                       f"(`vlm-vit info {tmp_path / 'run' / 'encoder'}`)",
                "mm": f"the encoders inside it: {tmp_path / 'mm' / 'tower'}",
                "lora": f"it holds the LoRA adapter {tmp_path / 'lora' / 'adapter'}; "
                        f"`vlm-vit merge {tmp_path / 'lora'} --out DIR`"}
    for folder, hint in expected.items():
        assert main(["info", str(tmp_path / folder)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and hint in err[0], err
    assert main(["info", str(tmp_path / "mm" / "tower")]) == 0
