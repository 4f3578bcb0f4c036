"""Hugging Face DINOv2 directories (`Dinov2Model`, `Dinov2WithRegistersModel`, SwiGLU's ViT-g
layout) load to the same function as transformers' own models: every hidden state within
1e-5 on tiny random weights, at the native size and at resized grids."""

import pytest
import torch

from vlm_vit import load_encoder, load_tower
from vlm_vit.convert import detect_format
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.testing import perturbed

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=4,
            image_size=28, patch_size=7, layerscale_value=0.5)
MODELS = {
    "dinov2": ("Dinov2Model", "Dinov2Config", {}),
    "dinov2_swiglu": ("Dinov2Model", "Dinov2Config", dict(use_swiglu_ffn=True)),
    "dinov2_registers": ("Dinov2WithRegistersModel", "Dinov2WithRegistersConfig",
                         dict(num_register_tokens=3)),
    "classifier": ("Dinov2ForImageClassification", "Dinov2Config", dict(num_labels=5)),
}
# the native grid, a non-square one of the same count (HF resizes it too), larger, smaller
SIZES = [(28, 28), (14, 56), (42, 35), (21, 21)]


@pytest.fixture(scope="module", params=sorted(MODELS))
def saved(request, tmp_path_factory):
    model_class, config_class, options = MODELS[request.param]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**TINY, **options})
    model = perturbed(getattr(transformers, model_class)(config))
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    if model_class == "Dinov2ForImageClassification":
        model = model.dinov2
    return directory, model, request.param


@pytest.mark.parametrize("size", SIZES)
def test_every_hidden_state_matches(saved, size):
    directory, model, name = saved
    assert detect_format(read_checkpoint(directory)).name == "hf_dinov2"
    ours = load_encoder(directory).eval()
    assert ours.config.layer_scale_init == 0.5
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        theirs = model(x, output_hidden_states=True)
    # transformers' hidden_states: the embeddings, then each layer (before the final norm)
    assert len(out.hidden_states) == len(theirs.hidden_states) == TINY["num_hidden_layers"] + 1
    for ours_state, their_state in zip(out.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(ours_state, their_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.tokens, theirs.last_hidden_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.cls_token, theirs.pooler_output, atol=1e-5, rtol=1e-5)


def test_the_architecture_read(saved):
    directory, _, name = saved
    config = load_encoder(directory).config
    assert config.num_register_tokens == (3 if name == "dinov2_registers" else 0)
    assert config.mlp == ("swiglu" if name == "dinov2_swiglu" else "mlp")
    # SwiGLU: two thirds of 4 x 32, rounded up to a multiple of 8 (Dinov2SwiGLUFFN)
    assert config.mlp_width == (88 if name == "dinov2_swiglu" else 128)
    # Dinov2Model resizes without antialias, the registers model with it
    assert config.pos_resize_antialias is (name == "dinov2_registers")
    tower = load_tower(directory)
    assert tower.pooler.pooler_spec["name"] == "cls"


def test_an_odd_mlp_ratio_is_refused_by_name(tmp_path):
    import json

    model = transformers.Dinov2Model(transformers.Dinov2Config(**TINY))
    model.save_pretrained(tmp_path / "d")
    path = tmp_path / "d" / "config.json"
    data = json.loads(path.read_text())
    data["mlp_ratio"] = "four"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"config.json: mlp_ratio must be a positive number"):
        load_encoder(tmp_path / "d")
