"""timm's DINOv3 ViTs (`vit_*_patch16_dinov3[_qkvb]`: `Eva` with `rope_type="dinov3"`) load to
the same function as timm's own model (issue 45): every hidden state, the final tokens and the
pooled output (`global_pool` avg or token) within 1e-5 on perturbed tiny weights, at the
native size and at another (timm's `dynamic_img_size`, RoPE per grid), with q/v biases and
without, SwiGLU (`swiglu_align_to`), registers and LayerScale. Written back by our
`timm_dinov3` writer, timm loads the directory strictly and computes our outputs. Checkpoints
are told from EVA-02's and timm ViT's by exactly one format; hostile `model_args` and what our
block cannot hold are refused by name before a model is built."""

import json

import pytest
import torch

from vlm_vit import EncoderConfig, VisionEncoder, load_encoder, load_tower
from vlm_vit.convert import FORMATS, detect_format
from vlm_vit.io.files import write_safetensors
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.testing import perturbed

from .refusals import assert_refused_before_building

timm = pytest.importorskip("timm")
timm_hub = pytest.importorskip("timm.models._hub")

# A registration at tiny size: a 4 x 4 grid of 8-pixel patches, head_dim 8.
TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=0)
VARIANTS = {
    "small": ("vit_small_patch16_dinov3", {}),  # no qkv bias, GELU, 4 registers
    # q/v biases, SwiGLU aligned to 8, class-token pooling, a 4 x 6 native grid
    "small_plus_qkvb": ("vit_small_plus_patch16_dinov3_qkvb",
                        dict(global_pool="token", img_size=(32, 48))),
    # 7B's shape: SwiGLU of mlp_ratio 2 aligned to 64, no registers, another temperature
    "7b_shaped": ("vit_7b_patch16_dinov3", dict(num_reg_tokens=0, rope_temperature=1000.0)),
}
OTHER_SIZE = (48, 24)  # a 6 x 3 grid


def save_dinov3(folder, architecture, **options):
    """A tiny timm DINOv3 at random init (perturbed), saved in timm's hub layout."""
    torch.manual_seed(0)
    args = {**TINY, **options}
    model = perturbed(timm.create_model(architecture, pretrained=False, **args))
    timm_hub.save_for_hf(model, str(folder), model_args=args, safe_serialization=True)
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


def assert_matches(ours, tower, model, x):
    """Every hidden state, the final tokens and the pooled features within 1e-5."""
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        states, final = timm_states(model, x)
        pooled = model.forward_head(model.forward_features(x), pre_logits=True)
        mine = tower(x)
    assert len(out.hidden_states) == len(states) == TINY["depth"] + 1
    for ours_state, expected in zip(out.hidden_states, states, strict=True):
        torch.testing.assert_close(ours_state, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.tokens, final, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine, pooled, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_hidden_state_matches_timm(tmp_path, variant):
    architecture, options = VARIANTS[variant]
    folder, model = save_dinov3(tmp_path, architecture, **options)
    assert detect_format(read_checkpoint(folder)).name == "timm_dinov3"
    ours, tower = load_encoder(folder).eval(), load_tower(folder).eval()
    generator = torch.Generator().manual_seed(3)
    for size in (ours.config.image_size, OTHER_SIZE):
        assert_matches(ours, tower, model, torch.randn(2, 3, *size, generator=generator))


def test_the_config_names_dinov3s_mechanisms(tmp_path):
    architecture, options = VARIANTS["small_plus_qkvb"]
    folder, _ = save_dinov3(tmp_path, architecture, **options)
    config = load_encoder(folder).config
    assert (config.rope_theta, config.rope_positions, config.pos_embed) == \
        (100.0, "centered", "none")
    assert (config.mlp, config.act, config.qkv_bias, config.norm_eps) == \
        ("swiglu", "silu", True, 1e-5)
    assert (config.num_register_tokens, config.layer_scale_init, config.image_size) == \
        (4, 1e-5, (32, 48))
    assert load_tower(folder).pooler.pooler_spec["name"] == "cls"
    small, _ = save_dinov3(tmp_path / "small", "vit_small_patch16_dinov3")
    assert load_tower(small).pooler.pooler_spec["name"] == "mean"  # timm's global_pool "avg"


def test_only_timm_dinov3_claims_it_without_its_config_the_eva_reader_would(tmp_path):
    architecture, options = VARIANTS["small_plus_qkvb"]
    folder, _ = save_dinov3(tmp_path, architecture, **options)
    checkpoint = read_checkpoint(folder)
    claims = [name for name in FORMATS.names() if FORMATS.get(name).matches(checkpoint)]
    assert claims == ["timm_dinov3"]
    checkpoint.config = {"architecture": "eva02_tiny_patch14_224"}  # Eva's q/v biases alone
    assert detect_format(checkpoint).name == "timm_eva"


@pytest.mark.parametrize("variant", ["small", "small_plus_qkvb"])
def test_written_back_timm_loads_it_strictly(tmp_path, variant):
    architecture, options = VARIANTS[variant]
    folder, _ = save_dinov3(tmp_path / "original", architecture, **options)
    ours, tower = load_encoder(folder).eval(), load_tower(folder).eval()
    destination = tmp_path / "written"
    FORMATS.get("timm_dinov3").write(ours, destination, pooler=tower.pooler)
    meta = json.loads((destination / "config.json").read_text())
    assert meta["architecture"] == architecture  # the registration, sizes in model_args
    again = timm.create_model(f"local-dir:{destination}", pretrained=True)  # strict
    x = torch.randn(2, 3, *OTHER_SIZE, generator=torch.Generator().manual_seed(6))
    assert_matches(ours, tower, again.eval(), x)
    assert detect_format(read_checkpoint(destination)).name == "timm_dinov3"


def test_the_writer_refuses_what_timm_dinov3_cannot_hold_by_name(tmp_path):
    encoder = VisionEncoder(EncoderConfig(image_size=32, patch_size=8, width=32, depth=1,
                                          heads=4, mlp_width=64, pos_embed="none",
                                          rope_theta=100.0, rope_positions="centered"))
    with pytest.raises(ValueError, match=r"norm_eps=1e-06 .*needs 1e-05"):
        FORMATS.get("timm_dinov3").write(encoder, tmp_path / "out")
    encoder.config.norm_eps = 1e-5
    with torch.no_grad():
        encoder.blocks[0].attn.qkv.bias[40] = 1.0  # in the k bias, which Eva has not
    with pytest.raises(ValueError, match=r"no k bias.*blocks\.0\.attn\.qkv\.bias"):
        FORMATS.get("timm_dinov3").write(encoder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_eva02s_writer_refuses_dinov3s_rope_rather_than_write_it_at_patch_indices(tmp_path):
    encoder = VisionEncoder(EncoderConfig(image_size=32, patch_size=8, width=32, depth=1,
                                          heads=4, mlp_width=64, pos_embed="none",
                                          rope_theta=100.0, rope_positions="centered"))
    with pytest.raises(ValueError, match=r"rope_positions='centered' \(timm's Eva needs 'index'"):
        FORMATS.get("timm_eva").write(encoder, tmp_path / "out")


@pytest.mark.parametrize(("change", "named"), [
    (dict(num_heads=3), "width 32 is not divisible by heads 3"),
    (dict(num_heads=0), "model_args.num_heads"),
    (dict(img_size=7 * 10**6), "model_args.img_size"),
    (dict(embed_dim=10**6), "model_args.embed_dim is 1000000 but the weights hold 32"),
    (dict(depth=0), "model_args.depth is 0 but the weights hold 2"),
    (dict(rope_temperature=0), "rope_theta"),
    (dict(global_pool="map"), "global_pool='map'"),
    (dict(rope_rotate_half=False), "rope_rotate_half=False (RoPE on interleaved channel pairs)"),
    (dict(use_abs_pos_emb=True), "use_abs_pos_emb=True (a learned position table"),
    (dict(qk_norm=True), "qk_norm=True (q/k norms)"),
], ids=["heads_not_dividing", "zero_heads", "huge_image", "huge_width", "zero_depth",
        "zero_temperature", "map_pool", "interleaved", "abs_pos", "qk_norm"])
def test_hostile_or_unheld_model_args_are_refused_before_a_model_is_built(tmp_path, monkeypatch,
                                                                         change, named):
    folder, _ = save_dinov3(tmp_path, "vit_small_patch16_dinov3")
    meta = json.loads((folder / "config.json").read_text())
    meta["model_args"].update(change)
    (folder / "config.json").write_text(json.dumps(meta))
    assert_refused_before_building(folder, monkeypatch, named)


def test_heads_no_config_gives_are_refused_naming_num_heads(tmp_path):
    folder, model = save_dinov3(tmp_path / "saved", "vit_small_patch16_dinov3")
    (tmp_path / "custom").mkdir()
    write_safetensors(model.state_dict(), tmp_path / "custom" / "model.safetensors")
    (tmp_path / "custom" / "config.json").write_text(json.dumps(
        {"architecture": "my_dinov3", "model_args": dict(
            rope_type="dinov3", use_rot_pos_emb=True, use_abs_pos_emb=False,
            rope_rotate_half=True, use_fc_norm=False, img_size=32, rope_temperature=100)}))
    with pytest.raises(ValueError, match=r"does not record heads.*pass heads=.*num_heads"):
        load_encoder(tmp_path / "custom")
