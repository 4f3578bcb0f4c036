"""timm's EVA-02 (`timm.models.eva.Eva`, eva02_tiny_patch14_224's arguments at tiny size) loads
to the same function as timm's own model: every hidden state within 1e-5 on tiny random
weights, with RoPE (interleaved pairs permuted to ours), packed SwiGLU, q/v biases without a k
bias, LayerScale, registers and separate q/k/v projections; what our block cannot hold (the
sub-LN of eva02 base/large, RoPE rescaled to another grid) is refused by name (issue 33)."""

import pytest
import torch

from vlm_vit import load_encoder
from vlm_vit.convert import detect_format
from vlm_vit.loading import read_checkpoint
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
}


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


@pytest.mark.parametrize("architecture, options, refusal", [
    ("eva02_base_patch14_224", {}, "scale_mlp=True (a norm inside SwiGLU"),
    ("eva02_base_patch16_clip_224", dict(patch_size=7), "scale_mlp=True"),
    ("eva02_tiny_patch14_224", dict(ref_feat_shape=(16, 16)),
     "scales RoPE positions to ref_feat_shape (16, 16), not its own 4x4 grid"),
])
def test_what_our_block_cannot_hold_is_refused_by_name(tmp_path, architecture, options,
                                                       refusal):
    folder, _ = save_eva(tmp_path, architecture, **options)
    with pytest.raises(ValueError, match=r"timm Eva|RoPE") as error:
        load_encoder(folder)
    assert refusal in str(error.value) and str(folder) in str(error.value)
