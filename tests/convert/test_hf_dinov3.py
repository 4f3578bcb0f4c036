"""Hugging Face `DINOv3ViTModel` directories load to the same function as transformers' own
model (issue 45): every hidden state, the final tokens and the pooled output within 1e-5 on
perturbed tiny weights, at the native size, at another (transformers computes DINOv3's RoPE
per grid) and packed; with the RoPE at patch centres (`rope_positions="centered"`), registers,
LayerScale, the gated MLP, and each optional bias present or absent. Written back by our
`hf_dinov3` writer, transformers loads the directory strictly and computes our outputs.
Hostile configs are refused by name before a model is built."""

import json

import pytest
import torch

from vlm_vit import EncoderConfig, VisionEncoder, load_encoder, load_tower
from vlm_vit.convert import FORMATS, detect_format
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.testing import perturbed

from .refusals import assert_refused_before_building

transformers = pytest.importorskip("transformers")

# head_dim 8: two RoPE frequencies per axis
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            image_size=32, patch_size=8)
VARIANTS = {
    # vits16's switches: q and v biases, no k bias, GELU MLP, no registers
    "plain": {},
    # vith16plus-like: SwiGLU (gated, SiLU), 3 registers, LayerScale 0.5, a 4 x 6 native grid
    "gated_registers": dict(use_gated_mlp=True, hidden_act="silu", num_register_tokens=3,
                            layerscale_value=0.5, image_size=[32, 48]),
    # every optional bias absent (zero biases here), and a k bias present, theta 1000
    "no_biases": dict(query_bias=False, value_bias=False, proj_bias=False, mlp_bias=False),
    "key_bias": dict(key_bias=True, rope_theta=1000.0, num_register_tokens=1),
}
OTHER_SIZE = (48, 24)  # a 6 x 3 grid


def save_dinov3(folder, **options):
    """A tiny DINOv3ViTModel at random init (perturbed), saved by `save_pretrained`."""
    torch.manual_seed(0)
    config = transformers.DINOv3ViTConfig(**{**TINY, **options})
    model = perturbed(transformers.DINOv3ViTModel(config))
    model.save_pretrained(folder)
    return folder, model


def assert_matches(ours, tower, model, x):
    """Every hidden state, the final tokens and the pooled output within 1e-5."""
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        theirs = model(x, output_hidden_states=True)
        pooled = tower(x)
    # transformers' hidden_states: the embeddings, then each layer (before the final norm)
    assert len(out.hidden_states) == len(theirs.hidden_states) == TINY["num_hidden_layers"] + 1
    for mine, expected in zip(out.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(mine, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.tokens, theirs.last_hidden_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled, theirs.pooler_output, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_hidden_state_matches_transformers(tmp_path, variant):
    folder, model = save_dinov3(tmp_path, **VARIANTS[variant])
    assert detect_format(read_checkpoint(folder)).name == "hf_dinov3"
    ours, tower = load_encoder(folder).eval(), load_tower(folder).eval()
    generator = torch.Generator().manual_seed(3)
    for size in (ours.config.image_size, OTHER_SIZE):
        assert_matches(ours, tower, model, torch.randn(2, 3, *size, generator=generator))


def test_packed_images_match_each_image_alone(tmp_path):
    folder, model = save_dinov3(tmp_path, **VARIANTS["gated_registers"])
    ours = load_encoder(folder).eval()
    images = [torch.randn(3, *size, generator=torch.Generator().manual_seed(5))
              for size in (OTHER_SIZE, (32, 48))]
    with torch.no_grad():
        packed = ours(images)
        expected = [model(image[None]).last_hidden_state[0] for image in images]
    for i, theirs in enumerate(expected):
        torch.testing.assert_close(packed.tokens[packed.offsets[i]:packed.offsets[i + 1]],
                                   theirs, atol=1e-5, rtol=1e-5)


def test_the_config_names_dinov3s_mechanisms(tmp_path):
    folder, _ = save_dinov3(tmp_path, **VARIANTS["gated_registers"])
    config = load_encoder(folder).config
    assert (config.rope_theta, config.rope_positions, config.rope_frequencies) == \
        (100.0, "centered", "shared")
    assert (config.pos_embed, config.num_register_tokens, config.layer_scale_init) == \
        ("none", 3, 0.5)
    assert (config.mlp, config.act, config.mlp_width, config.norm_eps) == \
        ("swiglu", "silu", 64, 1e-5)
    assert config.image_size == (32, 48)
    assert load_tower(folder).pooler.pooler_spec["name"] == "cls"


@pytest.mark.parametrize("variant", ["gated_registers", "no_biases", "key_bias"])
def test_written_back_transformers_loads_it_strictly(tmp_path, variant):
    folder, model = save_dinov3(tmp_path / "original", **VARIANTS[variant])
    ours = load_encoder(folder).eval()
    destination = tmp_path / "written"
    FORMATS.get("hf_dinov3").write(ours, destination)
    again, info = transformers.DINOv3ViTModel.from_pretrained(destination,
                                                              output_loading_info=True)
    assert all(not keys for keys in info.values()), info
    for key in ("query_bias", "key_bias", "value_bias", "proj_bias", "mlp_bias",
                "use_gated_mlp", "num_register_tokens", "rope_theta", "image_size"):
        assert getattr(again.config, key) == getattr(model.config, key), key
    x = torch.randn(2, 3, *OTHER_SIZE, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(x).last_hidden_state, ours(x).tokens,
                                   atol=1e-5, rtol=1e-5)


def test_the_writer_refuses_what_dinov3_cannot_hold_by_name(tmp_path):
    plain = VisionEncoder(EncoderConfig(image_size=32, patch_size=8, width=32, depth=1,
                                        heads=4, mlp_width=64))
    with pytest.raises(ValueError, match=r"DINOv3 .*rope_theta=None.*pos_embed='learned'"):
        FORMATS.get("hf_dinov3").write(plain, tmp_path / "out")
    indexed = VisionEncoder(EncoderConfig(image_size=32, patch_size=8, width=32, depth=1,
                                          heads=4, mlp_width=64, pos_embed="none",
                                          rope_theta=100.0))
    with pytest.raises(ValueError, match=r"rope_positions='index' \(DINOv3 needs 'centered'\)"):
        FORMATS.get("hf_dinov3").write(indexed, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hidden_size", 0, "hidden_size"),
    ("num_hidden_layers", 10**9, "num_hidden_layers"),
    ("num_attention_heads", 3, "width 32 is not divisible by heads 3"),
    ("image_size", 7 * 10**6, "image_size"),
    ("intermediate_size", 10**9, "intermediate_size"),
    ("rope_theta", -1.0, "rope_theta"),
    ("use_gated_mlp", True, "act must be 'silu'"),  # a gated GELU: no SwiGLU of ours
    ("patch_size", [8, 16], "patch_size [8, 16] is not square"),
    ("key_bias", "no", "key_bias must be true or false"),
])
def test_hostile_configs_are_refused_before_a_model_is_built(tmp_path, monkeypatch, key, value,
                                                             named):
    folder, _ = save_dinov3(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    assert_refused_before_building(folder, monkeypatch, named)


def test_a_centered_rope_without_theta_or_with_a_reference_grid_is_refused():
    with pytest.raises(ValueError, match="rope_positions 'centered'.*needs rope_theta"):
        EncoderConfig(pos_embed="none", rope_positions="centered")
    with pytest.raises(ValueError, match="no rope_reference_grid"):
        EncoderConfig(pos_embed="none", rope_theta=100.0, rope_positions="centered",
                      rope_reference_grid=(14, 14))
    with pytest.raises(ValueError, match="rope_positions 'diagonal' is not one of"):
        EncoderConfig(rope_theta=100.0, rope_positions="diagonal")
