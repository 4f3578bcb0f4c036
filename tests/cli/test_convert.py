import pytest
import torch

from vlm_vit import ImageProcessor, VisionEncoder, load_encoder
from vlm_vit.cli import main
from vlm_vit.cli.convert import writable_formats

from ..conftest import tiny_config


@pytest.fixture
def native(tmp_path):
    torch.manual_seed(0)
    VisionEncoder(tiny_config(pre_norm=True, patch_bias=False)).save_pretrained(  # CLIP-like
        tmp_path / "native")
    ImageProcessor.for_family("clip", size=32).save_pretrained(tmp_path / "native")
    return tmp_path / "native"


def same_weights(a, b):
    return all(torch.equal(t, b.state_dict()[n]) for n, t in a.state_dict().items())


def test_native_to_timm_and_back_is_bit_exact(tmp_path, native, capsys):
    assert main(["convert", str(native), str(tmp_path / "timm"), "--to", "timm"]) == 0
    assert main(["convert", str(tmp_path / "timm"), str(tmp_path / "back"), "--to",
                 "native"]) == 0
    original, back = load_encoder(native), load_encoder(tmp_path / "back")
    assert back.config == original.config and same_weights(original, back)
    assert ImageProcessor.from_pretrained(tmp_path / "back").mean == ImageProcessor.for_family(
        "clip").mean  # the preprocessing travelled with the weights
    assert "wrote" in capsys.readouterr().out


def test_resize_on_the_way(tmp_path, native):
    assert main(["convert", str(native), str(tmp_path / "big"), "--to", "native",
                 "--image-size", "48", "64"]) == 0
    assert load_encoder(tmp_path / "big").config.image_size == (48, 64)


def test_every_listed_family_can_be_written():
    assert {"native", "timm"} <= set(writable_formats())


@pytest.mark.parametrize("argv, message", [
    (["--to", "onnx"], "cannot write format 'onnx'"),
    (["--to", "timm", "--from", "tim"], "unknown checkpoint format 'tim'"),
])
def test_user_errors_are_one_line(tmp_path, native, capsys, argv, message):
    assert main(["convert", str(native), str(tmp_path / "out"), *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("family, destination",
                         [("hf-clip", "hf"), ("open_clip", "oc.safetensors")])
def test_clip_families_round_trip_through_the_cli(tmp_path, family, destination):
    torch.manual_seed(0)
    clip_shaped = tiny_config(pre_norm=True, act="quick_gelu", norm_eps=1e-5, patch_bias=False,
                              width=64, heads=1, mlp_width=128)
    VisionEncoder(clip_shaped).save_pretrained(tmp_path / "native")
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / destination), "--to",
                 family]) == 0
    # a bare open_clip file records neither heads nor act (vlm_vit.convert.bare)
    given = dict(heads=1, act="quick_gelu") if destination.endswith(".safetensors") else {}
    back = load_encoder(tmp_path / destination, **given)
    assert same_weights(load_encoder(tmp_path / "native"), back)
    assert back.config.act == "quick_gelu"


def user_files(folder):
    """The user's own results in `folder`, a JSON and a safetensors file among them."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "labels.json").write_text('{"cat": 0}')
    (folder / "features.safetensors").write_bytes(b"my features")
    return {name: (folder / name).read_bytes() for name in ("labels.json",
                                                           "features.safetensors")}


def test_a_folder_that_holds_no_model_is_refused_and_left_as_it_was(tmp_path, native, capsys):
    kept = user_files(tmp_path / "U")
    assert main(["convert", str(native), str(tmp_path / "U"), "--to", "native"]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'U'}" in err and "no model" in err and len(err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in (tmp_path / "U").iterdir()} == kept


def test_over_a_model_only_the_old_model_s_files_are_replaced(tmp_path, native):
    torch.manual_seed(1)
    old = tmp_path / "model"
    VisionEncoder(tiny_config(pre_norm=True, patch_bias=False)).save_pretrained(
        old, max_shard_size=20_000)  # shards and an index the new model does not write
    ImageProcessor.for_family("clip", size=32).save_pretrained(old)
    kept = user_files(old)
    assert main(["convert", str(native), str(old), "--to", "native"]) == 0
    assert {name: (old / name).read_bytes() for name in kept} == kept
    assert not list(old.glob("model-*.safetensors")) and not list(old.glob("*.index.json"))
    assert same_weights(load_encoder(native), load_encoder(old))


@pytest.mark.parametrize("inside", ["weights.safetensors", "sub/weights.safetensors"])
def test_a_destination_that_holds_its_source_is_refused(tmp_path, native, capsys, inside):
    assert main(["convert", str(native), str(tmp_path / "timm"), "--to", "timm"]) == 0
    destination = tmp_path / "D"
    assert main(["convert", str(native), str(destination), "--to", "native"]) == 0  # a model
    source = destination / inside
    source.parent.mkdir(exist_ok=True)
    source.write_bytes((tmp_path / "timm" / "model.safetensors").read_bytes())
    assert main(["convert", str(source), str(destination), "--to", "native"]) == 1
    err = capsys.readouterr().err
    assert f"DST {destination}" in err and str(source) in err
    assert source.read_bytes() == (tmp_path / "timm" / "model.safetensors").read_bytes()


def test_a_second_conversion_over_another_library_s_folder_still_works(tmp_path, native):
    for _ in range(2):  # the first output (config.json, no manifest) is a model's folder
        assert main(["convert", str(native), str(tmp_path / "timm"), "--to", "timm"]) == 0
    assert same_weights(load_encoder(native), load_encoder(tmp_path / "timm"))


def test_native_into_a_file_is_refused(tmp_path, native, capsys):
    (tmp_path / "notes").write_text("mine")
    assert main(["convert", str(native), str(tmp_path / "notes"), "--to", "native"]) == 1
    assert "is a file" in capsys.readouterr().err
    assert (tmp_path / "notes").read_text() == "mine"
