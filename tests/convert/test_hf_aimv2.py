"""transformers' AIMv2 vision tower (`Aimv2VisionModel`, and the vision half of `Aimv2Model`)
loads to the same function as transformers' own forward: every hidden state, the final tokens
and the attention-pooling head's output (our `attentive_probe` pooler) within 1e-5 on
perturbed tiny weights, with the learned table at the native size and the native-resolution
sin-cos table (`is_native`) at another size and packed; written back by our `hf_aimv2`
writer, transformers loads it with no missing or unexpected key and computes the same. Hostile
configs are refused before a model is built (issue 45)."""

import json

import pytest
import torch

from vlm_vit import load_encoder, load_tower
from vlm_vit.convert import FORMATS, detect_format
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.testing import perturbed

from .refusals import assert_refused_before_building

transformers = pytest.importorskip("transformers")

# aimv2-large-patch14-224's mechanisms at tiny size: a 4 x 4 grid of 7-pixel patches, SwiGLU
# 88 wide (2.75 x 32, as 2816 is of 1024).
TINY = dict(hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=2,
            image_size=28, patch_size=7)
VARIANTS = {"learned": {}, "native": dict(is_native=True),
            # every optional bias (q/k/v/out, the MLP's, the head's k/v)
            "biased": dict(qkv_bias=True, mlp_bias=True)}
OTHER_SIZE = (35, 21)  # a 5 x 3 grid: rows and columns differ


def save_aimv2(folder, **options):
    """A tiny `Aimv2VisionModel` at random init, perturbed, saved by transformers."""
    torch.manual_seed(0)
    config = transformers.Aimv2VisionConfig(**{**TINY, **options})
    model = perturbed(transformers.Aimv2VisionModel(config))
    model.save_pretrained(folder)
    return folder, model


def assert_matches(ours, tower, theirs, x):
    """Every hidden state, the final tokens and the pooled output of ours within 1e-5 of
    transformers' on `x`; returns the largest difference."""
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        expected = theirs(x, output_hidden_states=True)
        pooled = tower(x)
    pairs = [*zip(out.hidden_states, expected.hidden_states, strict=True),
             (out.tokens, expected.last_hidden_state), (pooled, expected.pooler_output)]
    assert len(out.hidden_states) == TINY["num_hidden_layers"] + 1
    for mine, reference in pairs:
        torch.testing.assert_close(mine, reference, atol=1e-5, rtol=1e-5)
    return max(float((mine - reference).abs().max()) for mine, reference in pairs)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_hidden_state_and_the_head_match_transformers(tmp_path, variant):
    folder, model = save_aimv2(tmp_path, **VARIANTS[variant])
    assert detect_format(read_checkpoint(folder)).name == "hf_aimv2"
    ours, tower = load_encoder(folder).eval(), load_tower(folder).eval()
    assert (ours.config.norm, ours.config.mlp, ours.config.patch_norm,
            ours.config.class_token) == ("rmsnorm", "swiglu", True, False)
    assert tower.pooler.pooler_spec["name"] == "attentive_probe"
    x = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    assert_matches(ours, tower, model, x)


def test_native_resolution_matches_at_another_size_and_packed(tmp_path):
    folder, model = save_aimv2(tmp_path, is_native=True)
    ours, tower = load_encoder(folder).eval(), load_tower(folder).eval()
    assert ours.config.pos_embed == "sincos" and ours.pos_embed is None
    x = torch.randn(2, 3, *OTHER_SIZE, generator=torch.Generator().manual_seed(2))
    assert_matches(ours, tower, model, x)
    native = torch.randn(3, 28, 28, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed = ours([x[0], native])
        expected = [model(image[None]).last_hidden_state[0] for image in (x[0], native)]
    for i, theirs in enumerate(expected):
        torch.testing.assert_close(packed.tokens[packed.offsets[i]:packed.offsets[i + 1]],
                                   theirs, atol=1e-5, rtol=1e-5)


def test_the_vision_half_of_an_aimv2_model_loads(tmp_path):
    torch.manual_seed(0)
    config = transformers.Aimv2Config(
        vision_config=TINY, projection_dim=16,
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, vocab_size=50, max_position_embeddings=8))
    model = perturbed(transformers.Aimv2Model(config))
    model.save_pretrained(tmp_path)
    assert detect_format(read_checkpoint(tmp_path)).name == "hf_aimv2"
    x = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(4))
    assert_matches(load_encoder(tmp_path).eval(), load_tower(tmp_path).eval(),
                   model.vision_model, x)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_written_back_transformers_loads_strictly_the_same_model(tmp_path, variant):
    folder, original = save_aimv2(tmp_path / "original", **VARIANTS[variant])
    tower = load_tower(folder).eval()
    destination = tmp_path / "written"
    FORMATS.get("hf_aimv2").write(tower.encoder, destination, pooler=tower.pooler)
    again, info = transformers.Aimv2VisionModel.from_pretrained(destination,
                                                                output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    written = json.loads((destination / "config.json").read_text())
    assert written["mlp_bias"] is (variant == "biased")
    x = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(5))
    assert_matches(tower.encoder, tower, again.eval(), x)
    assert_matches(tower.encoder, tower, original, x)


def test_written_without_a_pooler_has_no_head(tmp_path):
    folder, _ = save_aimv2(tmp_path / "original")
    FORMATS.get("hf_aimv2").write(load_encoder(folder), tmp_path / "written")
    again, info = transformers.Aimv2VisionModel.from_pretrained(tmp_path / "written",
                                                                output_loading_info=True)
    assert again.config.use_head is False and not any(info.values()), info


def refusal(tmp_path, pooler=None, **fields):
    from vlm_vit import EncoderConfig, VisionEncoder

    base = dict(image_size=28, patch_size=7, width=32, depth=1, heads=2, mlp_width=88,
                class_token=False, norm="rmsnorm", mlp="swiglu", act="silu", patch_norm=True,
                qkv_bias=False, norm_eps=1e-5)
    encoder = perturbed(VisionEncoder(EncoderConfig(**{**base, **fields})))
    with pytest.raises(ValueError) as error:
        FORMATS.get("hf_aimv2").write(encoder, tmp_path / "refused", pooler=pooler)
    assert not (tmp_path / "refused").exists()
    return str(error.value)


def test_the_writer_refuses_what_aimv2_cannot_hold_by_name(tmp_path):
    from vlm_vit.poolers import build_pooler

    message = refusal(tmp_path, class_token=True, norm="layernorm", patch_norm=False)
    assert message == ("a Hugging Face AIMv2 model cannot hold this encoder: class_token=True "
                       "(AIMv2 needs False); patch_norm=False (AIMv2 needs True); "
                       "norm='layernorm' (AIMv2 needs 'rmsnorm')")
    # perturbed: the attention output's bias is not zero, which AIMv2 ties to qkv_bias
    assert "blocks.0.attn.proj.bias is not zero" in refusal(tmp_path)
    pool = build_pooler("attention_pool", in_dim=32)
    assert "pooler 'attention_pool'" in refusal(tmp_path, pooler=pool, qkv_bias=True)
    probe = build_pooler("attentive_probe", in_dim=32, heads=4, qkv_bias=True)
    assert "pooler heads 4 (AIMv2's head needs the tower's 2)" in \
        refusal(tmp_path, pooler=probe, qkv_bias=True)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hidden_size", 0, "hidden_size"),
    ("num_hidden_layers", 10**9, "num_hidden_layers"),
    ("num_attention_heads", 3, "width 32 is not divisible by heads 3"),
    ("image_size", 7 * 10**6, "image_size"),
    ("intermediate_size", 10**9, "intermediate_size"),
    ("hidden_act", "gelu", "act must be 'silu'"),
    ("is_native", "yes", "is_native must be true or false"),
])
def test_hostile_configs_are_refused_before_a_model_is_built(tmp_path, monkeypatch, key, value,
                                                             named):
    folder, _ = save_aimv2(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    assert_refused_before_building(folder, monkeypatch, named)
