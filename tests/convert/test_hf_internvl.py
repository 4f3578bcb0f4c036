"""transformers' InternVL vision tower (`InternVLVisionModel`) loads to the same function as
transformers' own forward: every hidden state and the final tokens within 1e-5 on perturbed
tiny weights, at the native size and at another size (the position table resized); written
back by our `hf_internvl` writer, transformers loads it with no missing or unexpected key and
computes the same. What our block cannot hold (InternViT-6B's q/k norms) and hostile configs
are refused before a model is built (issue 45)."""

import json

import pytest
import torch

from vlm_vit import load_encoder, load_tower
from vlm_vit.convert import FORMATS, detect_format
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.testing import perturbed

from .refusals import assert_refused_before_building

transformers = pytest.importorskip("transformers")

# InternViT-300M's mechanisms at tiny size: a 4 x 4 grid of 7-pixel patches.
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            image_size=28, patch_size=7)
VARIANTS = {"released": {},  # LayerNorm, no q/k/v bias, no final norm (use_mean_pooling)
            "biased_final_norm": dict(attention_bias=True, use_mean_pooling=False),
            "rms_norm": dict(norm_type="rms_norm", use_mask_token=True)}
OTHER_SIZE = (35, 21)  # a 5 x 3 grid: rows and columns differ


def save_internvl(folder, **options):
    """A tiny `InternVLVisionModel` at random init, every parameter perturbed, saved by
    transformers."""
    torch.manual_seed(0)
    config = transformers.InternVLVisionConfig(**{**TINY, **options})
    model = perturbed(transformers.InternVLVisionModel(config)).eval()
    model.save_pretrained(folder)
    return folder, model


def assert_matches(ours, theirs, x):
    """Every hidden state and the final tokens of ours within 1e-5 of transformers' on `x`;
    returns the largest difference of each."""
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        expected = theirs(x, output_hidden_states=True)
    pairs = [*zip(out.hidden_states, expected.hidden_states, strict=True),
             (out.tokens, expected.last_hidden_state)]
    assert len(out.hidden_states) == TINY["num_hidden_layers"] + 1
    for mine, reference in pairs:
        torch.testing.assert_close(mine, reference, atol=1e-5, rtol=1e-5)
    return [float((mine - reference).abs().max()) for mine, reference in pairs]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_hidden_state_matches_transformers_at_two_sizes(tmp_path, variant):
    folder, model = save_internvl(tmp_path, **VARIANTS[variant])
    assert detect_format(read_checkpoint(folder)).name == "hf_internvl"
    ours = load_encoder(folder).eval()
    hf = {**TINY, **VARIANTS[variant]}
    assert (ours.config.class_token, ours.config.qkv_bias, ours.config.final_norm) == \
        (True, hf.get("attention_bias", False), not hf.get("use_mean_pooling", True))
    assert ours.config.layer_scale_init is not None
    for seed, size in ((1, (28, 28)), (2, OTHER_SIZE)):
        x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(seed))
        assert_matches(ours, model, x)


def test_the_pooler_is_the_one_the_config_documents(tmp_path):
    folder, model = save_internvl(tmp_path)  # use_mean_pooling: the mean of the patch tokens
    tower = load_tower(folder).eval()
    assert tower.pooler.pooler_spec["name"] == "mean"
    x = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(tower(x), model(x).last_hidden_state[:, 1:].mean(1),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_written_back_transformers_loads_strictly_the_same_model(tmp_path, variant):
    folder, original = save_internvl(tmp_path / "original", **VARIANTS[variant])
    tower = load_tower(folder).eval()
    destination = tmp_path / "written"
    FORMATS.get("hf_internvl").write(tower.encoder, destination, pooler=tower.pooler)
    again, info = transformers.InternVLVisionModel.from_pretrained(destination,
                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for seed, size in ((5, (28, 28)), (6, OTHER_SIZE)):
        x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(seed))
        assert_matches(tower.encoder, again.eval(), x)
        assert_matches(tower.encoder, original, x)


def refusal(tmp_path, **fields):
    from vlm_vit import EncoderConfig, VisionEncoder

    base = dict(image_size=28, patch_size=7, width=32, depth=1, heads=2, mlp_width=64,
                layer_scale_init=0.1)
    encoder = perturbed(VisionEncoder(EncoderConfig(**{**base, **fields})))
    with pytest.raises(ValueError) as error:
        FORMATS.get("hf_internvl").write(encoder, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    return str(error.value)


def test_the_writer_refuses_what_internvl_cannot_hold_by_name(tmp_path):
    message = refusal(tmp_path, pre_norm=True, patch_bias=False, num_register_tokens=2)
    assert message == ("a Hugging Face InternVL model cannot hold this encoder: "
                       "num_register_tokens=2 (InternVL needs 0); pre_norm=True (InternVL needs "
                       "False); patch_bias=False (InternVL needs True)")
    assert "final_norm=True with norm='rmsnorm'" in refusal(tmp_path, norm="rmsnorm")
    assert "pos_embed='sincos'" in refusal(tmp_path, pos_embed="sincos")


def test_an_encoder_without_layer_scale_is_written_with_scales_of_one(tmp_path):
    from vlm_vit import EncoderConfig, VisionEncoder

    encoder = perturbed(VisionEncoder(EncoderConfig(
        image_size=28, patch_size=7, width=32, depth=2, heads=2, mlp_width=64))).eval()
    FORMATS.get("hf_internvl").write(encoder, tmp_path / "written")
    again, info = transformers.InternVLVisionModel.from_pretrained(tmp_path / "written",
                                                                   output_loading_info=True)
    assert not any(info.values()), info
    x = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(7))
    assert_matches(encoder, again.eval(), x)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("use_qk_norm", True, "use_qk_norm"),
    ("norm_type", "batch_norm", "norm_type 'batch_norm'"),
    ("use_mean_pooling", "yes", "use_mean_pooling must be true or false"),
    ("patch_size", [7, 14], "patch_size [7, 14] is not square"),
    ("image_size", [28, 56], "image_size [28, 56] is not square"),
    ("hidden_size", 0, "hidden_size"),
    ("num_hidden_layers", 10**9, "num_hidden_layers"),
    ("num_attention_heads", 3, "width 32 is not divisible by heads 3"),
    ("image_size", 7 * 10**6, "image_size"),
    ("intermediate_size", 10**9, "intermediate_size"),
    ("hidden_act", "relu6", "hidden_act 'relu6'"),
])
def test_hostile_configs_are_refused_before_a_model_is_built(tmp_path, monkeypatch, key, value,
                                                             named):
    folder, _ = save_internvl(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    assert_refused_before_building(folder, monkeypatch, named)


def test_rms_norm_with_a_final_layer_norm_is_refused(tmp_path, monkeypatch):
    folder, _ = save_internvl(tmp_path, norm_type="rms_norm", use_mean_pooling=False)
    assert_refused_before_building(folder, monkeypatch, "norm_type 'rms_norm' with "
                                   "use_mean_pooling false")
