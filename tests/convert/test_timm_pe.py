"""timm's Perception Encoder towers (`vit_pe_{core,spatial,lang}_*`: `Eva` with
`attn_type="rope"`) load to the same function as timm's own model (issue 45): every hidden
state, the final tokens and the pooled output (the core towers' MAP head, the spatial towers'
mean) within 1e-5 on perturbed tiny weights, at the native size, at another (timm's
`dynamic_img_size`: the table resized, RoPE per grid) and packed; with RoPE counted from 1
(`rope_positions="one_based"`) or 0 (gigantic), "xy" or "ij" indexing, LayerScale and
registers. Written back by our `timm_pe` writer, timm loads the directory strictly and computes
our outputs. Only `timm_pe` claims them; hostile `model_args` and what our block cannot hold
are refused by name before a model is built."""

import json

import pytest
import torch

from vlm_vit import EncoderConfig, VisionEncoder, load_encoder, load_tower
from vlm_vit.convert import FORMATS, detect_format
from vlm_vit.io.files import write_safetensors
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.poolers import build_pooler
from vlm_vit.testing import perturbed

from .refusals import assert_refused_before_building

timm = pytest.importorskip("timm")
timm_hub = pytest.importorskip("timm.models._hub")

# A registration at tiny size: a 4 x 4 grid of 8-pixel patches, head_dim 8; the
# registration's own ref_feat_shape (24 or 32) stays, so positions are rescaled.
TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=0,
            dynamic_img_size=True)
VARIANTS = {
    # MAP head (8 heads), class token, offset 1, "xy", a 4 x 6 native grid
    "core": ("vit_pe_core_tiny_patch16_384", dict(img_size=(32, 48))),
    "spatial": ("vit_pe_spatial_tiny_patch16_512", {}),  # no final norm, "avg"
    # no class token, offset 0, MAP head of 2 heads, MLP ratio 8960 / 1536
    "core_gigantic": ("vit_pe_core_gigantic_patch14_448", dict(attn_pool_num_heads=2)),
    "lang_gigantic": ("vit_pe_lang_gigantic_patch14_448", {}),  # LayerScale 0.1, no norm
    # "ij" indexing, registers, class-token pooling, another temperature
    "ij_registers": ("vit_pe_spatial_small_patch16_512",
                     dict(rope_grid_indexing="ij", num_reg_tokens=2, global_pool="token",
                          rope_temperature=100.0, init_values=0.5)),
}
OTHER_SIZE = (48, 24)  # a 6 x 3 grid


def save_pe(folder, architecture, **options):
    """A tiny timm PE at random init (perturbed), saved in timm's hub layout."""
    torch.manual_seed(0)
    args = {**TINY, **options}
    model = perturbed(timm.create_model(architecture, pretrained=False, **args))
    timm_hub.save_for_hf(model, str(folder), model_args=args, safe_serialization=True)
    return folder, model


def save_variant(folder, variant):
    """`save_pe` of one of `VARIANTS`."""
    architecture, options = VARIANTS[variant]
    return save_pe(folder, architecture, **options)


def timm_states(model, x):
    """timm's tokens after the embedding and after every block, and the final tokens."""
    tokens, rope = model._pos_embed(model.patch_embed(x))
    tokens = model.norm_pre(tokens)
    states = [tokens]
    for block in model.blocks:
        tokens = block(tokens, rope=rope)
        states.append(tokens)
    return states, model.norm(tokens)


def max_differences(ours, tower, model, x):
    """The largest difference of the hidden states, the final tokens and the pooled output."""
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        states, final = timm_states(model, x)
        pooled = model.forward_head(model.forward_features(x), pre_logits=True)
        mine = tower(x)
    assert len(out.hidden_states) == len(states) == TINY["depth"] + 1
    assert mine.shape == pooled.shape
    return (max(float((a - b).abs().max()) for a, b in zip(out.hidden_states, states,
                                                           strict=True)),
            float((out.tokens - final).abs().max()), float((mine - pooled).abs().max()))


def assert_matches(ours, tower, model, x):
    """Every hidden state, the final tokens and the pooled features within 1e-5."""
    assert max(max_differences(ours, tower, model, x)) < 1e-5


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_hidden_state_matches_timm(tmp_path, variant):
    architecture, options = VARIANTS[variant]
    folder, model = save_pe(tmp_path, architecture, **options)
    assert detect_format(read_checkpoint(folder)).name == "timm_pe"
    ours, tower = load_encoder(folder).eval(), load_tower(folder).eval()
    generator = torch.Generator().manual_seed(3)
    for size in (ours.config.image_size, OTHER_SIZE):
        assert_matches(ours, tower, model, torch.randn(2, 3, *size, generator=generator))


@pytest.mark.parametrize("variant", ["core", "core_gigantic"])
def test_packed_images_match_each_image_alone(tmp_path, variant):
    architecture, options = VARIANTS[variant]
    folder, model = save_pe(tmp_path, architecture, **options)
    ours, tower = load_encoder(folder).eval(), load_tower(folder).eval()
    images = [torch.randn(3, *size, generator=torch.Generator().manual_seed(5))
              for size in (OTHER_SIZE, (32, 48), (16, 40))]
    with torch.no_grad():
        packed, pooled = ours(images), tower(images)
        for i, image in enumerate(images):
            features = model.forward_features(image[None])
            torch.testing.assert_close(packed.tokens[packed.offsets[i]:packed.offsets[i + 1]],
                                       features[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(pooled[i], model.forward_head(features, pre_logits=True)[0],
                                       atol=1e-5, rtol=1e-5)


def test_the_config_names_pes_mechanisms(tmp_path):
    architecture, options = VARIANTS["core"]
    folder, _ = save_pe(tmp_path, architecture, **options)
    config = load_encoder(folder).config
    assert (config.rope_theta, config.rope_positions, config.rope_reference_grid) == \
        (10000.0, "one_based", (24, 24))
    assert (config.pos_embed, config.pre_norm, config.patch_bias, config.norm_eps) == \
        ("learned", True, False, 1e-5)
    assert (config.class_token, config.qkv_bias, config.image_size) == (True, True, (32, 48))
    pooler = load_tower(folder).pooler
    assert pooler.pooler_spec["name"] == "attention_pool"
    assert (pooler.attn.num_heads, pooler.keep_prefix) == (8, True)
    gigantic, _ = save_variant(tmp_path / "gigantic", "core_gigantic")
    assert load_encoder(gigantic).config.rope_positions == "index"  # rope_grid_offset 0
    spatial, _ = save_variant(tmp_path / "spatial", "spatial")
    assert load_tower(spatial).pooler.pooler_spec["name"] == "mean"  # timm's "avg"


def test_only_timm_pe_claims_it_though_its_tensors_are_a_timm_vits(tmp_path):
    architecture, options = VARIANTS["core"]
    folder, _ = save_pe(tmp_path, architecture, **options)
    checkpoint = read_checkpoint(folder)
    claims = [name for name in FORMATS.names() if FORMATS.get(name).matches(checkpoint)]
    assert claims == ["timm_pe"]
    model_args = {**checkpoint.config["model_args"], "attn_type": "eva"}
    checkpoint.config = {"architecture": "vit_base_patch16_clip_224"}  # the same tensors
    assert detect_format(checkpoint).name == "timm"
    checkpoint.config = {"architecture": "vit_pe_core_base_patch16_224.fb",
                         "model_args": model_args}  # Eva's q/v biases under a PE name
    checkpoint.tensors = {**checkpoint.tensors, "blocks.0.attn.q_bias": torch.zeros(32)}
    assert detect_format(checkpoint).name == "timm_pe"  # which refuses it by name
    with pytest.raises(ValueError, match=r"attn_type='eva'"):
        FORMATS.get("timm_pe").to_native(checkpoint)


@pytest.mark.parametrize("variant", ["core", "spatial", "core_gigantic", "ij_registers"])
def test_written_back_timm_loads_it_strictly(tmp_path, variant):
    architecture, options = VARIANTS[variant]
    folder, _ = save_pe(tmp_path / "original", architecture, **options)
    ours, tower = load_encoder(folder).eval(), load_tower(folder).eval()
    destination = tmp_path / "written"
    FORMATS.get("timm_pe").write(ours, destination, pooler=tower.pooler)
    meta = json.loads((destination / "config.json").read_text())
    family = "vit_pe_core_" if tower.pooler.pooler_spec["name"] == "attention_pool" else \
        "vit_pe_spatial_"
    assert meta["architecture"].startswith(family)  # sizes in model_args
    again = timm.create_model(f"local-dir:{destination}", pretrained=True)  # strict
    x = torch.randn(2, 3, *OTHER_SIZE, generator=torch.Generator().manual_seed(6))
    assert_matches(ours, tower, again.eval(), x)
    assert detect_format(read_checkpoint(destination)).name == "timm_pe"


def test_the_writer_refuses_what_timm_pe_cannot_hold_by_name(tmp_path):
    settings = dict(image_size=32, patch_size=8, width=32, depth=1, heads=4, mlp_width=64,
                    pre_norm=True, patch_bias=False, rope_theta=10000.0,
                    rope_positions="one_based")
    with pytest.raises(ValueError, match=r"norm_eps=1e-06 .*needs 1e-05"):
        FORMATS.get("timm_pe").write(VisionEncoder(EncoderConfig(**settings)), tmp_path / "o")
    encoder = VisionEncoder(EncoderConfig(**settings, norm_eps=1e-5))
    patches_only = build_pooler("attention_pool", in_dim=32, heads=8, eps=1e-5)
    with pytest.raises(ValueError, match=r"keep_prefix=False \(timm's MAP head attends"):
        FORMATS.get("timm_pe").write(encoder, tmp_path / "o", pooler=patches_only)
    centered = VisionEncoder(EncoderConfig(**{**settings, "rope_positions": "centered"},
                                           norm_eps=1e-5))
    with pytest.raises(ValueError, match=r"rope_positions='centered' \(timm's PE needs"):
        FORMATS.get("timm_pe").write(centered, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_eva02s_writer_refuses_pes_positions_rather_than_count_them_from_0(tmp_path):
    architecture, options = VARIANTS["core"]
    folder, _ = save_pe(tmp_path / "original", architecture, **options)
    with pytest.raises(ValueError, match=r"rope_positions='one_based' \(timm's Eva needs"):
        FORMATS.get("timm_eva").write(load_encoder(folder), tmp_path / "out")


@pytest.mark.parametrize(("change", "named"), [
    (dict(num_heads=3), "width 32 is not divisible by heads 3"),
    (dict(num_heads=0), "model_args.num_heads"),
    (dict(img_size=7 * 10**6), "model_args.img_size"),
    (dict(embed_dim=10**6), "model_args.embed_dim is 1000000 but the weights hold 32"),
    (dict(depth=0), "model_args.depth is 0 but the weights hold 2"),
    (dict(rope_temperature=0), "rope_theta"),
    (dict(ref_feat_shape=[0, 10**9]), "rope_reference_grid"),
    (dict(attn_pool_num_heads=10**9), "model_args.attn_pool_num_heads is 1000000000"),
    (dict(global_pool="max"), "global_pool='max'"),
    (dict(rope_grid_offset=0.5), "rope_grid_offset=0.5"),
    (dict(rope_grid_indexing="yx"), "rope_grid_indexing='yx'"),
    (dict(rope_rotate_half=True), "rope_rotate_half=True (RoPE on rotate-half"),
    (dict(use_fc_norm=True), "use_fc_norm=True (a norm of the pooled tokens"),
    (dict(qk_norm=True), "qk_norm=True (q/k norms)"),
], ids=["heads_not_dividing", "zero_heads", "huge_image", "huge_width", "zero_depth",
        "zero_temperature", "huge_reference", "huge_pool_heads", "max_pool", "half_offset",
        "yx", "rotate_half", "fc_norm", "qk_norm"])
def test_hostile_or_unheld_model_args_are_refused_before_a_model_is_built(tmp_path, monkeypatch,
                                                                         change, named):
    folder, _ = save_variant(tmp_path, "core")
    meta = json.loads((folder / "config.json").read_text())
    meta["model_args"].update(change)
    (folder / "config.json").write_text(json.dumps(meta))
    assert_refused_before_building(folder, monkeypatch, named)


def test_a_bare_state_dict_needs_heads_or_a_registrations_sizes(tmp_path):
    folder, model = save_pe(tmp_path / "saved", "vit_pe_core_tiny_patch16_384",
                            ref_feat_shape=(4, 4))  # the registrations' own grid
    bare = tmp_path / "bare.safetensors"
    write_safetensors(model.state_dict(), bare)
    assert detect_format(read_checkpoint(bare)).name == "timm"  # a ViT's tensors alone
    with pytest.raises(ValueError, match=r"does not record heads.*pass heads=.*num_heads"):
        load_encoder(bare, format="timm_pe")
    ours = load_encoder(bare, format="timm_pe", heads=4).eval()
    tower = load_tower(bare, format="timm_pe", heads=4).eval()
    assert (ours.config.rope_reference_grid, ours.config.rope_positions) == \
        ((4, 4), "one_based")
    x = torch.randn(2, 3, *OTHER_SIZE, generator=torch.Generator().manual_seed(7))
    assert_matches(ours, tower, model, x)
