"""Reading checkpoints safely: detection by content, clear refusals, nothing half-loaded."""

import os
import pickle
import zipfile

import pytest
import torch

from vlm_vit import VisionEncoder, load_encoder, load_tower
from vlm_vit.io.files import write_safetensors
from vlm_vit.io.loading import read_tensors, unpickling_refusal
from vlm_vit.registry import UnknownNameError

from .conftest import tiny_config


@pytest.fixture
def timm_file(tmp_path):
    """A bare timm-layout state dict, width 64 with 1 head: no known architecture's sizes, so
    every load gives heads=1 (a bare state dict does not record its heads)."""
    torch.manual_seed(0)
    encoder = VisionEncoder(tiny_config(width=64, heads=1, mlp_width=128))
    path = tmp_path / "weights.safetensors"
    write_safetensors(encoder.state_dict(), path)
    return path


def test_format_comes_from_content_not_the_name(tmp_path, timm_file):
    disguised = tmp_path / "model.npz"  # a misleading extension
    disguised.write_bytes(timm_file.read_bytes())
    assert load_encoder(disguised, heads=1).config.width == 64


def test_truncated_file_is_named(tmp_path, timm_file):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(timm_file.read_bytes()[: timm_file.stat().st_size // 2])
    with pytest.raises(ValueError, match="cut.safetensors"):
        load_encoder(cut)


def test_wrong_shape_tensor_is_listed_and_nothing_loads(tmp_path, timm_file):
    from safetensors.torch import load_file

    state = load_file(timm_file)
    state["blocks.0.mlp.fc2.weight"] = torch.zeros(64, 100)
    write_safetensors(state, tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp\.fc2\.weight \(checkpoint \[64, 100\], "
                                         r"model \[64, 128\]\)"):
        load_encoder(tmp_path / "bad.safetensors", heads=1)


class RunsCode:
    def __reduce__(self):
        return (print, ("this ran at load time",))


def test_pickle_that_runs_code_is_refused(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    torch.save({"blocks.0.attn.qkv.weight": torch.zeros(1), "payload": RunsCode()}, path)
    with pytest.raises(ValueError, match="evil.pt is a PyTorch file whose pickle needs code"):
        load_encoder(path)
    assert "this ran at load time" not in capsys.readouterr().out


class CreatesMarker:
    """Pickles as a call of `os.mkdir(marker)` (torch's unpickler blocks the whole `os`
    module, with another message than for other globals): harmless, and seen if it ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def save_payload(path, marker):
    """A `torch.save` file of real weights with a payload that would run on loading."""
    torch.save({"blocks.0.attn.qkv.weight": torch.zeros(1), "payload": CreatesMarker(marker)},
               path)
    return path


def test_a_pickle_calling_a_blocked_module_is_refused_as_needing_code(tmp_path):
    path = save_payload(tmp_path / "evil.pt", tmp_path / "ran")
    for read in (read_tensors, load_encoder):
        with pytest.raises(ValueError) as info:
            read(path)
        message = str(info.value)
        assert "evil.pt is a PyTorch file whose pickle needs code to load" in message
        assert "never ran" in message and "posix.mkdir" in message
        assert "not a readable weight file" not in message
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("message, needs_code", [
    ("Weights only load failed. In PyTorch 2.6, we changed ... trusted source.\n\n\n"
     "Trying to load unsupported GLOBAL posix.system whose module posix is blocked.\n\n"
     "Check the documentation of torch.load to learn more", True),
    ("Weights only load failed. ...\n\tWeightsUnpickler error: Unsupported global: GLOBAL "
     "builtins.print was not an allowed global by default. Please use ...", True),
    ("Weights only load failed. ...: WeightsUnpickler error: \n\nUnsupported operand 149\n\n"
     "Check the documentation", False),
])
def test_unpickling_refusal_reads_each_of_torch_s_messages(message, needs_code):
    found, reason = unpickling_refusal(pickle.UnpicklingError(message))
    assert found is needs_code
    assert reason.startswith(("Trying to load", "Unsupported"))


def test_plain_pickle_is_refused(tmp_path):
    path = tmp_path / "old.bin"
    path.write_bytes(pickle.dumps({"x": RunsCode()}))
    with pytest.raises(ValueError, match="old.bin"):
        read_tensors(path)


def test_torchscript_archive_is_refused(tmp_path):
    path = tmp_path / "ViT-B-32.pt"
    with zipfile.ZipFile(path, "w") as archive:  # the layout of a TorchScript archive
        archive.writestr("ViT-B-32/constants.pkl", b"")
        archive.writestr("ViT-B-32/code/__torch__.py", b"")
    with pytest.raises(ValueError, match="TorchScript archive"):
        load_encoder(path)


def test_unknown_content_names_the_formats(tmp_path):
    write_safetensors({"something.weight": torch.zeros(2)}, tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match=r"cannot tell the checkpoint format .* pass format= "
                                         r"one of .*timm"):
        load_encoder(tmp_path / "x.safetensors")


def test_format_override_and_unknown_format(timm_file):
    assert load_encoder(timm_file, format="timm", heads=1).config.depth == 3
    with pytest.raises(UnknownNameError, match="did you mean timm"):
        load_encoder(timm_file, format="tim")


def test_directory_without_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds none of the weight files"):
        load_encoder(tmp_path)


def test_config_override_and_resolution_change_at_load(timm_file):
    encoder = load_encoder(timm_file, heads=1, act="quick_gelu", image_size=(48, 32))
    assert encoder.config.act == "quick_gelu" and encoder.pos_embed.shape == (1, 1 + 24, 64)


def test_load_tower_needs_a_pooler_when_the_source_has_none(tmp_path):
    torch.manual_seed(0)
    VisionEncoder(tiny_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no pooling head of its own"):
        load_tower(tmp_path)
    tower = load_tower(tmp_path, "mlp2x_gelu", out_dim=16, act="quick_gelu")
    assert tower.encoder.config.act == "quick_gelu"
    assert tower(torch.randn(1, 3, 32, 32)).shape == (1, 16, 16)
