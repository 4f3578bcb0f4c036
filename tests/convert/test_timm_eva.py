"""timm's EVA-02 (`timm.models.eva.Eva`, eva02_tiny_patch14_224's arguments at tiny size) loads
to the same function as timm's own model: every hidden state within 1e-5 on tiny random
weights, with RoPE (interleaved pairs permuted to ours), packed SwiGLU, q/v biases without a k
bias, LayerScale, registers and separate q/k/v projections, the sub-LN inside SwiGLU of eva02
base/large (`scale_mlp`, our `mlp_norm`) and RoPE positions rescaled to a reference grid (the
336/448 variants' `ref_feat_shape`, our `rope_reference_grid`), at the native size and, as
timm's `dynamic_img_size`, at another and packed; written back by our `timm_eva` writer, timm
reloads the same model. What our block cannot hold is refused by name (issue 33)."""

import json

import pytest
import torch

from vlm_vit import load_encoder
from vlm_vit.convert import FORMATS, detect_format
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.testing import perturbed

timm = pytest.importorskip("timm")
timm_hub = pytest.importorskip("timm.models._hub")

# eva02_tiny_patch14_224's registration at tiny size: a 4 x 4 grid of 7-pixel patches, the
# RoPE reference grid the model's own (as 16 x 16 is at 224 / 14).
TINY = dict(img_size=28, patch_size=7, embed_dim=32, depth=2, num_heads=2,
            ref_feat_shape=(4, 4), num_classes=0)
VARIANTS = {
    "eva02_tiny": ("eva02_tiny_patch14_224", {}),
    # LayerScale, 2 registers, q/k/v apart (eva02 base's qkv_fused=False), class-token pooling
    # with the final norm, a 4 x 6 grid (rows and columns turn differently)
    "registers_layerscale_unfused": ("eva02_tiny_patch14_224", dict(
        init_values=0.1, num_reg_tokens=2, qkv_fused=False, global_pool="token",
        img_size=(28, 42), ref_feat_shape=(4, 6))),
    # EVA-01: no RoPE, GELU MLP
    "eva_giant_shaped": ("eva_giant_patch14_224", dict(mlp_ratio=2.0)),
    # eva02 base's sub-LN: a LayerNorm on SwiGLU's hidden activation, unpacked fc1_g/fc1_x
    "scale_mlp": ("eva02_base_patch14_224", {}),
    # eva02 *_336: a 6 x 6 grid whose RoPE positions span the 4 x 4 pretraining grid
    "rope_reference": ("eva02_tiny_patch14_336", dict(img_size=42, ref_feat_shape=(4, 4))),
    # eva02 base 448 at a 6 x 4 grid: both, rows squeezed to 4, columns stretched to 6
    "scale_mlp_rope_reference": ("eva02_base_patch14_448", dict(
        img_size=(42, 28), ref_feat_shape=(4, 6))),
}
# At another size (timm's dynamic_img_size): an 8 x 5 grid, positions still spanning the
# reference grid (timm rescales from each input's own grid).
OTHER_SIZE = (56, 35)


def save_eva(folder, architecture, **options):
    """A tiny timm Eva at random init (perturbed), saved in timm's hub layout."""
    torch.manual_seed(0)
    model = perturbed(timm.create_model(architecture, pretrained=False, **{**TINY, **options}))
    timm_hub.save_for_hf(model, str(folder), model_args={**TINY, **options},
                         safe_serialization=True)
    return folder, model


def timm_states(model, x):
    """timm's tokens after the embedding and after every block, and the final tokens."""
    tokens, rope = model._pos_embed(model.patch_embed(x))
    tokens = model.norm_pre(tokens)
    states = [tokens]
    for block in model.blocks:
        tokens = block(tokens, rope=rope)
        states.append(tokens)
    return states, model.norm(tokens)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_hidden_state_matches_timm(tmp_path, variant):
    architecture, options = VARIANTS[variant]
    folder, model = save_eva(tmp_path, architecture, **options)
    assert detect_format(read_checkpoint(folder)).name == "timm_eva"
    ours = load_encoder(folder).eval()
    size = options.get("img_size", TINY["img_size"])
    size = (size, size) if isinstance(size, int) else size
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        states, final = timm_states(model, x)
    assert len(out.hidden_states) == len(states) == TINY["depth"] + 1
    for mine, expected in zip(out.hidden_states, states, strict=True):
        torch.testing.assert_close(mine, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.tokens, final, atol=1e-5, rtol=1e-5)


def test_the_config_names_eva02s_mechanisms(tmp_path):
    folder, _ = save_eva(tmp_path, "eva02_tiny_patch14_224")
    config = load_encoder(folder).config
    assert (config.rope_theta, config.rope_frequencies, config.mlp, config.act) == \
        (10000.0, "shared", "swiglu", "silu")
    assert (config.heads, config.mlp_width, config.final_norm) == (2, int(32 * 4 * 2 / 3), False)


def test_the_config_holds_the_sub_ln_and_the_reference_grid(tmp_path):
    architecture, options = VARIANTS["scale_mlp_rope_reference"]
    folder, _ = save_eva(tmp_path, architecture, **options)
    config = load_encoder(folder).config
    assert (config.mlp, config.mlp_norm, config.rope_reference_grid) == ("swiglu", True, (4, 6))
    # eva02 tiny's own grid as reference: positions i / 4 * 4, rescaled at other sizes as timm
    folder, _ = save_eva(tmp_path / "tiny", "eva02_tiny_patch14_224")
    config = load_encoder(folder).config
    assert (config.mlp_norm, config.rope_reference_grid) == (False, (4, 4))


def assert_states_match(ours, model, x):
    """Every hidden state and the final tokens of `ours` on `x` within 1e-5 of timm's."""
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        states, final = timm_states(model.eval(), x)
    for mine, expected in zip([*out.hidden_states, out.tokens], [*states, final], strict=True):
        torch.testing.assert_close(mine, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["rope_reference", "scale_mlp_rope_reference"])
def test_other_sizes_and_packed_images_match_timm_dynamic_img_size(tmp_path, variant):
    architecture, options = VARIANTS[variant]
    folder, model = save_eva(tmp_path, architecture, dynamic_img_size=True, **options)
    ours = load_encoder(folder).eval()
    x = torch.randn(2, 3, *OTHER_SIZE, generator=torch.Generator().manual_seed(4))
    assert_states_match(ours, model, x)
    # packed with an image at the native size: each image's RoPE from its own grid
    native = torch.randn(3, *ours.config.image_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        packed = ours([x[0], native])
        expected = [timm_states(model.eval(), image[None])[1][0] for image in (x[0], native)]
    offsets = packed.offsets
    for i, theirs in enumerate(expected):
        torch.testing.assert_close(packed.tokens[offsets[i]:offsets[i + 1]], theirs,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["scale_mlp", "scale_mlp_rope_reference"])
def test_written_back_timm_reloads_the_same_model(tmp_path, variant):
    architecture, options = VARIANTS[variant]
    folder, original = save_eva(tmp_path / "original", architecture, **options)
    ours = load_encoder(folder).eval()
    destination = tmp_path / "written"
    FORMATS.get("timm_eva").write(ours, destination)
    model_args = json.loads((destination / "config.json").read_text())["model_args"]
    assert model_args["scale_mlp"] is True
    assert model_args["ref_feat_shape"] == list(options.get("ref_feat_shape", (4, 4)))
    again = timm.create_model(f"local-dir:{destination}", pretrained=True)  # strict
    size = ours.config.image_size
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        for mine, theirs in zip(*(timm_states(m.eval(), x)[0] for m in (again, original)),
                                strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    dynamic = timm.create_model(f"local-dir:{destination}", pretrained=True,
                                dynamic_img_size=True)
    assert_states_match(ours, dynamic, torch.randn(1, 3, *OTHER_SIZE))


@pytest.mark.parametrize("architecture, options, refusal", [
    ("eva02_base_patch16_clip_224", dict(patch_size=7),
     "scale_attn_inner=True (a norm inside attention"),
    ("eva_giant_patch14_224", dict(scale_mlp=True),
     "scale_mlp=True and swiglu_mlp=False (a norm inside the GELU MLP)"),
])
def test_what_our_block_cannot_hold_is_refused_by_name(tmp_path, architecture, options,
                                                       refusal):
    folder, _ = save_eva(tmp_path, architecture, **options)
    with pytest.raises(ValueError, match=r"timm Eva|RoPE") as error:
        load_encoder(folder)
    assert refusal in str(error.value) and str(folder) in str(error.value)
