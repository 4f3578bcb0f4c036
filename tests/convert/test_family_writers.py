"""Writing back to each family's own format (issue 33): a tiny random model built and saved by
transformers, read by our reader, written by our writer and loaded strictly by transformers
again gives the original model's every hidden state (and pooled or merged output); the files
hold exactly the keys transformers itself saves; what the format cannot hold is refused in
one line naming the field."""

import json

import pytest
import torch
from safetensors import safe_open

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.cli import main
from vlm_vit.convert import FORMATS
from vlm_vit.testing import perturbed

transformers = pytest.importorskip("transformers")

ATOL = 0  # the same weights in the same code: bit for bit
OURS_ATOL = 2e-6  # ours against theirs: measured 0 (DINOv2), 7.2e-7 (a Qwen2.5-VL merger)


def saved_keys(directory) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        return set(handle.keys())


def written(source, tmp_path, format_name: str):
    """Our reading of `source` (encoder, pooler, processor), written back by `format_name`'s
    writer through `vlm-vit convert`."""
    destination = tmp_path / "written"
    assert main(["convert", str(source), str(destination), "--to", format_name]) == 0
    return destination


def reloaded(model_class, directory):
    """transformers' model from `directory`, which must name no missing or unexpected key."""
    model, info = model_class.from_pretrained(directory, output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


def assert_states_equal(ours, theirs):
    assert len(ours.hidden_states) == len(theirs.hidden_states)
    for mine, reference in zip(ours.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(mine, reference, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state,
                               atol=ATOL, rtol=ATOL)


def refusal(format_name: str, tmp_path, pooler=None, **fields) -> str:
    """The one-line error `format_name`'s writer gives for an encoder of `fields`."""
    encoder = VisionEncoder(EncoderConfig(**fields))
    with pytest.raises(ValueError) as error:
        FORMATS.get(format_name).write(encoder, tmp_path / "refused", pooler=pooler)
    message = str(error.value)
    assert "\n" not in message and not (tmp_path / "refused").exists()
    return message


# -- DINOv2 -----------------------------------------------------------------------------------

DINOV2 = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=4,
              image_size=28, patch_size=7, layerscale_value=0.5)
DINOV2_MODELS = {
    "plain": ("Dinov2Model", "Dinov2Config", {}),
    "swiglu": ("Dinov2Model", "Dinov2Config", dict(use_swiglu_ffn=True, qkv_bias=False)),
    "registers": ("Dinov2WithRegistersModel", "Dinov2WithRegistersConfig",
                  dict(num_register_tokens=3)),
}


@pytest.mark.parametrize("name", sorted(DINOV2_MODELS))
def test_dinov2_written_back_is_the_same_model(tmp_path, name):
    model_class, config_class, options = DINOV2_MODELS[name]
    model_class = getattr(transformers, model_class)
    torch.manual_seed(0)
    original = perturbed(model_class(getattr(transformers, config_class)(**DINOV2, **options)))
    original.save_pretrained(tmp_path / "original")
    destination = written(tmp_path / "original", tmp_path, "hf_dinov2")
    assert saved_keys(destination) == saved_keys(tmp_path / "original")
    config = json.loads((destination / "config.json").read_text())
    assert config["architectures"] == [model_class.__name__] and config["mlp_ratio"] == 4
    again = reloaded(transformers.AutoModel, destination)
    assert type(again) is model_class
    processor = transformers.AutoImageProcessor.from_pretrained(destination)
    assert processor.crop_size["height"] == 28
    assert list(processor.image_mean) == [0.485, 0.456, 0.406]
    x = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = again(x, output_hidden_states=True), \
            original.eval()(x, output_hidden_states=True)
    assert_states_equal(ours, theirs)
    torch.testing.assert_close(ours.pooler_output, theirs.pooler_output, atol=ATOL, rtol=ATOL)


def test_a_plain_vit_becomes_dinov2_with_unit_layer_scale(tmp_path):
    torch.manual_seed(0)
    encoder = perturbed(VisionEncoder(EncoderConfig(image_size=28, patch_size=7, width=32,
                                                    depth=2, heads=4, mlp_width=96))).eval()
    FORMATS.get("hf_dinov2").write(encoder, tmp_path / "d")
    model = reloaded(transformers.Dinov2Model, tmp_path / "d")
    x = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(x).last_hidden_state, encoder(x).tokens,
                                   atol=OURS_ATOL, rtol=OURS_ATOL)


def test_dinov2_refuses_what_it_cannot_hold(tmp_path):
    message = refusal("hf_dinov2", tmp_path, image_size=(28, 42), patch_size=7, width=32,
                      depth=1, heads=4, mlp_width=128, pre_norm=True, class_token=False)
    assert message.startswith("a Hugging Face DINOv2 model cannot hold this encoder: ")
    for field in ("class_token=False", "pre_norm=True", "image_size=(28, 42)"):
        assert field in message


# -- Pixtral ----------------------------------------------------------------------------------

PIXTRAL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               head_dim=8, image_size=64, patch_size=8, hidden_act="silu")
PIXTRAL_STYLE = dict(image_size=64, patch_size=8, width=32, depth=2, heads=4, mlp_width=48,
                     class_token=False, pre_norm=True, final_norm=False, qkv_bias=False,
                     patch_bias=False, norm="rmsnorm", mlp="swiglu", act="silu", norm_eps=1e-5,
                     pos_embed="none", rope_theta=10000.0, rope_frequencies="alternating")


def test_pixtral_written_back_is_the_same_model(tmp_path):
    torch.manual_seed(0)
    config = transformers.PixtralVisionConfig(**PIXTRAL)
    original = perturbed(transformers.PixtralVisionModel(config)).eval()
    original.save_pretrained(tmp_path / "original")
    destination = written(tmp_path / "original", tmp_path, "hf_pixtral")
    assert saved_keys(destination) == saved_keys(tmp_path / "original")
    again = reloaded(transformers.AutoModel, destination)
    assert type(again) is transformers.PixtralVisionModel
    processor = transformers.AutoImageProcessor.from_pretrained(destination)
    assert processor.size.longest_edge == 64 and processor.patch_size["height"] == 8
    x = torch.randn(1, 3, 24, 56, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_states_equal(again(x, output_hidden_states=True),
                            original(x, output_hidden_states=True))


def test_pixtral_refuses_what_it_cannot_hold(tmp_path):
    message = refusal("hf_pixtral", tmp_path, **{**PIXTRAL_STYLE, "class_token": True,
                                                  "pos_embed": "learned", "rope_theta": None})
    assert message.startswith("a Hugging Face Pixtral model cannot hold this encoder: "
                              "rope_theta=None (Pixtral needs 2D RoPE); ")
    assert "class_token=True" in message and "pos_embed='learned'" in message
    biased = perturbed(VisionEncoder(EncoderConfig(**PIXTRAL_STYLE)))  # biases not zero
    with pytest.raises(ValueError, match=r"not zero: blocks\.0\.attn\.proj\.bias, "):
        FORMATS.get("hf_pixtral").write(biased, tmp_path / "refused")
    from vlm_vit.poolers import build_pooler

    head = build_pooler("cls_linear", in_dim=32, out_dim=8)
    with pytest.raises(ValueError, match="no pooling head to hold the 'cls_linear' pooler"):
        FORMATS.get("hf_pixtral").write(biased, tmp_path / "refused", pooler=head)


# -- Qwen2-VL and Qwen2.5-VL ------------------------------------------------------------------

QWEN_P, QWEN_T, QWEN_MERGE = 4, 2, 2
QWEN2_VL = dict(depth=2, embed_dim=32, hidden_size=48, num_heads=4, patch_size=QWEN_P,
                temporal_patch_size=QWEN_T, spatial_merge_size=QWEN_MERGE)
QWEN2_5_VL = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=40,
                  num_heads=4, patch_size=QWEN_P, temporal_patch_size=QWEN_T,
                  spatial_merge_size=QWEN_MERGE, window_size=4 * QWEN_P,
                  fullatt_block_indexes=[1])
QWEN2_VL_STYLE = dict(image_size=64, patch_size=QWEN_P, width=32, depth=2, heads=4,
                      mlp_width=128, class_token=False, final_norm=False, patch_bias=False,
                      pos_embed="none", rope_theta=10000.0, temporal_patch_size=QWEN_T,
                      act="quick_gelu")


def qwen_model(version: str):
    """transformers' tiny Qwen2-VL or Qwen2.5-VL vision tower, at random."""
    if version == "qwen2_vl":
        from transformers.models.qwen2_vl import configuration_qwen2_vl, modeling_qwen2_vl

        return modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel(
            configuration_qwen2_vl.Qwen2VLVisionConfig(**QWEN2_VL))
    from transformers.models.qwen2_5_vl import configuration_qwen2_5_vl, modeling_qwen2_5_vl

    return modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel(
        configuration_qwen2_5_vl.Qwen2_5_VLVisionConfig(**QWEN2_5_VL))


@pytest.mark.parametrize("version", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_written_back_is_the_same_model(tmp_path, version):
    from .test_hf_qwen2_vl import flattened

    torch.manual_seed(0)
    original = perturbed(qwen_model(version)).eval()
    original.save_pretrained(tmp_path / "original")
    destination = written(tmp_path / "original", tmp_path, f"hf_{version}")
    assert saved_keys(destination) == saved_keys(tmp_path / "original")
    again = reloaded(type(original), destination)
    processor = transformers.AutoImageProcessor.from_pretrained(destination)
    assert (processor.merge_size, processor.temporal_patch_size) == (QWEN_MERGE, QWEN_T)
    image = torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(1))
    patches, grid_thw = flattened(image[:, None].expand(-1, QWEN_T, -1, -1))
    with torch.no_grad():
        ours = again(patches, grid_thw=grid_thw, output_hidden_states=True)
        theirs = original(patches, grid_thw=grid_thw, output_hidden_states=True)
    assert_states_equal(ours, theirs)
    torch.testing.assert_close(ours.pooler_output, theirs.pooler_output, atol=ATOL, rtol=ATOL)


def test_qwen2_vl_refuses_what_it_cannot_hold(tmp_path):
    from vlm_vit.poolers import build_pooler

    merger = build_pooler("patch_merger", in_dim=32, out_dim=48, merge_size=2)
    message = refusal("hf_qwen2_vl", tmp_path, pooler=merger,
                      **{**QWEN2_VL_STYLE, "temporal_patch_size": None, "window_size": 4})
    assert message == ("a Hugging Face Qwen2-VL model cannot hold this encoder: "
                       "temporal_patch_size=None (Qwen2-VL embeds patches with a Conv3d over "
                       "frames); window_size=4 (Qwen2-VL needs None)")
    message = refusal("hf_qwen2_vl", tmp_path, **QWEN2_VL_STYLE)
    assert message == ("a Hugging Face Qwen2-VL vision tower always ends in its merger: write "
                       "it with the patch_merger pooler (norm 'layernorm'), not none")
    rms = build_pooler("patch_merger", in_dim=32, merge_size=2, norm="rmsnorm")
    assert "this patch_merger has norm 'rmsnorm'" in refusal("hf_qwen2_vl", tmp_path,
                                                             pooler=rms, **QWEN2_VL_STYLE)


def test_qwen2_5_vl_refuses_a_window_of_half_a_merge_unit(tmp_path):
    from vlm_vit.poolers import build_pooler

    merger = build_pooler("patch_merger", in_dim=32, merge_size=2, norm="rmsnorm")
    style = {**QWEN2_VL_STYLE, "norm": "rmsnorm", "mlp": "swiglu", "act": "silu"}
    message = refusal("hf_qwen2_5_vl", tmp_path, pooler=merger, **style, window_size=3)
    assert message == ("a Hugging Face Qwen2.5-VL model cannot hold this encoder: "
                       "window_size=3 (Qwen2.5-VL's windows are whole 2x2 merge units)")
    # the architecture is refused before the pooler: not for the pooler the reader chose
    message = refusal("hf_qwen2_5_vl", tmp_path, **style, qkv_bias=False)
    assert message == ("a Hugging Face Qwen2.5-VL model cannot hold this encoder: "
                       "qkv_bias=False (Qwen2.5-VL needs True)")


def test_qwen2_5_vl_holds_an_encoder_without_windows_as_all_global_blocks(tmp_path):
    from .test_hf_qwen2_vl import flattened

    torch.manual_seed(0)
    config = EncoderConfig(**{**QWEN2_VL_STYLE, "norm": "rmsnorm", "mlp": "swiglu",
                              "act": "silu", "mlp_width": 48})
    encoder = perturbed(VisionEncoder(config)).eval()
    from vlm_vit.poolers import build_pooler

    merger = perturbed(build_pooler("patch_merger", in_dim=32, out_dim=40, merge_size=2,
                                    norm="rmsnorm"))
    FORMATS.get("hf_qwen2_5_vl").write(encoder, tmp_path / "q", pooler=merger)
    assert json.loads((tmp_path / "q" / "config.json").read_text())[
        "fullatt_block_indexes"] == [0, 1]
    model = reloaded(type(qwen_model("qwen2_5_vl")), tmp_path / "q")
    image = torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(1))
    patches, grid_thw = flattened(image[:, None].expand(-1, QWEN_T, -1, -1))
    with torch.no_grad():
        out = encoder(image[None])
        theirs = model(patches, grid_thw=grid_thw)
        pooled = merger(out.tokens, num_prefix_tokens=0, grid=out.grid)
    torch.testing.assert_close(pooled[0], theirs.pooler_output, atol=OURS_ATOL, rtol=OURS_ATOL)


def test_convert_writes_transformers_shards_by_its_dashed_name(tmp_path):
    torch.manual_seed(0)
    original = perturbed(qwen_model("qwen2_5_vl")).eval()
    original.save_pretrained(tmp_path / "original")
    destination = tmp_path / "sharded"
    assert main(["convert", str(tmp_path / "original"), str(destination), "--to",
                 "hf-qwen2-5-vl", "--max-shard-size", "20KB"]) == 0
    assert (destination / "model.safetensors.index.json").is_file()
    again = reloaded(type(original), destination)
    for mine, reference in zip(again.state_dict().values(), original.state_dict().values(),
                               strict=True):
        assert torch.equal(mine, reference)


# -- timm: what its VisionTransformer cannot hold -----------------------------------------------

PLAIN = dict(image_size=32, patch_size=8, width=32, depth=1, heads=2, mlp_width=64)


@pytest.mark.parametrize(("fields", "named"), [
    (dict(temporal_patch_size=2), "temporal_patch_size=2"),
    (dict(window_size=2, class_token=False), "window_size=2"),
    (dict(window_size=2, full_attention_blocks=(0,), class_token=False), "window_size=2"),
])
def test_timm_refuses_video_patches_and_windows_by_name(tmp_path, fields, named):
    message = refusal("timm", tmp_path, **PLAIN, **fields)
    assert message == ("timm's VisionTransformer has neither a Conv3d patch embedding nor "
                       f"window attention; this encoder has {named}")


# -- timm's Eva (EVA-02) ----------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["eva02_tiny", "registers_layerscale_unfused",
                                     "eva_giant_shaped"])
def test_timm_eva_written_back_is_the_same_model(tmp_path, variant):
    timm = pytest.importorskip("timm")
    from .test_timm_eva import VARIANTS, save_eva, timm_states

    architecture, options = VARIANTS[variant]
    _, original = save_eva(tmp_path / "original", architecture, **options)
    destination = written(tmp_path / "original", tmp_path, "timm_eva")
    again = timm.create_model(f"local-dir:{destination}", pretrained=True).eval()  # strict
    assert saved_keys(destination) == set(again.state_dict())
    size = options.get("img_size", 28)
    size = (size, size) if isinstance(size, int) else size
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        (states, final), (reference, reference_final) = \
            timm_states(again, x), timm_states(original.eval(), x)
    for mine, theirs in zip([*states, final], [*reference, reference_final], strict=True):
        torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=ATOL)


def test_timm_eva_refuses_what_it_cannot_hold(tmp_path):
    message = refusal("timm_eva", tmp_path, **PLAIN, norm="rmsnorm", act="quick_gelu",
                      pre_norm=True)
    assert message == ("timm's Eva cannot hold this encoder: norm='rmsnorm' (timm's Eva needs "
                       "'layernorm'); act='quick_gelu' (timm's Eva MLP needs 'gelu'); "
                       "patch_bias=True with pre_norm=True (timm's Eva ties the patch bias to "
                       "no pre-norm)")
    biased = perturbed(VisionEncoder(EncoderConfig(**PLAIN)))
    with pytest.raises(ValueError, match=r"no k bias, .* blocks\.0\.attn\.qkv\.bias$"):
        FORMATS.get("timm_eva").write(biased, tmp_path / "refused")


@pytest.mark.parametrize("format_name, field", [("hf_pixtral", "rope_reference_grid"),
                                                ("hf_qwen2_vl", "rope_reference_grid"),
                                                ("hf_dinov2", "mlp_norm")])
def test_writers_refuse_the_eva_mechanisms_by_name(tmp_path, format_name, field):
    from vlm_vit import EncoderConfig, VisionEncoder
    from vlm_vit.convert import FORMATS

    extra = dict(rope_reference_grid=(2, 2), pos_embed="none", rope_theta=10000.0) \
        if field == "rope_reference_grid" else dict(mlp="swiglu", act="silu", mlp_norm=True)
    encoder = VisionEncoder(EncoderConfig(image_size=32, patch_size=8, width=32, depth=1,
                                          heads=2, mlp_width=64, **extra))
    with pytest.raises(ValueError, match=field):
        FORMATS.get(format_name).write(encoder, tmp_path / "out")
