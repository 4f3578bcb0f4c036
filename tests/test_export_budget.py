"""The fixed-capacity packed program (`vlm_vit.deploy.budget_export`, `vlm-vit export
--budget N`, issue 46): one ONNX file per encoder, run in ONNX Runtime on packings of
different image counts and sizes (one image, several, a full buffer, several buffers),
equals eager `encode_budget` and the unpadded packed call within 1e-5; its graph holds no
data-dependent shape or guard; what it cannot take is refused in one line."""

import importlib.util
import json

import pytest
import torch

from vlm_vit import VisionEncoder
from vlm_vit.budget import encode_budget
from vlm_vit.cli import main
from vlm_vit.deploy.budget_export import (
    METADATA_KEY,
    BudgetForward,
    budget_inputs,
    encode_with,
    export_budget_onnx,
    export_budget_program,
    onnx_budget_session,
)
from vlm_vit.deploy.export_runtime import ExportError
from vlm_vit.testing import perturbed

from .conftest import tiny_config

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("onnx", "onnxscript", "onnxruntime")),
    reason="onnx, onnxscript and onnxruntime are not installed")

ENCODERS = {
    "class token, learned table": dict(),
    "registers, layer scale, SwiGLU, RMSNorm": dict(num_register_tokens=2,
                                                    layer_scale_init=0.1, mlp="swiglu",
                                                    act="silu", norm="rmsnorm", pre_norm=True),
    "sin-cos table, patch norm": dict(pos_embed="sincos", patch_norm=True),
    # Qwen2-VL's: 2D RoPE only, a Conv3d patch embedding over 2 frames
    "2D RoPE, temporal patches": dict(pos_embed="none", rope_theta=10000.0, class_token=False,
                                      final_norm=False, temporal_patch_size=2,
                                      patch_bias=False),
    # Qwen2.5-VL's: windows of 2x2 patches in blocks 0 and 2, block 1 global
    "2D RoPE, windows": dict(pos_embed="none", rope_theta=10000.0, class_token=False,
                             norm="rmsnorm", window_size=2, full_attention_blocks=(1,)),
}
TOKENS = 40
# The Linear on flattened patches sums in another order than the convolution, and masked
# attention over the buffer than SDPA per image: measured up to 2.4e-6 (outputs up to 3.4).
ATOL = 1e-5


def encoder(kind: str) -> VisionEncoder:
    torch.manual_seed(0)
    model = perturbed(VisionEncoder(tiny_config(**ENCODERS[kind])), scale=0.02).eval()
    model._pos_cache.clear()
    return model


def packings(prefix: int) -> dict[str, list[tuple[int, int]]]:
    """Image sizes (H, W) at patch 8 for a buffer of `TOKENS`."""
    return {
        "one image": [(24, 40)],
        "several sizes": [(16, 24), (8, 8), (32, 16), (8, 40)],
        "a full buffer": [(32, 32), (8, 8 * (TOKENS - 16 - 2 * prefix))],  # no padding
        "several buffers": [(32, 32), (40, 24), (24, 24), (16, 16)],
    }


def images(sizes, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h, w, generator=generator) for h, w in sizes]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One ONNX file per encoder kind, exported once: (encoder, session)."""
    made = {}

    def get(kind):
        if kind not in made:
            model = encoder(kind)
            path = tmp_path_factory.mktemp("budget") / "encoder.onnx"
            export_budget_onnx(model, path, tokens=TOKENS)
            made[kind] = model, onnx_budget_session(path)
        return made[kind]

    return get


@pytest.mark.parametrize("kind", ENCODERS)
def test_one_program_equals_eager_on_every_packing(kind, exported):
    model, run = exported(kind)
    seen_padding = set()
    for name, sizes in packings(model.num_prefix_tokens).items():
        pictures = images(sizes)
        with torch.no_grad():
            got = encode_with(run, model, pictures, tokens=TOKENS)
            eager = encode_budget(model, pictures, tokens=TOKENS)
            packed = model.forward_packed(pictures).split()
        assert got.buffers == eager.buffers, name
        seen_padding.update(got.padding())
        for index, (a, b, c) in enumerate(zip(got.tokens, eager.tokens, packed, strict=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=ATOL, msg=f"{name}, image {index}")
            torch.testing.assert_close(a, c.tokens[0], rtol=0, atol=ATOL,
                                       msg=f"{name}, image {index}")
    assert 0 in seen_padding and len(seen_padding) > 2  # full buffers and padded ones


def test_the_graph_has_no_data_dependent_shape_or_guard():
    # a value read from the data (`.item()`, `nonzero`, `unique`) would leave a
    # `_local_scalar_dense`, an `_assert_scalar` or an unbacked size (u0) in the graph
    for kind in ("registers, layer scale, SwiGLU, RMSNorm", "2D RoPE, windows"):
        program = export_budget_program(encoder(kind), tokens=TOKENS)
        assert program.range_constraints == {}
        targets = {str(node.target) for node in program.graph.nodes
                   if node.op == "call_function"}
        assert not {t for t in targets if any(word in t for word in (
            "_local_scalar_dense", "_assert_scalar", "constrain_range", "nonzero", "unique"))}
        for node in program.graph.nodes:  # every value a fixed shape
            values = node.meta.get("val")
            for value in values if isinstance(values, (tuple, list)) else [values]:
                if isinstance(value, torch.Tensor):
                    assert all(isinstance(d, int) for d in value.shape), node


def test_the_padding_is_its_own_segment_and_its_contents_change_nothing():
    model = encoder("class token, learned table")
    forward = BudgetForward(model)
    _, [inputs] = budget_inputs(model, images([(16, 24), (8, 8)]), tokens=TOKENS)
    padding = inputs["token_kind"] == 0
    assert padding.sum() == TOKENS - (1 + 6) - (1 + 1)
    assert inputs["segment_ids"][padding].unique().tolist() == [2]
    scribbled = dict(inputs, patches=inputs["patches"].clone(),
                     token_kind=inputs["token_kind"].clone())
    scribbled["patches"][padding] = 5.0
    scribbled["token_kind"][padding] = 1  # padding that looks like patches
    with torch.no_grad():
        clean, noisy = forward(*inputs.values()), forward(*scribbled.values())
    torch.testing.assert_close(noisy[~padding], clean[~padding], rtol=0, atol=1e-6)
    assert not torch.allclose(noisy[padding], clean[padding])


def test_the_cli_writes_the_program_and_describes_its_inputs(tmp_path, capsys):
    torch.manual_seed(0)
    VisionEncoder(tiny_config()).save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "budget.onnx"
    assert main(["export", str(tmp_path / "ckpt"), "--format", "onnx", "--budget", "30",
                 "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == 30 and len(report["checks"]) == 3
    assert max(c["max_abs_difference"] for c in report["checks"]) < ATOL
    metadata = json.loads((tmp_path / "budget.onnx.json").read_text())
    import onnxruntime

    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [(i.name, list(i.shape)) for i in session.get_inputs()] == \
        [(i["name"], i["shape"]) for i in metadata["inputs"]]
    assert json.loads(session.get_modelmeta().custom_metadata_map[METADATA_KEY]) == metadata
    model = VisionEncoder.from_pretrained(tmp_path / "ckpt").eval()
    pictures = images([(8, 16), (24, 8), (16, 16)], seed=7)  # a packing never checked
    with torch.no_grad():
        got = encode_with(onnx_budget_session(out), model, pictures, tokens=30)
        eager = encode_budget(model, pictures, tokens=30)
    for a, b in zip(got.tokens, eager.tokens, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


@pytest.mark.parametrize("overrides, argv, message", [
    (dict(hybrid_layers=(1, 1)), ["--budget", "30"], "cannot export a hybrid (ResNet stem)"),
    (dict(pos_embed="none", rope_theta=100.0), ["--budget", "30"],
     "cannot export an encoder with 2D RoPE and prefix"),
    (dict(num_register_tokens=2), ["--budget", "3"], "--budget 3 is too small"),
    (dict(), ["--budget", "30", "--dynamic"], "drop --dynamic"),
    (dict(), ["--budget", "30", "--format", "torch-export"], "use --format onnx"),
])
def test_what_it_cannot_export_is_one_line(tmp_path, capsys, overrides, argv, message):
    torch.manual_seed(0)
    VisionEncoder(tiny_config(**overrides)).save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "x.onnx"
    flags = argv if "--format" in argv else ["--format", "onnx", *argv]
    assert main(["export", str(tmp_path / "ckpt"), *flags, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not (tmp_path / "x.onnx.json").exists()


def test_the_library_refuses_in_the_same_words():
    with pytest.raises(ExportError, match="hybrid"):
        BudgetForward(VisionEncoder(tiny_config(hybrid_layers=(1, 1))))
    with pytest.raises(ExportError, match="too small"):
        export_budget_program(encoder("class token, learned table"), tokens=1)
