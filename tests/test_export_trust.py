"""What `vlm-vit export` promises beyond equal numbers (issue 40, issue 47 item 7): it never
deletes or half-writes a user's files, refuses bad options in one line, refuses an image off
the patch grid in every runtime, and names the ONNX dims."""

import importlib.util
import os

import pytest
import torch

from vlm_vit import VisionEncoder
from vlm_vit.cli import main
from vlm_vit.deploy.export import export_model, export_onnx

from .conftest import tiny_config

onnx_runtime = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("onnx", "onnxscript", "onnxruntime")),
    reason="onnx, onnxscript and onnxruntime are not installed")


def encoder() -> VisionEncoder:
    torch.manual_seed(0)
    return VisionEncoder(tiny_config()).eval()  # patch 8, native 32 x 32


@pytest.fixture
def checkpoint(tmp_path):
    encoder().save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def one_line_error(capsys, *fragments) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err
    return err


def failing_write(exception: Exception):
    """A writer that leaves half a file at its destination and fails (a full disk)."""
    def write(program, destination, *args, **kwargs):  # torch.export.save, ONNXProgram.save
        with open(destination, "wb") as file:
            file.write(b"half a file")
        raise exception
    return write


# -- item 1: int8's intermediate never touches the user's files -------------------------------

@onnx_runtime
def test_int8_export_keeps_a_users_float32_file_beside_the_output(tmp_path, checkpoint):
    out = tmp_path / "out"
    out.mkdir()
    users = {"enc.float32.onnx": b"the user's own model", "enc.float32.onnx.data": b"weights"}
    for name, content in users.items():
        (out / name).write_bytes(content)
    assert main(["export", str(checkpoint), "--format", "onnx", "--dtype", "int8",
                 "--out", str(out / "enc.onnx")]) == 0
    assert {name: (out / name).read_bytes() for name in users} == users
    assert sorted(os.listdir(out)) == ["enc.float32.onnx", "enc.float32.onnx.data", "enc.onnx"]


# -- item 2: every file output is renamed into place only when complete -----------------------

def test_a_torch_export_that_fails_while_writing_keeps_the_earlier_program(
        tmp_path, checkpoint, monkeypatch, capsys):
    out = tmp_path / "enc.pt2"
    out.write_bytes(b"a good earlier program")
    monkeypatch.setattr(torch.export, "save", failing_write(OSError(28, "No space left")))
    assert main(["export", str(checkpoint), "--format", "torch-export", "--out",
                 str(out)]) == 1
    one_line_error(capsys, "No space left")
    assert out.read_bytes() == b"a good earlier program"
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "enc.pt2"]


@onnx_runtime
def test_onnx_with_external_data_is_written_whole_and_names_its_data(tmp_path, monkeypatch):
    import onnx
    from torch.onnx import ONNXProgram

    import vlm_vit.deploy.export

    monkeypatch.setattr(vlm_vit.deploy.export, "PROTOBUF_LIMIT", 0)  # weights beside the file
    out = tmp_path / "enc.onnx"
    earlier = {"enc.onnx": b"an earlier model", "enc.onnx.data": b"its weights"}
    for name, content in earlier.items():
        (tmp_path / name).write_bytes(content)
    with monkeypatch.context() as patch:
        patch.setattr(ONNXProgram, "save", failing_write(OSError(28, "No space left")))
        with pytest.raises(OSError, match="No space left"):
            export_onnx(encoder(), out)
    assert {name: (tmp_path / name).read_bytes() for name in earlier} == earlier
    assert sorted(os.listdir(tmp_path)) == ["enc.onnx", "enc.onnx.data"]

    report = export_model(encoder(), out, format="onnx", dynamic=True)
    assert report.max_abs_difference < 1e-4
    assert sorted(os.listdir(tmp_path)) == ["enc.onnx", "enc.onnx.data"]
    model = onnx.load(str(out), load_external_data=False)
    locations = {entry.value for tensor in model.graph.initializer
                 for entry in tensor.external_data if entry.key == "location"}
    assert locations == {"enc.onnx.data"}


# -- item 3: one clear line for an output that is a folder and for --max-side -----------------

def test_an_output_that_is_a_directory_is_refused_naming_it(tmp_path, checkpoint, capsys):
    folder = tmp_path / "exports"
    folder.mkdir()
    (folder / "keep.txt").write_text("the user's")
    assert main(["export", str(checkpoint), "--format", "torch-export", "--out",
                 str(folder)]) == 1
    one_line_error(capsys, f"the output {folder} is a directory")
    assert os.listdir(folder) == ["keep.txt"]


@pytest.mark.parametrize("max_side", ["0", "-1", "16"])
def test_max_side_too_small_is_one_line_naming_the_smallest(tmp_path, checkpoint, capsys,
                                                            max_side):
    out = tmp_path / "e.pt2"
    assert main(["export", str(checkpoint), "--format", "torch-export", "--out", str(out),
                 "--dynamic", "--max-side", max_side]) == 1
    one_line_error(capsys, f"--max-side {max_side} is too small", "patch size 8",
                   "smallest allowed is 32")
    assert not out.exists()


def test_the_smallest_max_side_exports(tmp_path):
    # 3 patches is the least torch.export takes for a dynamic side; the checks stay within it
    report = export_model(encoder(), tmp_path / "e.pt2", format="torch-export",
                          image_size=(24, 24), max_side=24)
    assert report.max_abs_difference == 0.0
    assert max(max(check["size"]) for check in report.checks) <= 24


# -- item 4: a dynamic program never computes on an image off the patch grid ------------------

@onnx_runtime
def test_dynamic_onnx_refuses_an_image_off_the_patch_grid(tmp_path):
    import onnxruntime

    from vlm_vit.deploy.export import onnx_session

    model = encoder()
    path = export_onnx(model, tmp_path / "e.onnx", dynamic=True)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    off_grid = torch.randn(1, 3, 36, 44).numpy()
    with pytest.raises(Exception, match="Reshape|reshape"):  # the graph's own check
        session.run(None, {"pixel_values": off_grid})
    with pytest.raises(ValueError, match="image size 36x44 is not a positive multiple of the "
                                         "patch size 8"):
        onnx_session(path)(torch.randn(1, 3, 36, 44))
    x = torch.randn(2, 3, 40, 48)  # on the grid: as eager
    with torch.no_grad():
        torch.testing.assert_close(onnx_session(path)(x), model(x).tokens, atol=1e-4, rtol=0)


def test_a_saved_program_refuses_an_image_off_the_patch_grid(tmp_path):
    model = encoder()
    from vlm_vit.deploy.export import load_program

    export_model(model, tmp_path / "e.pt2", format="torch-export")
    run = load_program(tmp_path / "e.pt2")
    with pytest.raises(ValueError, match="image size 36x44 is not a positive multiple of the "
                                         "patch size 8"):
        run(torch.randn(1, 3, 36, 44))
    x = torch.randn(1, 3, 40, 48)
    with torch.no_grad():
        torch.testing.assert_close(run(x), model(x).tokens, atol=0, rtol=0)


# -- issue 47 item 7: the ONNX dims carry names -------------------------------------------------

@onnx_runtime
def test_onnx_dims_are_named(tmp_path):
    import onnx

    path = export_onnx(encoder(), tmp_path / "e.onnx", dynamic=True)
    graph = onnx.load(str(path)).graph

    def dims(value):
        return [dim.dim_param or dim.dim_value for dim in value.type.tensor_type.shape.dim]

    assert dims(graph.input[0]) == ["batch", 3, "height", "width"]
    assert dims(graph.output[0]) == ["batch", "tokens", 32]
