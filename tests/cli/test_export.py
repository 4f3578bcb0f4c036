import json

import pytest
import torch
from torch import nn

from vlm_vit.cli import main
from vlm_vit.model import VisionEncoder
from vlm_vit.poolers.base import POOLERS

from ..conftest import tiny_config


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    VisionEncoder(tiny_config()).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_export_prints_the_difference_at_three_sizes(tmp_path, checkpoint, capsys):
    out = tmp_path / "e.pt2"
    assert main(["export", str(checkpoint), "--format", "torch-export", "--out", str(out),
                 "--dynamic", "--feature-layer", "-2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert out.is_file() and report["dynamic"]
    assert [c["size"] for c in report["checks"]] == [[32, 32], [48, 64], [16, 32]]
    assert all(c["max_abs_difference"] == 0.0 for c in report["checks"])
    program = torch.export.load(out).module()
    encoder = VisionEncoder.from_pretrained(checkpoint).eval()
    x = torch.randn(1, 3, 24, 56)
    with torch.no_grad():
        torch.testing.assert_close(program(x), encoder(x, feature_layers=[-2]).features[0])


def test_a_frozen_size_is_checked_there_only(tmp_path, checkpoint, capsys):
    out = tmp_path / "e.pt2"
    assert main(["export", str(checkpoint), "--format", "torch-export", "--out", str(out),
                 "--image-size", "48", "24"]) == 0
    printed = capsys.readouterr().out
    assert "48x24 batch 2" in printed and "maximum difference: 0" in printed


class DataDependent(nn.Module):
    """A plugin pooler whose output length is read from the data: torch.export cannot
    trace it."""

    def __init__(self, in_dim, out_dim=None):
        super().__init__()
        self.in_dim = self.out_dim = in_dim

    def forward(self, tokens, *, num_prefix_tokens, grid):
        return tokens[:, : int((tokens[0, :, 0] > 0).sum())]

    def num_output_tokens(self, grid, *, num_prefix_tokens=0):
        return None


@pytest.mark.parametrize("argv, message", [
    (["CKPT", "--pooler", "data_dependent"],
     "the tower's pooler 'data_dependent' cannot be traced by torch.export"),
    (["CKPT", "--image-size", "30"], "image size 30x30 is not on the patch grid"),
    (["no-such/model-x"], "no-such/model-x"),
    (["vit-b/16"], "add --random-init"),
    (["CKPT", "--feature-layer", "9"], "out of range"),
])
def test_export_user_errors_are_one_line(tmp_path, checkpoint, capsys, monkeypatch, argv,
                                         message):
    monkeypatch.setitem(POOLERS._entries, "data_dependent", DataDependent)
    monkeypatch.setitem(POOLERS._sources, "data_dependent", "a test plugin")
    argv = [str(checkpoint) if a == "CKPT" else a for a in argv]
    out = tmp_path / "x.pt2"
    assert main(["export", *argv, "--format", "torch-export", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.skipif(any(__import__("importlib").util.find_spec(m) is None
                        for m in ("onnx", "onnxscript", "onnxruntime")),
                    reason="onnx, onnxscript and onnxruntime are not installed")
def test_onnx_export_of_a_tower(tmp_path, checkpoint, capsys):
    out = tmp_path / "t.onnx"
    assert main(["export", str(checkpoint), "--format", "onnx", "--out", str(out),
                 "--dynamic", "--pooler", "mlp2x_gelu", "--out-dim", "16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["checks"]) == 3
    assert max(c["max_abs_difference"] for c in report["checks"]) < 1e-4


def test_encode_dtype_int8(tmp_path, checkpoint):
    from PIL import Image
    from safetensors.torch import load_file

    Image.new("RGB", (40, 50), (200, 30, 90)).save(tmp_path / "a.png")
    for dtype in ("float32", "int8"):
        assert main(["encode", str(checkpoint), str(tmp_path / "a.png"), "-o",
                     str(tmp_path / f"{dtype}.safetensors"), "--dtype", dtype, "--quiet"]) == 0
    exact = load_file(tmp_path / "float32.safetensors")["tokens"]
    int8 = load_file(tmp_path / "int8.safetensors")["tokens"]
    assert int8.dtype == torch.float32 and not torch.equal(int8, exact)
    assert torch.nn.functional.cosine_similarity(int8, exact, dim=-1).mean() > 0.99


def test_exporting_a_classifier_says_it_exports_the_encoder_s_tokens(tmp_path, checkpoint,
                                                                      capsys):
    """Issue 47, 5: a classifier directory exports its encoder's tokens; now said."""
    from vlm_vit.adapt.finetune import ImageClassifier

    torch.manual_seed(0)
    ImageClassifier(VisionEncoder(tiny_config()), 3).save_pretrained(tmp_path / "clf")
    assert main(["export", str(tmp_path / "clf"), "--format", "torch-export", "--out",
                 str(tmp_path / "c.pt2")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"{tmp_path / 'clf'} is a classifier: exporting its encoder's tokens, "
                        "not its class scores (the head in classifier_head.safetensors is left "
                        "out)")
    assert main(["export", str(checkpoint), "--format", "torch-export", "--out",
                 str(tmp_path / "e.pt2")]) == 0
    assert "is a classifier" not in capsys.readouterr().out
