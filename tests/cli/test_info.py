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
    from vlm_vit.io.files import write_safetensors

    encoder = VisionEncoder(tiny_config(width=64, heads=1, mlp_width=128))
    (tmp_path / "timm").mkdir()  # timm's hub layout: a bare state dict does not record heads
    write_safetensors(encoder.state_dict(), tmp_path / "timm" / "model.safetensors")
    (tmp_path / "timm" / "config.json").write_text('{"model_args": {"num_heads": 1}}')
    assert main(["info", str(tmp_path / "timm"), "--json"]) == 0
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


# Issue 33: each mechanism set, named from the config's fields (the tiny sizes are arbitrary).
FAMILIES = [
    ({}, "paper ViT", []),
    (dict(pre_norm=True, act="quick_gelu"), "CLIP-style", []),
    (dict(layer_scale_init=1e-5, num_register_tokens=4), "DINOv2-style",
     ["LayerScale", "4 registers"]),
    (dict(pos_embed="none", rope_theta=10000, rope_frequencies="alternating", norm="rmsnorm",
          mlp="swiglu", act="silu", class_token=False), "Pixtral-style",
     ["RoPE (alternating, θ=10000)", "RMSNorm", "SwiGLU", "no position table"]),
    (dict(pos_embed="none", rope_theta=10000, temporal_patch_size=2, class_token=False),
     "Qwen2-VL-style", ["Conv3d over 2 frames", "RoPE (shared, θ=10000)", "no position table"]),
    (dict(pos_embed="none", rope_theta=10000, temporal_patch_size=2, class_token=False,
          norm="rmsnorm", mlp="swiglu", act="silu", window_size=2, full_attention_blocks=(2,)),
     "Qwen2-VL-style", ["Conv3d over 2 frames", "RoPE (shared, θ=10000)",
                        "2x2 window attention (global in blocks 2)", "RMSNorm", "SwiGLU",
                        "no position table"]),
    (dict(rope_theta=10000, mlp="swiglu", act="silu"), "EVA-02-style",
     ["RoPE (shared, θ=10000)", "SwiGLU"]),
    (dict(rope_theta=10000, mlp="swiglu", act="silu", mlp_norm=True,
          rope_reference_grid=(16, 16)), "EVA-02-style",
     ["RoPE (shared, θ=10000, reference grid 16x16)", "SwiGLU with sub-LN"]),
    (dict(rope_theta=100), "RoPE ViT", ["RoPE (shared, θ=100)"]),
    # issue 45's families
    (dict(rope_theta=100, rope_positions="centered", layer_scale_init=1.0,
          num_register_tokens=4), "DINOv3-style",
     ["RoPE (shared, θ=100, at patch centres)", "LayerScale", "4 registers"]),
    (dict(patch_norm=True, norm="rmsnorm", mlp="swiglu", act="silu", pos_embed="sincos",
          class_token=False), "AIMv2-style",
     ["RMSNorm", "SwiGLU", "normed patch embeddings", "sin-cos positions per grid"]),
    (dict(rope_theta=10000, temporal_patch_size=2, class_token=False,
          pos_resize_mode="bilinear_corners", pos_resize_antialias=False), "Qwen3-VL-style",
     ["Conv3d over 2 frames", "RoPE (shared, θ=10000)",
      "position table resized with corners aligned"]),
    (dict(norm="rmsnorm"), "ViT", ["RMSNorm"]),
    (dict(hybrid_layers=(3, 4, 9), patch_size=16), "hybrid ViT (paper 3.1)",
     ["hybrid R50 (3,4,9) stem"]),
    (dict(hybrid_layers=(2, 2), patch_size=8), "hybrid ViT (paper 3.1)",
     ["hybrid ResNet (2,2) stem"]),
]


@pytest.mark.parametrize("fields, family, mechanisms", FAMILIES,
                         ids=[family for _, family, _ in FAMILIES])
def test_info_names_the_family_and_its_mechanisms(fields, family, mechanisms):
    from vlm_vit.cli.info import describe, family_line

    config = tiny_config(**fields)
    report = describe(config, [(32, 32)])
    assert (report["family"], report["mechanisms"]) == (family, mechanisms)
    assert family_line(config) == (f"{family}: {', '.join(mechanisms)}" if mechanisms
                                   else family)


def test_info_says_which_format_a_checkpoint_was_read_as(tmp_path, capsys):
    from tests.convert.test_hf_dinov3 import save_dinov3

    folder, _ = save_dinov3(tmp_path / "dinov3")
    assert main(["info", str(folder), "--image-size", "32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{folder}: ") and ", read as hf_dinov3\n" in out
    assert "  DINOv3-style: RoPE (shared, θ=100, at patch centres)" in out
    assert main(["info", "vit-b/16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] is None


def test_info_prints_the_family_line(tmp_path, capsys):
    VisionEncoder(tiny_config(layer_scale_init=1e-5, num_register_tokens=4)).save_pretrained(
        tmp_path)
    assert main(["info", str(tmp_path), "--image-size", "32"]) == 0
    assert "  DINOv2-style: LayerScale, 4 registers\n" in capsys.readouterr().out
    assert main(["info", "r50+vit-b/16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["family"] == "hybrid ViT (paper 3.1)"
    assert report["mechanisms"] == ["hybrid R50 (3,4,9) stem"]
    assert main(["info", "vit-b/16"]) == 0
    assert "\n  paper ViT\n" in capsys.readouterr().out


def test_info_plan_prints_tokens_and_the_predicted_peaks(tmp_path, capsys):
    """Issue 46: `--plan` prints what `vlm_vit.plan.encode_plan` predicts, per size and budget."""
    from vlm_vit.cli.info import _bytes
    from vlm_vit.plan import encode_plan

    config = tiny_config()
    VisionEncoder(config).save_pretrained(tmp_path)
    assert main(["info", str(tmp_path), "--plan", "--image-size", "32", "--image-size", "64",
                 "96", "--budget", "100", "--budget", "400", "--batch", "3"]) == 0
    out = capsys.readouterr().out
    first, second = encode_plan(config, [(32, 32), (64, 96)], budgets=[100, 400], batch=3)
    assert "  plan: batch 3, float32;" in out
    for row, size in [(first, "32x32"), (second, "64x96")]:
        plan_lines = out.split("  plan: ")[1].splitlines()
        line = next(line for line in plan_lines if line.startswith(f"  {size}  "))
        cells = [f"{plan.buffers:>8} x {_bytes(plan.peak_bytes):>11}" for plan in row.budgets]
        assert line == (f"  {size:<12}{size:<12}{row.tokens:>8}"
                        f"{_bytes(row.padded_peak_bytes):>14}" + "".join(cells)), line
    assert main(["info", str(tmp_path), "--plan", "--json", "--image-size", "64", "96",
                 "--budget", "100"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["plan"]["rows"]
    (expected,) = encode_plan(config, [(64, 96)], budgets=[100])
    assert row["tokens"] == expected.tokens == 97
    assert row["padded_peak_bytes"] == expected.padded_peak_bytes
    assert row["budgets"][0]["peak_bytes"] == expected.budgets[0].peak_bytes


def test_info_plan_reads_the_checkpoints_processor_and_says_what_it_cannot_predict(
        tmp_path, capsys):
    from vlm_vit.processor import ImageProcessor

    VisionEncoder(tiny_config()).save_pretrained(tmp_path)
    ImageProcessor(resize_mode="native", patch_multiple=8,
                   max_output_pixels=64 * 64).save_pretrained(tmp_path)
    assert main(["info", str(tmp_path), "--plan", "--image-size", "1080", "1920"]) == 0
    assert f"  {'1080x1920':<12}{'48x80':<12}{61:>8}" in capsys.readouterr().out  # 6 x 10 + 1
    window = tiny_config(window_size=2, pos_embed="none", rope_theta=100.0, class_token=False)
    VisionEncoder(window).save_pretrained(tmp_path / "window")
    assert main(["info", str(tmp_path / "window"), "--plan", "--image-size", "32",
                 "--budget", "64"]) == 0
    out = capsys.readouterr().out
    assert "  memory not predicted for window attention\n" in out
    assert "  32x32       32x32             16             -       1 x           -" in out


@pytest.mark.parametrize("argv, message", [
    (["--plan", "--image-size", "0", "32"], "image size 0x32 is not positive"),
    (["--plan", "--image-size", "-16"], "image size -16x-16 is not positive"),
    (["--plan", "--image-size", "64", "--budget", "16"],
     "an image of 64x64 takes 17 tokens, more than the budget of 16"),
    (["--plan", "--batch", "0"], "--batch must be at least 1, got 0"),
    (["--budget", "100"], "--budget, --batch and --dtype go with --plan"),
])
def test_info_plan_user_errors_are_one_line(capsys, argv, message):
    assert main(["info", "vit-b/16", *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
