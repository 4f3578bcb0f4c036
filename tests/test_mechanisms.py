"""The encoder's mechanisms beyond the paper's block (issue 33): LayerScale, RMSNorm, SwiGLU,
registers, the hybrid ResNet patch embedding, 2D RoPE (without a position table) and window
attention, each a
validated config field whose default is the paper's ViT. Every one keeps packing,
`feature_layers`' early stop, explicit attention maps, save/load, LoRA presets and export
working."""

import pytest
import torch

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.config import ConfigError
from vlm_vit.layers.hybrid_stem import HybridPatchEmbed
from vlm_vit.layers.layer_scale import LayerScale
from vlm_vit.layers.rms_norm import RMSNorm
from vlm_vit.layers.swiglu import SwiGLU
from vlm_vit.testing import perturbed

from .conftest import tiny_config

MECHANISMS = {
    "layer_scale": dict(layer_scale_init=0.1),
    "rmsnorm": dict(norm="rmsnorm", pre_norm=True),
    "swiglu": dict(mlp="swiglu", act="silu"),
    "dinov2_registers": dict(layer_scale_init=1e-5, num_register_tokens=2),
    # two ResNet stages: stride 8, the tiny config's patch size
    "hybrid": dict(hybrid_layers=(1, 1)),
    "all_but_hybrid": dict(layer_scale_init=0.1, norm="rmsnorm", mlp="swiglu", act="silu",
                           num_register_tokens=2),
    # Qwen2-VL's tower: RoPE only, no class token, no final norm
    "rope": dict(pos_embed="none", rope_theta=10000.0, class_token=False, final_norm=False),
    # Pixtral's frequencies; a class token (not rotated) beside RoPE and a learned table
    "rope_alternating_cls": dict(rope_theta=100.0, rope_frequencies="alternating"),
    # and its Conv3d patch embedding over 2 frames
    "qwen2_vl": dict(pos_embed="none", rope_theta=10000.0, class_token=False,
                     final_norm=False, temporal_patch_size=2, patch_bias=False),
    # Qwen2.5-VL's: RMSNorm, SwiGLU, 2x2-patch windows in blocks 0 and 2, block 1 global
    "qwen2_5_vl": dict(pos_embed="none", rope_theta=10000.0, class_token=False,
                       final_norm=False, temporal_patch_size=2, patch_bias=False,
                       norm="rmsnorm", mlp="swiglu", act="silu", window_size=2,
                       full_attention_blocks=(1,)),
}
SIZES = [(24, 24), (40, 16), (32, 32)]  # a multiple of 8: the hybrid's stride too


def encoder_for(name: str) -> VisionEncoder:
    torch.manual_seed(0)
    encoder = perturbed(VisionEncoder(tiny_config(**MECHANISMS[name])), scale=0.02)
    encoder._pos_cache.clear()
    return encoder


def images(sizes=SIZES):
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(3, h, w, generator=generator) for h, w in sizes]


def test_defaults_are_the_papers_block():
    encoder = VisionEncoder(tiny_config())
    kinds = {type(m) for m in encoder.modules()}
    assert not kinds & {LayerScale, RMSNorm, SwiGLU, HybridPatchEmbed}
    assert isinstance(encoder.blocks[0].ls1, torch.nn.Identity)
    assert not any(".ls" in name or "backbone" in name for name in encoder.state_dict())


def test_each_mechanism_is_the_module_it_names():
    blocks = {name: encoder_for(name).blocks[0] for name in MECHANISMS}
    assert isinstance(blocks["layer_scale"].ls1, LayerScale)
    assert torch.equal(VisionEncoder(tiny_config(layer_scale_init=0.1)).blocks[1].ls2.gamma,
                       torch.full((32,), 0.1))
    assert isinstance(blocks["rmsnorm"].norm1, RMSNorm)
    assert isinstance(encoder_for("rmsnorm").norm_pre, RMSNorm)
    assert isinstance(encoder_for("rmsnorm").norm, RMSNorm)
    assert isinstance(blocks["swiglu"].mlp, SwiGLU)
    assert isinstance(blocks["swiglu"].mlp.act, torch.nn.SiLU)
    hybrid = encoder_for("hybrid")
    assert isinstance(hybrid.patch_embed, HybridPatchEmbed) and hybrid.patch_embed.patch_size == 8


def test_layer_scale_scales_each_branch():
    encoder = encoder_for("layer_scale")
    block = encoder.blocks[0]
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        x1 = x + block.ls1.gamma * block.attn(block.norm1(x))[0]
        expected = x1 + block.ls2.gamma * block.mlp(block.norm2(x1))
        torch.testing.assert_close(block(x)[0], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_packing_features_and_maps(name):
    encoder = encoder_for(name)
    pictures = images()
    with torch.no_grad():
        packed = encoder(pictures, output_hidden_states=True, output_attentions=True).split()
        for image, part in zip(pictures, packed, strict=True):
            alone = encoder(image[None], output_hidden_states=True, output_attentions=True)
            fast = encoder(image[None])
            torch.testing.assert_close(part.tokens, alone.tokens, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(alone.tokens, fast.tokens, atol=1e-5, rtol=1e-5)
            for ours, theirs in zip(part.attentions, alone.attentions, strict=True):
                torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
            early = encoder(image[None], feature_layers=[1])
            assert early.tokens is None  # stopped after block 1
            hidden = encoder(image[None], output_hidden_states=True).hidden_states[1]
            torch.testing.assert_close(early.features[0], hidden, atol=0, rtol=0)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_save_and_load(tmp_path, name):
    encoder = encoder_for(name)
    encoder.save_pretrained(tmp_path / name, model_card=False)
    loaded = VisionEncoder.from_pretrained(tmp_path / name).eval()
    assert loaded.config == encoder.config
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x).tokens, encoder(x).tokens)


@pytest.mark.parametrize("name", ["all_but_hybrid", "hybrid", "rope", "qwen2_vl"])
def test_export_with_a_dynamic_size(name):
    from vlm_vit.deploy.export import export_program

    encoder = encoder_for(name)
    program = export_program(encoder, image_size=(32, 32), dynamic=True).module()
    for size in [(32, 32), (48, 24)]:
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            torch.testing.assert_close(program(x), encoder(x).tokens, atol=1e-5, rtol=1e-5)


def test_lora_presets_find_swiglus_projections():
    pytest.importorskip("peft")
    from vlm_vit.adapt.lora import apply_lora

    encoder = encoder_for("swiglu")
    names = {"mlp": {"mlp.fc1_g", "mlp.fc1_x", "mlp.fc2"},
             "all": {"attn.qkv", "attn.proj", "mlp.fc1_g", "mlp.fc1_x", "mlp.fc2"}}
    for preset, expected in names.items():
        model = apply_lora(encoder_for("swiglu"), targets=preset)
        wrapped = {name.split("blocks.0.", 1)[1].removesuffix(".lora_A.default")
                   for name, _ in model.named_modules()
                   if "blocks.0." in name and name.endswith(".lora_A.default")}
        assert wrapped == expected, preset
    del encoder


def test_hybrid_variant_is_timms_r50_vit_b_16_at_384():
    config = EncoderConfig.from_name("r50+vit-b/16")
    assert config.hybrid_layers == (3, 4, 9) and config.patch_size == 16
    assert config.image_size == (384, 384) and config.grid == (24, 24)
    assert EncoderConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["hybrid_layers"] == [3, 4, 9]  # JSON's list, read back as a tuple


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_config_stride_is_the_backbones(stages):
    from vlm_vit.config import hybrid_stride

    with torch.device("meta"):
        assert HybridPatchEmbed(32, layers=(1,) * stages).patch_size == hybrid_stride((1,) * stages)


@pytest.mark.parametrize("changes, message", [
    (dict(layer_scale_init=0), "layer_scale_init must be null or a finite number > 0, got 0"),
    (dict(layer_scale_init=-1e-5), "layer_scale_init must be null or a finite number > 0"),
    (dict(layer_scale_init=float("nan")), "layer_scale_init"),
    (dict(layer_scale_init="1e-5"), "layer_scale_init"),
    (dict(layer_scale_init=True), "layer_scale_init"),
    (dict(norm="batchnorm"), "norm 'batchnorm' is not one of layernorm, rmsnorm"),
    (dict(mlp="geglu"), "mlp 'geglu' is not one of mlp, swiglu"),
    (dict(mlp="swiglu"), "mlp 'swiglu' gates with SiLU: act must be 'silu', got 'gelu'"),
    (dict(hybrid_layers=(3, 4, 9)), r"hybrid_layers \(3, 4, 9\) make a ResNet of stride 16: "
                                    r"patch_size must be 16, got 8"),
    (dict(hybrid_layers=(3, 4, 9), patch_size=14, image_size=224),
     "stride 16: patch_size must be 16, got 14"),
    (dict(hybrid_layers=()), "hybrid_layers must be null or 1 to 4 block counts"),
    (dict(hybrid_layers=(1, 1, 1, 1, 1)), "hybrid_layers must be null or 1 to 4"),
    (dict(hybrid_layers=(1, 0)), "hybrid_layers"),
    (dict(hybrid_layers=3), "hybrid_layers"),
    (dict(hybrid_layers=(1, 65)), "hybrid_layers"),
    (dict(pos_embed="fourier"), "pos_embed 'fourier' is not one of learned, sincos, none"),
    (dict(rope_theta=0), "rope_theta must be null or a finite number > 0, got 0"),
    (dict(rope_theta="1e4"), "rope_theta"),
    (dict(rope_theta=float("inf")), "rope_theta"),
    (dict(rope_theta=1e4, rope_frequencies="interleaved"),
     "rope_frequencies 'interleaved' is not one of shared, alternating"),
    (dict(rope_theta=1e4, width=24, heads=4),
     r"2D RoPE needs a head dimension divisible by 4 .*width 24 / heads 4 = 6"),
    (dict(rope_theta=1e4, width=32, heads=16), r"width 32 / heads 16 = 2$"),
    (dict(temporal_patch_size=0), r"temporal_patch_size must be a positive int \(1..16\)"),
    (dict(temporal_patch_size=2.0), "temporal_patch_size"),
    (dict(temporal_patch_size=2, hybrid_layers=(1, 1)),
     "temporal_patch_size and hybrid_layers are two patch embeddings"),
    (dict(window_size=5, class_token=False),
     "window_size 5 patches is larger than the 4x4 patch grid at image_size 32x32"),
    (dict(window_size=0, class_token=False), r"window_size must be a positive int \(1..4\)"),
    (dict(window_size=2), "a class or register token lies in no window"),
    (dict(window_size=2, class_token=False, num_register_tokens=1), "register token"),
    (dict(full_attention_blocks=(1,)), "full_attention_blocks needs window_size"),
    (dict(window_size=2, class_token=False, full_attention_blocks=(3,)),
     r"full_attention_blocks must be distinct block indices in 0..2, got \(3,\)"),
    (dict(window_size=2, class_token=False, full_attention_blocks=(1, 1)),
     "full_attention_blocks"),
])
def test_bad_mechanism_configs_are_one_clear_error(changes, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(**changes)


def test_bad_mechanism_in_a_config_file_names_the_file(tmp_path):
    import json

    from vlm_vit import load_encoder

    VisionEncoder(tiny_config()).save_pretrained(tmp_path / "tiny", model_card=False)
    path = tmp_path / "tiny" / "config.json"
    data = json.loads(path.read_text())
    data["encoder"]["norm"] = "groupnorm"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"config.json.*norm 'groupnorm' is not one of"):
        load_encoder(tmp_path / "tiny")


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_load_encoder_checks_the_sizes_of_every_mechanism(tmp_path, name):
    from vlm_vit import load_encoder
    from vlm_vit.convert.base import size_problems

    encoder = encoder_for(name)
    encoder.save_pretrained(tmp_path / name, model_card=False)
    assert load_encoder(tmp_path / name).config == encoder.config
    state = encoder.state_dict()
    assert size_problems(encoder.config, state) == []
    wider = EncoderConfig(**{**encoder.config.to_dict(), "mlp_width": 96})
    assert any("mlp_width 96 but the weights hold 64" in p for p in size_problems(wider, state))


def test_rope_has_no_parameters_and_rotates_in_every_block():
    torch.manual_seed(0)
    plain = perturbed(VisionEncoder(tiny_config(pos_embed="none", class_token=False)))
    rope = VisionEncoder(tiny_config(pos_embed="none", class_token=False, rope_theta=1e4))
    assert set(rope.state_dict()) == set(plain.state_dict())
    assert "pos_embed" not in rope.state_dict()
    rope.load_state_dict(plain.state_dict())
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        # without any position, moving whole patches moves the tokens alike; RoPE breaks that
        rolled = x.roll(8, dims=-1)  # every patch one column right, the last one wrapped

        def roll_tokens(tokens):  # (1, 16, D) on the 4x4 grid, rolled one column
            return tokens.reshape(1, 4, 4, -1).roll(1, dims=2).reshape(tokens.shape)

        torch.testing.assert_close(plain(rolled).tokens, roll_tokens(plain(x).tokens),
                                   atol=1e-5, rtol=1e-5)
        assert (rope(rolled).tokens - roll_tokens(rope(x).tokens)).abs().max() > 1e-2


def test_rope_logits_depend_only_on_the_offset_inside_the_encoder():
    # two images whose content is the same up to a shift of whole patches give the same
    # attention logits between the patches they share: the position enters only as offsets
    encoder = encoder_for("rope").eval()
    image = torch.randn(1, 3, 40, 40)
    with torch.no_grad():
        weights = {}
        for name, crop in {"top_left": image[..., :32, :32], "shifted": image[..., 8:, 8:]}.items():
            x, grid = encoder.prepare_tokens(crop)
            block = encoder.blocks[0]
            rope = encoder.rope.for_grids([grid])
            weights[name] = block.attn(block.norm1(x), need_weights=True, rope=rope)[1][0]
    # patch (r, c) of "shifted" is patch (r + 1, c + 1) of "top_left": compare the 3x3 overlap
    index = torch.arange(16).reshape(4, 4)
    shared_top_left, shared_shifted = index[1:, 1:].flatten(), index[:3, :3].flatten()
    logits = {name: w.log() for name, w in weights.items()}  # log-softmax: logits up to a row shift
    ours = logits["top_left"][:, shared_top_left][:, :, shared_top_left]
    theirs = logits["shifted"][:, shared_shifted][:, :, shared_shifted]
    centred = [t - t.mean(-1, keepdim=True) for t in (ours, theirs)]
    torch.testing.assert_close(centred[0], centred[1], atol=1e-4, rtol=1e-4)


def test_window_attention_stays_in_its_windows_except_in_full_blocks():
    encoder = encoder_for("qwen2_5_vl").eval()
    image = torch.randn(1, 3, 32, 48)  # a 4x6 grid: six 2x2 windows
    with torch.no_grad():
        out = encoder(image, output_attentions=True)
    rows, cols = torch.meshgrid(torch.arange(4), torch.arange(6), indexing="ij")
    window = (rows // 2 * 3 + cols // 2).flatten()  # each token's window, row-major
    outside = window[:, None] != window[None, :]
    windowed, full, last = (maps[0] for maps in out.attentions)  # (heads, 24, 24) each
    for maps in (windowed, last):
        assert torch.all(maps[:, outside] == 0) and torch.all(maps[:, ~outside] > 0)
        torch.testing.assert_close(maps.sum(-1), torch.ones(4, 24))
    assert torch.all(full > 0)


def test_a_window_covering_the_grid_is_global_attention():
    encoder = encoder_for("qwen2_5_vl").eval()
    plain = VisionEncoder(EncoderConfig(**{**encoder.config.to_dict(), "window_size": None,
                                            "full_attention_blocks": ()})).eval()
    plain.load_state_dict(encoder.state_dict())
    image = torch.randn(1, 3, 16, 16)  # a 2x2 grid: one window
    with torch.no_grad():
        torch.testing.assert_close(encoder(image).tokens, plain(image).tokens,
                                   atol=1e-6, rtol=1e-6)
        wide = torch.randn(1, 3, 16, 32)  # 2x4: two windows, so not global any more
        assert (encoder(wide).tokens - plain(wide).tokens).abs().max() > 1e-3
