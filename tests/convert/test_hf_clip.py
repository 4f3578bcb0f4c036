"""Hugging Face CLIP and SigLIP vision towers: parity with transformers on tiny random models,
the native -> hf-clip -> native round trip, the preprocessor config, and the writer's refusals."""

import json

import pytest
import torch

from vlm_vit import (
    ImageProcessor,
    VisionEncoder,
    build_pooler,
    load_encoder,
    load_processor,
    load_tower,
)
from vlm_vit.convert import FORMATS
from vlm_vit.convert.hf_clip import processor_from_hf, save_hf_clip
from vlm_vit.convert.timm import build_timm_model
from vlm_vit.io.files import read_safetensors, write_safetensors
from vlm_vit.io.loading import read_checkpoint

from ..conftest import tiny_config

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
TINY_VISION = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                   intermediate_size=64, image_size=32, patch_size=8)
TINY_TEXT = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=32, vocab_size=100, bos_token_id=0, eos_token_id=1,
                 pad_token_id=2)
CLIP_SHAPED = dict(pre_norm=True, act="quick_gelu", norm_eps=1e-5, patch_bias=False)


def randomized(model):
    """`model` in eval mode with every parameter moved off its initial value, so that unit
    LayerNorm scales or zero biases cannot hide a swapped or dropped tensor."""
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model.eval()


def pixels(height=32, width=32, batch=2):
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(1))


def close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def clip_vision(tmp_path, **options):
    model = randomized(transformers.CLIPVisionModel(
        transformers.CLIPVisionConfig(**{**TINY_VISION, **options})))
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("act", ["quick_gelu", "gelu"])
def test_clip_vision_model_matches_transformers(tmp_path, act):
    theirs = clip_vision(tmp_path, hidden_act=act)
    ours = load_encoder(tmp_path).eval()
    assert ours.config.act == act
    x = pixels()
    with torch.no_grad():
        expected = theirs(pixel_values=x, output_hidden_states=True)
        out = ours(x, output_hidden_states=True)
        tower_out = load_tower(tmp_path).eval()(x)
    assert len(out.hidden_states) == len(expected.hidden_states) == 4
    for mine, reference in zip(out.hidden_states, expected.hidden_states, strict=True):
        close(mine, reference)
    # HF's last_hidden_state has no post_layernorm; only its pooled class token does.
    close(out.hidden_states[-1], expected.last_hidden_state)
    close(out.cls_token, expected.pooler_output)
    close(tower_out, expected.pooler_output)
    # The README's token contract: out.tokens is not CLIP's last_hidden_state (issue 27, 6).
    with torch.no_grad():
        last = ours(x, feature_layers=[-1]).features[0]
    close(last, expected.last_hidden_state)
    assert (out.tokens - expected.last_hidden_state).abs().max() > 0.1


def test_detection_and_default_processor(tmp_path):
    clip_vision(tmp_path)
    checkpoint = read_checkpoint(tmp_path)
    assert [name for name in FORMATS.names() if FORMATS.get(name).matches(checkpoint)] == \
        ["hf_clip"]
    converted = FORMATS.get("hf_clip").to_native(checkpoint)
    assert (converted.pooler.name, converted.pooler.weights) == ("cls", {})
    assert converted.processor.size == (32, 32)
    assert converted.processor.crop_rounding == "floor"  # CLIPImageProcessor's centre crop
    assert converted.processor.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    assert any("preprocessor_config.json" in rule for rule in converted.rules)


def test_prefixed_keys_and_position_ids_load(tmp_path):
    theirs = clip_vision(tmp_path)
    bare = read_safetensors(tmp_path / "model.safetensors")
    # The layout of transformers 4 (and of composite models), with the buffer it once saved.
    prefixed = {f"vision_model.{name}": tensor for name, tensor in bare.items()}
    prefixed["vision_model.embeddings.position_ids"] = torch.arange(17)[None]
    write_safetensors(prefixed, tmp_path / "model.safetensors")
    x = pixels()
    with torch.no_grad():
        expected = theirs(pixel_values=x, output_hidden_states=True)
        out = load_encoder(tmp_path).eval()(x, output_hidden_states=True)
    close(out.hidden_states[-1], expected.last_hidden_state)
    close(out.cls_token, expected.pooler_output)


def test_clip_model_tower_is_get_image_features(tmp_path):
    config = transformers.CLIPConfig(text_config=TINY_TEXT, vision_config=TINY_VISION,
                                     projection_dim=24)
    theirs = randomized(transformers.CLIPModel(config))
    theirs.save_pretrained(tmp_path)
    x = pixels()
    with torch.no_grad():
        features = theirs.get_image_features(pixel_values=x)
        # transformers 5 returns an output object whose pooler_output is the projection.
        features = getattr(features, "pooler_output", features)
        vision = theirs.vision_model(pixel_values=x)
        out = load_encoder(tmp_path).eval()(x)
        tower = load_tower(tmp_path).eval()
        embedded = tower(x)
    assert features.shape == (2, 24)
    assert tower.pooler.pooler_spec["name"] == "cls_linear"
    close(out.cls_token, vision.pooler_output)
    close(embedded, features)


def test_clip_vision_model_with_projection(tmp_path):
    config = transformers.CLIPVisionConfig(**TINY_VISION, projection_dim=16)
    theirs = randomized(transformers.CLIPVisionModelWithProjection(config))
    theirs.save_pretrained(tmp_path)
    x = pixels()
    with torch.no_grad():
        close(load_tower(tmp_path).eval()(x), theirs(pixel_values=x).image_embeds)


def siglip_vision(tmp_path):
    config = transformers.SiglipVisionConfig(**TINY_VISION)
    assert config.vision_use_head  # the MAP head, SigLIP's pooler, is there by default
    model = randomized(transformers.SiglipVisionModel(config))
    model.save_pretrained(tmp_path)
    return model


def test_siglip_vision_model_matches_transformers(tmp_path):
    theirs = siglip_vision(tmp_path)
    ours = load_encoder(tmp_path).eval()
    assert (ours.config.class_token, ours.config.pre_norm, ours.config.act) == \
        (False, False, "gelu_tanh")
    x = pixels()
    with torch.no_grad():
        expected = theirs(pixel_values=x, output_hidden_states=True)
        out = ours(x, output_hidden_states=True)
        pooled = load_tower(tmp_path).eval()(x)
    for mine, reference in zip(out.hidden_states, expected.hidden_states, strict=True):
        close(mine, reference)
    close(out.tokens, expected.last_hidden_state)  # SigLIP's post_layernorm covers every token
    close(pooled, expected.pooler_output)
    processor = load_processor(tmp_path)
    assert (processor.resize_mode, processor.mean, processor.std, processor.crop_rounding) == \
        ("squash", (0.5,) * 3, (0.5,) * 3, "floor")


def test_siglip_model_drops_the_text_tower(tmp_path):
    config = transformers.SiglipConfig(text_config=TINY_TEXT, vision_config=TINY_VISION)
    theirs = randomized(transformers.SiglipModel(config))
    theirs.save_pretrained(tmp_path)
    x = pixels()
    with torch.no_grad():
        expected = theirs.vision_model(pixel_values=x).pooler_output
        close(load_tower(tmp_path).eval()(x), expected)


def test_non_square_images(tmp_path):
    theirs = clip_vision(tmp_path)
    encoder = load_encoder(tmp_path).eval()
    twin = build_timm_model(encoder.config, dynamic_img_size=True).eval()
    twin.load_state_dict(encoder.state_dict())
    x = pixels(32, 48)
    with torch.no_grad():
        close(encoder(x).tokens, twin.forward_features(x))
        # HF resizes the position table without antialiasing; the override matches it.
        hf_like = load_encoder(tmp_path, pos_resize_antialias=False).eval()(x)
        expected = theirs(pixel_values=x, interpolate_pos_encoding=True)
    close(hf_like.cls_token, expected.pooler_output)
    close(hf_like.tokens[:, 1:], theirs.post_layernorm(expected.last_hidden_state)[:, 1:])


def clip_shaped_encoder(**overrides):
    torch.manual_seed(0)
    return randomized(VisionEncoder(tiny_config(**{**CLIP_SHAPED, **overrides})))


@pytest.mark.parametrize("act", ["quick_gelu", "gelu", "gelu_tanh"])
def test_round_trip_is_bit_exact_and_loads_in_transformers(tmp_path, act):
    ours = clip_shaped_encoder(act=act)
    FORMATS.get("hf_clip").write(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == \
        ("clip_vision_model", ["CLIPVisionModel"])
    back = load_encoder(tmp_path)
    assert back.config.to_dict() == ours.config.to_dict()
    state, returned = ours.state_dict(), back.state_dict()
    assert state.keys() == returned.keys()
    for name in state:
        assert torch.equal(state[name], returned[name]), name
    theirs = transformers.CLIPVisionModel.from_pretrained(tmp_path).eval()
    x = pixels()
    with torch.no_grad():
        expected = theirs(pixel_values=x, output_hidden_states=True)
        out = ours(x, output_hidden_states=True)
    for mine, reference in zip(out.hidden_states, expected.hidden_states, strict=True):
        close(mine, reference)
    close(out.cls_token, expected.pooler_output)


def test_writes_a_projection_and_a_processor(tmp_path):
    ours = clip_shaped_encoder()
    pooler = randomized(build_pooler("cls_linear", in_dim=32, out_dim=16, bias=False))
    clip_vision(tmp_path / "reference")
    processor = load_processor(tmp_path / "reference")
    save_hf_clip(ours, tmp_path / "out", processor=processor, pooler=pooler)
    theirs = transformers.CLIPVisionModelWithProjection.from_pretrained(tmp_path / "out").eval()
    x = pixels()
    with torch.no_grad():
        expected = theirs(pixel_values=x).image_embeds
        close(pooler(ours(x).tokens, num_prefix_tokens=1, grid=(4, 4)), expected)
        close(load_tower(tmp_path / "out").eval()(x), expected)
    assert load_processor(tmp_path / "out") == processor
    hf_processor = transformers.CLIPImageProcessor.from_pretrained(tmp_path / "out")
    assert (hf_processor.size["shortest_edge"], hf_processor.crop_size["height"]) == (32, 32)


def astronaut():
    data = pytest.importorskip("skimage.data")
    from PIL import Image

    return Image.fromarray(data.astronaut())  # 512 x 512 RGB


def test_processor_from_preprocessor_config(tmp_path):
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    settings = dict(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64},
                    image_mean=mean, image_std=std, resample=3)
    clip_vision(tmp_path)
    transformers.CLIPImageProcessor(**settings).save_pretrained(tmp_path)
    ours = load_processor(tmp_path)
    assert (ours.size, ours.resize_mode, ours.resample, ours.mean, ours.std,
            ours.crop_rounding) == ((64, 64), "shortest_edge", "bicubic", mean, std, "floor")
    image = astronaut()
    # Non-square too, both ways: 512 x 300 overhangs the crop by 45 pixels (22.5: torchvision
    # and transformers both start at 22); 333 x 300 and 300 x 333 by 7 (3.5: torchvision
    # rounds to 4, transformers floors to 3, and so do we here).
    for photo in (image, image.crop((0, 0, 512, 300)), image.crop((0, 0, 333, 300)),
                  image.crop((0, 0, 300, 333))):
        expected = transformers.CLIPImageProcessorPil(**settings)(
            images=photo, return_tensors="pt").pixel_values
        torch.testing.assert_close(ours(photo), expected, atol=1e-5, rtol=0)
        # The default CLIPImageProcessor of transformers 5 resizes with torchvision, whose
        # bicubic rounds a few pixels to the neighbouring uint8 value than PIL's (measured:
        # max 0.0150 = 1/255/std, mean ~5e-5); PIL is what the reference CLIP code uses.
        default = transformers.CLIPImageProcessor(**settings)(
            images=photo, return_tensors="pt").pixel_values
        difference = (ours(photo) - default).abs()
        assert difference.max() <= 1 / 255 / min(std) + 1e-5 and difference.mean() < 1e-3


def test_writer_refuses_a_crop_transformers_rounds_otherwise(tmp_path):
    rounded = ImageProcessor.for_family("clip", size=32)  # torchvision's crop rounding
    for write in (lambda: save_hf_clip(clip_shaped_encoder(), tmp_path / "out",
                                       processor=rounded),
                  lambda: FORMATS.get("hf_clip").write(  # what `vlm-vit convert` calls
                      clip_shaped_encoder(), tmp_path / "out", processor=rounded)):
        with pytest.raises(ValueError, match="crop_rounding='round'.*crop_rounding='floor'"):
            write()
        assert not (tmp_path / "out").exists()
    # Without a crop the rounding never applies: a squash processor is written either way.
    squash = ImageProcessor.for_family("clip", size=32, resize_mode="squash")
    save_hf_clip(clip_shaped_encoder(), tmp_path / "squash", processor=squash)
    assert load_processor(tmp_path / "squash").size == (32, 32)


def test_writer_refuses_a_native_resolution_processor(tmp_path):
    native = ImageProcessor.for_family("clip", resize_mode="native", patch_multiple=16)
    with pytest.raises(ValueError, match="resize_mode 'native'"):
        save_hf_clip(clip_shaped_encoder(), tmp_path / "out", processor=native)
    assert not (tmp_path / "out").exists()


def test_siglip_processor_from_preprocessor_config(tmp_path):
    settings = dict(size={"height": 48, "width": 40}, resample=2)
    siglip_vision(tmp_path)
    transformers.SiglipImageProcessor(**settings).save_pretrained(tmp_path)
    ours = load_processor(tmp_path)
    assert (ours.size, ours.resize_mode, ours.resample) == ((48, 40), "squash", "bilinear")
    image = astronaut()
    expected = transformers.SiglipImageProcessorPil(**settings)(
        images=image, return_tensors="pt").pixel_values
    torch.testing.assert_close(ours(image), expected, atol=1e-5, rtol=0)


def test_preprocessor_spellings_and_approximations():
    rules, clip = [], ImageProcessor.for_family("clip", size=32)
    # transformers 4.2x's CLIP files: bare ints, the shortest edge then a square crop.
    legacy = processor_from_hf({"size": 224, "crop_size": 224, "do_center_crop": True,
                                "resample": 3}, clip, rules)
    assert (legacy.size, legacy.resize_mode, rules) == ((224, 224), "shortest_edge", [])
    # ImageNet-style resize 256 then crop 224 cannot be said exactly: a rule says so.
    cropped = processor_from_hf({"size": {"shortest_edge": 256}, "do_center_crop": True,
                                 "crop_size": {"height": 224, "width": 224}}, clip, rules)
    assert (cropped.size, cropped.mean) == ((224, 224), clip.mean) and "256" in rules[0]


def test_missing_config_fields_take_transformers_defaults(tmp_path):
    clip_vision(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["hidden_act"], config["layer_norm_eps"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    converted = FORMATS.get("hf_clip").to_native(read_checkpoint(tmp_path))
    assert (converted.config.act, converted.config.norm_eps) == ("quick_gelu", 1e-5)
    assert any("hidden_act, layer_norm_eps" in rule for rule in converted.rules)


@pytest.mark.parametrize("field, value", [
    ("class_token", False), ("num_register_tokens", 1), ("pre_norm", False),
    ("patch_bias", True), ("qkv_bias", False), ("final_norm", False),
    ("image_size", (32, 48)),
])
def test_writer_refuses_what_clip_cannot_express(tmp_path, field, value):
    encoder = VisionEncoder(tiny_config(**{**CLIP_SHAPED, field: value}))
    with pytest.raises(ValueError, match=field):
        save_hf_clip(encoder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_writer_refuses_other_poolers(tmp_path):
    pooler = build_pooler("attention_pool", in_dim=32)
    with pytest.raises(ValueError, match="AttentionPool"):
        save_hf_clip(clip_shaped_encoder(), tmp_path, pooler=pooler)


def test_loud_errors(tmp_path):
    clip_vision(tmp_path / "odd", hidden_act="relu")
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        load_encoder(tmp_path / "odd")
    clip_vision(tmp_path / "bare")
    with pytest.raises(ValueError, match="no config.json"):
        load_encoder(tmp_path / "bare" / "model.safetensors")
