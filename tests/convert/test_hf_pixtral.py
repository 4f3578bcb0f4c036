"""Hugging Face `PixtralVisionModel` directories load to the same function as transformers'
own model: every hidden state within 1e-5 on tiny random weights, on a square and a
non-square image, and two images in one call against our packed path."""

import pytest
import torch

from vlm_vit import load_encoder, load_tower
from vlm_vit.convert import detect_format
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.testing import perturbed

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            head_dim=8, image_size=64, patch_size=8, hidden_act="silu")
SIZES = [(32, 32), (24, 56)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = perturbed(transformers.PixtralVisionModel(transformers.PixtralVisionConfig(**TINY)))
    directory = tmp_path_factory.mktemp("pixtral")
    model.save_pretrained(directory)
    return directory, model.eval()


@pytest.mark.parametrize("size", SIZES)
def test_every_hidden_state_matches(saved, size):
    directory, model = saved
    assert detect_format(read_checkpoint(directory)).name == "hf_pixtral"
    ours = load_encoder(directory).eval()
    x = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        theirs = model(x, output_hidden_states=True)
    # transformers' hidden_states: after ln_pre, then each layer (the last is the output)
    assert len(out.hidden_states) == len(theirs.hidden_states) == TINY["num_hidden_layers"] + 1
    for ours_state, their_state in zip(out.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(ours_state, their_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.tokens, theirs.last_hidden_state, atol=1e-5, rtol=1e-5)


def test_two_images_in_one_call_equal_our_packed_path(saved):
    # Pixtral packs a batch itself (one sequence, a block-diagonal mask, RoPE per image)
    directory, model = saved
    ours = load_encoder(directory).eval()
    generator = torch.Generator().manual_seed(4)
    images = [torch.randn(3, 24, 56, generator=generator), torch.randn(3, 40, 16,
                                                                       generator=generator)]
    padded = torch.zeros(2, 3, 40, 56)
    for index, image in enumerate(images):
        padded[index, :, :image.shape[1], :image.shape[2]] = image
    with torch.no_grad():
        theirs = model(padded, image_sizes=[tuple(i.shape[1:]) for i in images])
        packed = ours(images)
    torch.testing.assert_close(packed.tokens, theirs.last_hidden_state[0], atol=1e-5, rtol=1e-5)


def test_the_architecture_read(saved):
    directory, _ = saved
    config = load_encoder(directory).config
    assert (config.norm, config.mlp, config.pos_embed) == ("rmsnorm", "swiglu", "none")
    assert (config.rope_theta, config.rope_frequencies) == (10000.0, "alternating")
    assert not config.class_token and config.pre_norm and not config.final_norm
    tower = load_tower(directory)
    assert tower.pooler.pooler_spec["name"] == "mean"


@pytest.mark.parametrize("changes, message", [
    (dict(head_dim=16), r"config.json: head_dim 16 is not hidden_size 32 / num_attention_heads 4"),
    (dict(hidden_act="gelu"), r"config.json: .*act must be 'silu'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "is not axial"),
])
def test_settings_we_cannot_follow_are_refused_by_name(tmp_path, changes, message):
    import json

    transformers.PixtralVisionModel(transformers.PixtralVisionConfig(**TINY)).save_pretrained(
        tmp_path / "p")
    path = tmp_path / "p" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    with pytest.raises(ValueError, match=message):
        load_encoder(tmp_path / "p")
