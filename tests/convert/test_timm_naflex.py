"""timm's NaFlexVit RADIO towers (`naflexvit_*_patch16_radio_v3/v4`) load to the same function
as timm's own model (issue 45): every hidden state, the final tokens and the pooled output
within 1e-5 on perturbed tiny weights, at the table's own grid, smaller, larger and of other
aspect ratios (RADIO's resize to the square of the longer side, top-left kept, with and
without aligned corners), and through timm's NaFlex path (pre-patchified rows of several
images, padded, with coordinates and a validity mask) against our packed forward. The summary
tokens are the prefix timm returns. Written back, timm loads the directory strictly and
computes our outputs; what our block cannot hold and hostile sizes are refused by name before a
model is built, and a bare state dict is refused naming the config it needs."""

import json

import pytest
import torch

from vlm_vit import EncoderConfig, VisionEncoder, load_encoder, load_processor, load_tower
from vlm_vit.cli.info import family_line
from vlm_vit.convert import FORMATS, detect_format
from vlm_vit.io.files import write_safetensors
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.poolers import build_pooler
from vlm_vit.testing import perturbed

from .refusals import assert_refused_before_building

timm = pytest.importorskip("timm")
timm_hub = pytest.importorskip("timm.models._hub")
naflexvit = pytest.importorskip("timm.models.naflexvit")

# A 16 x 16 table of 8-pixel patches (RADIO's is 128 x 128 of 16), head_dim 8.
TINY = dict(patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=0,
            pos_embed_grid_size=(16, 16))
VARIANTS = {
    "v3_base": ("naflexvit_base_patch16_radio_v3", {}),  # corners aligned, LayerScale, 7 regs
    "v3_large": ("naflexvit_large_patch16_radio_v3", {}),  # corners not aligned
    "v4_so400m": ("naflexvit_so400m_patch16_radio_v4", dict(mlp_ratio=100 / 32)),  # 9 regs
}
# The table's grid, smaller, larger, and of other aspect ratios (in pixels).
SIZES = ((128, 128), (64, 64), (64, 40), (40, 96), (136, 24))


def save_radio(folder, variant, **options):
    """A tiny timm RADIO of `VARIANTS` at random init (perturbed), in timm's hub layout."""
    architecture, extra = VARIANTS[variant]
    torch.manual_seed(0)
    args = {**TINY, **extra, **options}
    model = perturbed(timm.create_model(architecture, pretrained=False, **args)).eval()
    timm_hub.save_for_hf(model, str(folder), model_args=args, safe_serialization=True)
    return folder, model


def timm_states(model, x):
    """timm's tokens after the embedding and after every block, and the final tokens."""
    tokens = model.norm_pre(model.embeds(x)[0])
    states = [tokens]
    for block in model.blocks:
        tokens = block(tokens)
        states.append(tokens)
    return states, model.norm(tokens)


def assert_matches(ours, tower, model, x):
    """Every hidden state, the final tokens and the pooled output within 1e-5."""
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        states, final = timm_states(model, x)
        pooled = model.forward_head(model.forward_features(x), pre_logits=True)
        mine = tower(x)
    assert len(out.hidden_states) == len(states) == TINY["depth"] + 1
    for a, b in zip(out.hidden_states, states, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.tokens, final, atol=1e-5, rtol=0)
    torch.testing.assert_close(mine, pooled, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_hidden_state_matches_timm_at_every_size(tmp_path, variant):
    folder, model = save_radio(tmp_path, variant)
    assert detect_format(read_checkpoint(folder)).name == "timm_naflex"
    ours, tower = load_encoder(folder).eval(), load_tower(folder).eval()
    generator = torch.Generator().manual_seed(3)
    for size in SIZES:
        assert_matches(ours, tower, model, torch.randn(2, 3, *size, generator=generator))


def naflex_batch(model, images):
    """timm's NaFlex input for `images`: patchified rows padded to the longest, the (row,
    column) of each patch and which are real."""
    rows = [naflexvit.batch_patchify(image[None], model.embeds.patch_size)
            for image in images]
    longest = max(patches.shape[1] for patches, _ in rows)
    patches = torch.zeros(len(images), longest, rows[0][0].shape[-1])
    coords = torch.zeros(len(images), longest, 2, dtype=torch.long)
    valid = torch.zeros(len(images), longest, dtype=torch.bool)
    for i, (flat, (height, width)) in enumerate(rows):
        count = height * width
        patches[i, :count] = flat[0]
        row, col = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
        coords[i, :count] = torch.stack([row.flatten(), col.flatten()], dim=-1)
        valid[i, :count] = True
    return patches, coords, valid


@pytest.mark.parametrize("variant", ["v3_base", "v3_large"])
def test_timms_naflex_path_matches_our_packed_forward(tmp_path, variant):
    folder, model = save_radio(tmp_path, variant)
    ours, tower = load_encoder(folder).eval(), load_tower(folder).eval()
    generator = torch.Generator().manual_seed(5)
    images = [torch.randn(3, *size, generator=generator) for size in SIZES[1:]]
    patches, coords, valid = naflex_batch(model, images)
    prefix = ours.config.num_prefix_tokens
    with torch.no_grad():
        packed, pooled = ours(images), tower(images)
        out = model.forward_features(patches, patch_coord=coords, patch_valid=valid)
        features = out["patches"]
        heads = model.forward_head(features, patch_valid=out["patch_valid"], pre_logits=True)
    for i in range(len(images)):
        count = prefix + int(valid[i].sum())
        torch.testing.assert_close(packed.tokens[packed.offsets[i]:packed.offsets[i + 1]],
                                   features[i, :count], atol=1e-5, rtol=0)
        torch.testing.assert_close(pooled[i], heads[i], atol=1e-5, rtol=0)


def test_the_config_names_radios_mechanisms_and_its_processor(tmp_path):
    folder, model = save_radio(tmp_path / "base", "v3_base")
    config = load_encoder(folder).config
    assert (config.pos_resize_mode, config.pos_resize_antialias) == \
        ("bilinear_corners_square_crop", False)
    assert (config.image_size, config.class_token, config.num_register_tokens) == \
        ((128, 128), True, 7)  # the table's 16 x 16 grid
    assert (config.final_norm, config.layer_scale_init, config.norm_eps) == (False, 1e-5, 1e-6)
    assert family_line(config).startswith("RADIO-style: LayerScale, 7 registers")
    assert load_tower(folder).pooler.pooler_spec["name"] == "cls"  # timm's "token"
    processor = load_processor(folder)
    assert processor.size == (512, 512)  # RADIO's pretrained_cfg, not the table's size
    large, _ = save_radio(tmp_path / "large", "v3_large")
    assert load_encoder(large).config.pos_resize_mode == "bilinear_square_crop"


def test_no_pooling_gives_every_token_as_timm_does(tmp_path):
    """`global_pool=""`: timm's head returns every token, the prefix included."""
    folder, model = save_radio(tmp_path, "v3_large", global_pool="")
    tower = load_tower(folder).eval()
    x = torch.randn(2, 3, 64, 40, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = model.forward_head(model.forward_features(x), pre_logits=True)
        got = tower(x)
    assert got.shape == expected.shape == (2, 8 + 8 * 5, 32)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_the_summary_pooler_gives_radios_summary_tokens(tmp_path):
    folder, model = save_radio(tmp_path, "v3_base")
    encoder = load_encoder(folder).eval()
    summary = build_pooler("summary", in_dim=32, count=4)
    x = torch.randn(2, 3, 64, 40, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        tokens = model.forward_features(x)
        out = encoder(x)
        got = summary(out.tokens, num_prefix_tokens=8, grid=out.grid)
    torch.testing.assert_close(got, tokens[:, :4], atol=1e-5, rtol=0)
    assert summary.num_output_tokens(out.grid, num_prefix_tokens=8) == 4
    with pytest.raises(ValueError, match="reads 9 prefix tokens, but these tokens have 8"):
        build_pooler("summary", in_dim=32, count=9)(out.tokens, num_prefix_tokens=8,
                                                    grid=out.grid)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_written_back_timm_loads_it_strictly(tmp_path, variant):
    folder, _ = save_radio(tmp_path / "original", variant)
    ours, tower = load_encoder(folder).eval(), load_tower(folder).eval()
    destination = tmp_path / "written"
    FORMATS.get("timm_naflex").write(ours, destination, pooler=tower.pooler,
                                     processor=load_processor(folder))
    again = timm.create_model(f"local-dir:{destination}", pretrained=True).eval()  # strict
    x = torch.randn(2, 3, 40, 96, generator=torch.Generator().manual_seed(6))
    assert_matches(ours, tower, again, x)
    assert detect_format(read_checkpoint(destination)).name == "timm_naflex"
    reread = load_encoder(destination)
    assert reread.config == ours.config


def test_the_writer_refuses_what_naflexvit_cannot_hold_by_name(tmp_path):
    settings = dict(image_size=32, patch_size=8, width=32, depth=1, heads=4, mlp_width=64)
    with pytest.raises(ValueError, match=r"pos_resize_mode='bicubic_grid_sample'"):
        FORMATS.get("timm_naflex").write(VisionEncoder(EncoderConfig(
            **settings, pos_resize_mode="bicubic_grid_sample")), tmp_path / "o")
    encoder = VisionEncoder(EncoderConfig(**settings))  # a class position: NaFlexVit has none
    with pytest.raises(ValueError, match="its class token has a position"):
        FORMATS.get("timm_naflex").write(encoder, tmp_path / "o")
    with pytest.raises(ValueError, match=r"norm_eps=1e-05 .*needs 1e-06"):
        FORMATS.get("timm_naflex").write(VisionEncoder(EncoderConfig(
            **settings, norm_eps=1e-5)), tmp_path / "o")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("change", "named"), [
    (dict(num_heads=3), "width 32 is not divisible by heads 3"),
    (dict(num_heads=0), "model_args.num_heads"),
    (dict(embed_dim=10**6), "model_args.embed_dim is 1000000 but the weights hold 32"),
    (dict(depth=0), "model_args.depth is 0 but the weights hold 2"),
    (dict(patch_size=10**6), "model_args.patch_size"),
    (dict(pos_embed_use_grid_sample=True), "pos_embed_use_grid_sample=True (positions"),
    (dict(pos_embed_interp_mode="bicubic"), "pos_embed_interp_mode='bicubic'"),
    (dict(qk_norm=True), "qk_norm=True (q/k norms)"),
    (dict(global_pool="map"), "global_pool='map'"),
    (dict(global_pool="avg", final_norm=True), "fc_norm"),
    (dict(rope_type="axial"), "rope_type='axial' (RoPE)"),
], ids=["heads_not_dividing", "zero_heads", "huge_width", "zero_depth", "huge_patch",
        "grid_sample", "bicubic_square", "qk_norm", "map", "fc_norm", "rope"])
def test_hostile_or_unheld_model_args_are_refused_before_a_model_is_built(tmp_path, monkeypatch,
                                                                         change, named):
    folder, _ = save_radio(tmp_path, "v3_base")
    meta = json.loads((folder / "config.json").read_text())
    meta["model_args"].update(change)
    (folder / "config.json").write_text(json.dumps(meta))
    assert_refused_before_building(folder, monkeypatch, named)


def test_an_unknown_architecture_needs_its_heads_and_a_bare_state_dict_is_refused(tmp_path):
    folder, model = save_radio(tmp_path / "saved", "v3_large")
    meta = json.loads((folder / "config.json").read_text())
    meta["architecture"] = "naflexvit_base_patch16_gap"
    del meta["model_args"]["num_heads"]
    (folder / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"'naflexvit_base_patch16_gap' is not one vlm-vit "
                                         r"knows.*num_heads"):
        load_encoder(folder)
    bare = tmp_path / "bare.safetensors"
    write_safetensors(model.state_dict(), bare)
    assert detect_format(read_checkpoint(bare)).name == "timm_naflex"
    with pytest.raises(ValueError, match=r"bare timm NaFlexVit state dict.*config.json.*"
                                         r"naflexvit_base_patch16_radio_v3"):
        load_encoder(bare)
