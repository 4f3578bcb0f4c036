"""Exported graphs equal eager: torch.export and ONNX Runtime, at the export size and at
sizes never seen at export (non-square, larger and smaller grids, other batches)."""

import pytest
import torch

from vlm_vit import VisionEncoder
from vlm_vit.deploy.export import (
    ExportError,
    check_sizes,
    export_model,
    export_program,
    quantize_int8,
    token_cosine,
)
from vlm_vit.poolers import build_pooler
from vlm_vit.tower import VisionTower

from .conftest import tiny_config

SIZES = [(32, 32), (48, 24), (16, 40)]  # native grid 4x4, an enlarged and a shrunk table


def encoder(**overrides) -> VisionEncoder:
    torch.manual_seed(0)
    return VisionEncoder(tiny_config(**overrides)).eval()


def pixels(size, batch=2, seed=1):
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode, antialias", [("bicubic", True), ("bicubic", False),
                                             ("bilinear", False)])
def test_torch_export_equals_eager_at_sizes_never_seen(mode, antialias):
    model = encoder(pos_resize_mode=mode, pos_resize_antialias=antialias)
    program = export_program(model, image_size=(32, 32), dynamic=True).module()
    for batch, size in zip([2, 1, 3], SIZES, strict=True):
        x = pixels(size, batch)
        with torch.no_grad():
            torch.testing.assert_close(program(x), model(x).tokens, atol=0, rtol=0)


def test_window_attention_exports_with_a_dynamic_size():
    # Qwen2.5-VL's layout (2D RoPE, no table, windows of 2x2 patches, the last block global):
    # under a symbolic grid the windows are padded tiles (GridWindows); sizes where the
    # window divides the grid and where it cuts edge windows short, one grid of one window.
    model = encoder(pos_embed="none", class_token=False, rope_theta=10000.0,
                    rope_frequencies="shared", window_size=2, full_attention_blocks=(1,))
    program = export_program(model, image_size=(32, 32), dynamic=True).module()
    for batch, size in zip([2, 1, 3, 1], [*SIZES, (24, 40)], strict=True):
        x = pixels(size, batch)
        with torch.no_grad():  # eager: windows as segments, one SDPA per run of equal windows
            torch.testing.assert_close(program(x), model(x).tokens, atol=2e-6, rtol=2e-6)


def test_export_at_a_resized_size_still_runs_the_native_grid():
    # traced at 48x24 (a resized table), called at the native 32x32 and elsewhere
    model = encoder()
    program = export_program(model, image_size=(48, 24), dynamic=True).module()
    for size in [(32, 32), (24, 56)]:
        x = pixels(size)
        with torch.no_grad():
            torch.testing.assert_close(program(x), model(x).tokens, atol=0, rtol=0)


def test_a_python_integer_grid_fails(monkeypatch):
    """The mutation the export guards against: a grid read as Python integers (as before
    issue 32) freezes the program to the export size, and the new size is refused."""
    model = encoder()
    original = model.position_table
    monkeypatch.setattr(model, "position_table",
                        lambda grid: original(tuple(int(side) for side in grid)))
    program = export_program(model, image_size=(32, 32), dynamic=True).module()
    with pytest.raises(Exception, match="Guard failed|guard|constraint|shape"):
        program(pixels((48, 24)))


def test_feature_layer_and_tower_export():
    model = encoder()
    program = export_program(model, feature_layer=-2).module()
    x = pixels((48, 24))
    with torch.no_grad():
        torch.testing.assert_close(program(x), model(x, feature_layers=[-2]).features[0])
    tower = VisionTower(model, build_pooler("pixel_shuffle", in_dim=32, out_dim=16))
    program = export_program(tower).module()
    with torch.no_grad():
        torch.testing.assert_close(program(pixels((40, 24))), tower(pixels((40, 24))))


def test_untraceable_pooler_is_named():
    class Untraceable(torch.nn.Module):
        pooler_spec = {"name": "data_dependent"}

        def forward(self, tokens, *, num_prefix_tokens, grid):
            keep = int((tokens[0, :, 0] > 0).sum())  # a count read from the data
            return tokens[:, :keep]

    tower = VisionTower(encoder(), Untraceable())
    with pytest.raises(ExportError, match="pooler 'data_dependent' cannot be traced"):
        export_program(tower)


def test_sizes_off_the_patch_grid_are_refused():
    with pytest.raises(ExportError, match="30x32 is not on the patch grid"):
        export_program(encoder(), image_size=(30, 32))
    with pytest.raises(ExportError, match="8x32 is not on the patch grid"):
        export_program(encoder(), image_size=(8, 32))


def test_check_sizes_are_new_and_non_square():
    sizes = check_sizes(encoder(), (32, 32))
    assert sizes[0] == (32, 32) and len(set(sizes)) == 3
    assert all(h != w for h, w in sizes[1:])


def test_bfloat16_program_equals_eager_bfloat16(tmp_path):
    report = export_model(encoder(), tmp_path / "e.pt2", format="torch-export",
                          dtype=torch.bfloat16, dynamic=True)  # a torch.dtype, as every API
    assert report.dtype == "bfloat16"
    assert [c["size"] for c in report.checks] == [[32, 32], [48, 64], [16, 32]]
    assert report.max_abs_difference == 0.0
    assert min(c["cosine"] for c in report.checks) > 0.999


@pytest.mark.parametrize("format, dtype", [("onnx", "bfloat16"), ("torch-export", "int8")])
def test_format_and_dtype_that_do_not_go_together(tmp_path, format, dtype):
    with pytest.raises(ExportError, match=dtype):
        export_model(encoder(), tmp_path / "x", format=format, dtype=dtype)


@pytest.mark.parametrize("format, dtype, text", [
    ("onnx", torch.bfloat16, "bfloat16 ONNX"), ("onnx", "bf16", "bfloat16 ONNX"),
    ("torch-export", torch.int8, "int8 export is"), ("torch-export", "INT8", "int8 export is"),
])
def test_dtype_is_a_torch_dtype_or_its_usual_string(tmp_path, format, dtype, text):
    """Each spelling is read as its dtype (the format check that follows names it)."""
    with pytest.raises(ExportError, match=text):
        export_model(encoder(), tmp_path / "x", format=format, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, "float16", "double"])
def test_an_unknown_export_dtype_names_the_spellings(tmp_path, dtype):
    with pytest.raises(ExportError, match=r"unknown dtype .*known: float32/fp32, "
                                          r"bfloat16/bf16, int8"):
        export_model(encoder(), tmp_path / "x", dtype=dtype)


def test_eager_int8_quantizes_only_the_block_linears():
    tower = VisionTower(encoder(), build_pooler("mlp2x_gelu", in_dim=32, out_dim=16))
    quantized = quantize_int8(tower)
    from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

    int8 = {name for name, m in quantized.named_modules() if isinstance(m, Int8Linear)}
    assert int8 == {f"encoder.blocks.{i}.{part}" for i in range(3)
                    for part in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    assert not isinstance(tower.encoder.blocks[0].attn.qkv, Int8Linear)  # a copy
    x = pixels((32, 32))
    with torch.no_grad():
        assert token_cosine(quantized(x), tower(x)) > 0.99


# -- ONNX Runtime ---------------------------------------------------------------------------

onnx_runtime = pytest.mark.skipif(
    any(__import__("importlib").util.find_spec(m) is None
        for m in ("onnx", "onnxscript", "onnxruntime")),
    reason="onnx, onnxscript and onnxruntime are not installed")


@onnx_runtime
def test_onnx_runtime_equals_eager_at_three_sizes(tmp_path):
    report = export_model(encoder(), tmp_path / "e.onnx", format="onnx", dynamic=True)
    assert len(report.checks) == 3
    assert report.max_abs_difference < 1e-4, report.checks
    import onnx

    resize = [n for n in onnx.load(str(tmp_path / "e.onnx")).graph.node
              if n.op_type == "Resize"]
    assert resize and {a.name: a.i for a in resize[0].attribute}["antialias"] == 1


@onnx_runtime
@pytest.mark.slow
def test_onnx_int8_is_close_to_float32(tmp_path):
    report = export_model(encoder(), tmp_path / "q.onnx", format="onnx", dtype="int8")
    assert min(c["cosine"] for c in report.checks) > 0.99
    assert not (tmp_path / "q.float32.onnx").exists()


# -- accuracy of bf16 and int8 on real photos --------------------------------------------------

@pytest.fixture(scope="module")
def photos():
    """scikit-image's photos at 64 x 96, ImageNet-normalised: `[4, 3, 64, 96]`."""
    data = pytest.importorskip("skimage.data")
    from vlm_vit import ImageProcessor

    processor = ImageProcessor.for_family("imagenet", size=(64, 96))
    from PIL import Image

    images = [Image.fromarray(getattr(data, name)()) for name in
              ("astronaut", "coffee", "chelsea", "rocket")]
    return processor(images)


def photo_encoder():
    torch.manual_seed(0)
    return VisionEncoder(tiny_config(width=64, heads=4, mlp_width=256, depth=4,
                                     patch_size=16)).eval()


def test_bfloat16_and_int8_accuracy_on_photos(photos):
    """Targets of issue 32: token cosine to float32 >= 0.999 for bf16 (autocast, and bf16
    weights), >= 0.99 for int8 (block Linears)."""
    model = photo_encoder()
    with torch.no_grad():
        exact = model(photos).tokens
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(photos).tokens
        int8 = quantize_int8(model)(photos).tokens
        weights = __import__("copy").deepcopy(model).to(torch.bfloat16)
        bf16 = weights(photos.to(torch.bfloat16)).tokens
    assert token_cosine(autocast, exact) >= 0.999
    assert token_cosine(bf16, exact) >= 0.999
    assert token_cosine(int8, exact) >= 0.99
    assert token_cosine(int8, exact) < 1.0  # the quantization did act


@onnx_runtime
@pytest.mark.slow
def test_onnx_int8_accuracy_on_photos(tmp_path, photos):
    from vlm_vit.deploy.export import export_onnx, onnx_session, quantize_onnx_int8

    model = photo_encoder()
    export_onnx(model, tmp_path / "f.onnx", image_size=(64, 96), dynamic=True)
    quantize_onnx_int8(tmp_path / "f.onnx", tmp_path / "q.onnx")
    with torch.no_grad():
        exact = model(photos).tokens
    assert token_cosine(onnx_session(tmp_path / "q.onnx")(photos), exact) >= 0.99


@onnx_runtime
def test_window_attention_in_onnx_runtime_at_three_sizes(tmp_path):
    model = encoder(pos_embed="none", class_token=False, rope_theta=10000.0,
                    rope_frequencies="shared", window_size=2, full_attention_blocks=(1,))
    report = export_model(model, tmp_path / "w.onnx", format="onnx", dynamic=True)
    assert len(report.checks) == 3
    assert report.max_abs_difference < 1e-5, report.checks  # measured 1.1e-6
