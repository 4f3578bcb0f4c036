"""open_clip / OpenAI CLIP state dicts load to the same function as open_clip's image tower,
and an encoder written back loads into open_clip unchanged."""

import json

import pytest
import torch

from vlm_vit import EncoderConfig, ImageProcessor, VisionEncoder, load_encoder, load_tower
from vlm_vit.convert import FORMATS, detect_format
from vlm_vit.io.files import read_safetensors, write_safetensors
from vlm_vit.io.loading import convert_checkpoint, read_checkpoint
from vlm_vit.poolers import build_pooler
from vlm_vit.processor import NORMALIZATION

open_clip_model = pytest.importorskip("open_clip.model")

TEXT_CFG = dict(context_length=8, vocab_size=100, width=32, heads=2, layers=1)
CONFIG_FILE = "open_clip_config.json"
# A file alone: no config, and width 64 with depth 2 is no known architecture, so heads= and
# act= are given (a bare state dict records neither).
# A hub directory: open_clip_config.json decides (head width 32 there, to prove it is read).
# What a bare state dict of make_clip's default tower does not record (a QuickGELU one).
BARE = {"heads": 1, "act": "quick_gelu"}
CONTAINERS = ["pt-training-checkpoint", "safetensors", "visual-only", "hub-safetensors",
              "hub-bin"]


def make_clip(*, quick_gelu=True, seed=0, **vision):
    """A tiny open_clip CLIP with every weight randomised, and its model_cfg."""
    vision_cfg = {**dict(layers=2, width=64, head_width=64, patch_size=8, image_size=32,
                         mlp_ratio=4.0), **vision}
    torch.manual_seed(seed)
    model = open_clip_model.CLIP(
        embed_dim=16, vision_cfg=open_clip_model.CLIPVisionCfg(**vision_cfg),
        text_cfg=open_clip_model.CLIPTextCfg(**TEXT_CFG), quick_gelu=quick_gelu,
    ).eval()
    with torch.no_grad():  # LayerNorms start at 1 and 0, biases at 0: move them all
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model, dict(embed_dim=16, quick_gelu=quick_gelu, vision_cfg=vision_cfg,
                       text_cfg=TEXT_CFG)


def save(model, model_cfg, tmp_path, container, preprocess_cfg=None):
    """Writes the model's state dict the way `container` names; returns the path to load."""
    state = model.state_dict()
    if container == "pt-training-checkpoint":  # open_clip's training loop, under DDP
        path = tmp_path / "epoch_1.pt"
        torch.save({"epoch": 1, "state_dict": {f"module.{k}": v for k, v in state.items()}},
                   path)
    elif container == "safetensors":
        write_safetensors(state, path := tmp_path / "clip.safetensors")
    elif container == "visual-only":  # model.visual.state_dict(): no `visual.` prefix
        torch.save(model.visual.state_dict(), path := tmp_path / "visual.bin")
    else:  # the Hugging Face hub layout of open_clip releases
        path = tmp_path / "hub"
        path.mkdir()
        if container == "hub-safetensors":
            write_safetensors(state, path / "open_clip_model.safetensors")
        else:
            torch.save(state, path / "open_clip_pytorch_model.bin")
        config = {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg or {}}
        (path / CONFIG_FILE).write_text(json.dumps(config))
    return path


def pixels(size=(32, 32)):
    return torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(3))


def open_clip_hidden_states(visual, x):
    """open_clip's residual stream: the input of block 0, then every block's output."""
    states = []
    batch_first = visual.transformer.batch_first  # else the blocks run on [T, B, D]

    def keep(value):
        states.append(value if batch_first else value.transpose(0, 1))

    blocks = visual.transformer.resblocks
    hooks = [blocks[0].register_forward_pre_hook(lambda module, args: keep(args[0]))]
    hooks += [b.register_forward_hook(lambda module, args, out: keep(out)) for b in blocks]
    try:
        with torch.no_grad():
            visual(x)
    finally:
        for hook in hooks:
            hook.remove()
    return states


def assert_same_function(encoder, model, size=(32, 32)):
    """Every hidden state and the final tokens match open_clip's, within 1e-4."""
    x = pixels(size)
    expected = open_clip_hidden_states(model.visual, x)
    with torch.no_grad():
        out = encoder.eval()(x, output_hidden_states=True)
        tokens = model.visual.ln_post(expected[-1])  # ln_post on every token
    assert len(out.hidden_states) == len(expected) == encoder.config.depth + 1
    for ours, theirs in zip(out.hidden_states, expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.tokens, tokens, atol=1e-4, rtol=1e-4)


def assert_same_embedding(tower, model, size=(32, 32)):
    x = pixels(size)
    with torch.no_grad():
        torch.testing.assert_close(tower.eval()(x), model.encode_image(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quick_gelu", [True, False], ids=["quick_gelu", "gelu"])
@pytest.mark.parametrize("container", CONTAINERS)
def test_loads_like_open_clip(tmp_path, container, quick_gelu):
    has_config = container.startswith("hub")
    model, model_cfg = make_clip(quick_gelu=quick_gelu, head_width=32 if has_config else 64)
    path = save(model, model_cfg, tmp_path, container)
    assert detect_format(read_checkpoint(path)).name == "open_clip"

    # Without a config heads and act are refused unless given (test_bare_state_dicts.py).
    overrides = {} if has_config else {"heads": 1, "act": "quick_gelu" if quick_gelu else "gelu"}
    encoder = load_encoder(path, **overrides)
    config = encoder.config
    assert (config.width, config.depth, config.mlp_width, config.patch_size) == (64, 2, 256, 8)
    assert config.heads == (2 if has_config else 1)
    assert config.act == ("quick_gelu" if quick_gelu else "gelu")
    assert (config.image_size, config.pre_norm, config.norm_eps) == ((32, 32), True, 1e-5)
    assert_same_function(encoder, model)

    assert_same_embedding(load_tower(path, **overrides), model)


def test_openai_layout_float16_with_scalars(tmp_path):
    # OpenAI's checkpoints are this layout (open_clip's build_model_from_openai_state_dict
    # reads them as they are): a QuickGELU CLIP's state dict, with linear, conv and projection
    # weights in float16, the rest in float32, and three scalars of the TorchScript model.
    model, _ = make_clip(quick_gelu=True)
    open_clip_model.convert_weights_to_lp(model, dtype=torch.float16)
    state = {**model.state_dict(), "input_resolution": torch.tensor(32),
             "context_length": torch.tensor(8), "vocab_size": torch.tensor(100)}
    torch.save(state, path := tmp_path / "ViT-tiny.pt")
    model.float()  # the float16 values, upcast: what the converter gives

    converted = convert_checkpoint(path, given=BARE)
    assert "act='quick_gelu' as given" in converted.rules
    encoder = load_encoder(path, **BARE)
    assert {p.dtype for p in encoder.parameters()} == {torch.float32}
    assert encoder.config.act == "quick_gelu"
    assert_same_function(encoder, model)
    assert_same_embedding(load_tower(path, **BARE), model)


EXPRESSIBLE = {
    "final-ln-after-pool": dict(final_ln_after_pool=True),  # the same on the class token
    "custom-block": dict(block_type="custom"),
    "no-ln-pre": dict(no_ln_pre=True),
    "norm-eps": dict(norm_kwargs={"eps": 1e-6}),
    "sin-cos-table": dict(pos_embed_type="sin_cos_2d"),
    "non-square-image": dict(image_size=(32, 48)),
}


@pytest.mark.parametrize("case", sorted(EXPRESSIBLE))
def test_expressible_vision_cfg(tmp_path, case):
    model, model_cfg = make_clip(quick_gelu=False, **EXPRESSIBLE[case])
    path = save(model, model_cfg, tmp_path, "hub-safetensors")
    encoder = load_encoder(path)
    size = model.visual.image_size
    assert encoder.config.image_size == size
    assert encoder.config.pre_norm == (case != "no-ln-pre")
    assert encoder.config.norm_eps == (1e-6 if case == "norm-eps" else 1e-5)
    assert_same_function(encoder, model, size)
    assert_same_embedding(load_tower(path), model, size)


def test_non_square_input_matches_timm_dynamic_img_size(tmp_path):
    build_timm_model = pytest.importorskip("vlm_vit.convert.timm").build_timm_model
    pytest.importorskip("timm")
    model, model_cfg = make_clip(quick_gelu=True)
    encoder = load_encoder(save(model, model_cfg, tmp_path, "safetensors"), **BARE).eval()
    timm_model = build_timm_model(encoder.config, dynamic_img_size=True).eval()
    timm_model.load_state_dict(encoder.state_dict())
    x = pixels((32, 48))
    with torch.no_grad():
        torch.testing.assert_close(encoder(x).tokens, timm_model.forward_features(x),
                                   atol=1e-4, rtol=1e-4)


def test_processor_from_config_and_defaults(tmp_path):
    model, model_cfg = make_clip()
    bare = convert_checkpoint(save(model, model_cfg, tmp_path, "safetensors"),
                              given=BARE).processor
    assert bare == ImageProcessor.for_family("clip", size=(32, 32), resample="bicubic",
                                             resize_mode="shortest_edge")
    preprocess_cfg = dict(mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25],
                          interpolation="bilinear", resize_mode="squash")
    hub = convert_checkpoint(save(model, model_cfg, tmp_path, "hub-bin", preprocess_cfg))
    assert hub.processor == ImageProcessor(size=(32, 32), resize_mode="squash",
                                           resample="bilinear", mean=(0.5,) * 3, std=(0.25,) * 3)
    assert hub.rules == []


def test_processor_without_equivalent_is_none_with_a_rule(tmp_path):
    model, model_cfg = make_clip()
    path = save(model, model_cfg, tmp_path, "hub-safetensors", {"resize_mode": "longest"})
    converted = convert_checkpoint(path)
    assert converted.processor is None
    assert any("'longest'" in rule for rule in converted.rules)


def test_round_trip_through_open_clip_file(tmp_path):
    model, model_cfg = make_clip(quick_gelu=True)
    source = save(model, model_cfg, tmp_path, "safetensors")
    encoder, tower = load_encoder(source, **BARE), load_tower(source, **BARE)
    written = FORMATS.get("open_clip").write(encoder, tmp_path / "out" / "visual.safetensors",
                                             pooler=tower.pooler)
    tensors = read_safetensors(written)
    assert all(name.startswith("visual.") for name in tensors)

    back = load_encoder(written, **BARE)
    assert back.config == encoder.config
    assert back.state_dict().keys() == encoder.state_dict().keys()
    for name, tensor in encoder.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert torch.equal(load_tower(written, **BARE).pooler.proj.weight,
                       tower.pooler.proj.weight)

    fresh, _ = make_clip(quick_gelu=True, seed=1)
    fresh.visual.load_state_dict({k.removeprefix("visual."): v for k, v in tensors.items()})
    x = pixels()
    with torch.no_grad():
        torch.testing.assert_close(fresh.encode_image(x), model.encode_image(x), atol=0, rtol=0)


def clip_like(**overrides):
    return EncoderConfig(**{**dict(image_size=32, patch_size=8, width=64, depth=2, heads=1,
                                   mlp_width=128, pre_norm=True, act="quick_gelu",
                                   norm_eps=1e-5, patch_bias=False), **overrides})


def test_native_round_trip_without_pooler_is_bit_exact(tmp_path):
    torch.manual_seed(0)
    encoder = VisionEncoder(clip_like())
    written = FORMATS.get("open_clip").write(encoder, tmp_path / "visual.safetensors")
    assert "visual.proj" not in read_safetensors(written)  # no pooler, no projection
    back = load_encoder(written, **BARE)
    assert back.config == encoder.config
    for name, tensor in encoder.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="no pooling head"):
        load_tower(written, **BARE)


@pytest.mark.parametrize("overrides, field", [
    (dict(class_token=False), "class_token"),
    (dict(num_register_tokens=2), "num_register_tokens"),
    (dict(pre_norm=False), "pre_norm"),
    (dict(patch_bias=True), "patch_bias"),
    (dict(heads=2), "head_width"),
    (dict(image_size=(32, 48)), "square_image"),
    (dict(final_norm=False), "final_norm"),
    (dict(qkv_bias=False), "qkv_bias"),
    (dict(norm_eps=1e-6), "norm_eps"),
])
def test_write_refuses_what_open_clip_cannot_express(tmp_path, overrides, field):
    encoder = VisionEncoder(clip_like(**overrides))
    with pytest.raises(ValueError, match=f"{field}="):
        FORMATS.get("open_clip").write(encoder, tmp_path / "visual.safetensors")
    assert not (tmp_path / "visual.safetensors").exists()


@pytest.mark.parametrize("pooler, options", [("mean", {}), ("cls_linear", {"bias": True}),
                                             ("cls_linear", {"act": "tanh", "bias": False})])
def test_write_refuses_other_poolers(tmp_path, pooler, options):
    head = build_pooler(pooler, in_dim=64, **options)
    with pytest.raises(ValueError, match=f"pooler '{pooler}'"):
        FORMATS.get("open_clip").write(VisionEncoder(clip_like()), tmp_path / "v.safetensors",
                                       pooler=head)


def test_write_needs_a_safetensors_path(tmp_path):
    with pytest.raises(ValueError, match=r"\.safetensors"):
        FORMATS.get("open_clip").write(VisionEncoder(clip_like()), tmp_path / "visual.pt")


UNSUPPORTED_MODELS = {
    "attentional-pool": (dict(attentional_pool=True, attn_pooler_queries=4,
                              attn_pooler_heads=2), "attentional pooling"),
    "layer-scale": (dict(ls_init_value=1e-5), "layer scale"),
    "qk-norm": (dict(qk_norm=True), "qk_norm"),
    "scale-fc": (dict(scale_fc=True), "scale_fc"),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED_MODELS))
def test_unsupported_towers_are_named(tmp_path, case):
    vision, message = UNSUPPORTED_MODELS[case]
    model, model_cfg = make_clip(**vision)
    path = save(model, model_cfg, tmp_path, "safetensors")
    with pytest.raises(ValueError, match=message):
        load_encoder(path)


@pytest.mark.parametrize("vision, message", [
    (dict(pool_type="avg"), "pool_type='avg'"),
    (dict(act_kwargs={"approximate": "tanh"}), "act_kwargs="),
    (dict(norm_kwargs={"elementwise_affine": True}), "norm_kwargs="),
])
def test_unsupported_vision_cfg_is_named(tmp_path, vision, message):
    # The weights have the usual names and shapes: only the config tells.
    model, model_cfg = make_clip()
    model_cfg["vision_cfg"].update(vision)
    path = save(model, model_cfg, tmp_path, "hub-safetensors")
    with pytest.raises(ValueError, match=message):
        load_encoder(path)


@pytest.mark.parametrize("tensors, message", [
    ({"visual.trunk.patch_embed.proj.weight": torch.zeros(8, 3, 4, 4),
      "logit_scale": torch.zeros(())}, "timm image tower"),
    ({"visual.conv1.weight": torch.zeros(8, 3, 3, 3),
      "visual.layer1.0.conv1.weight": torch.zeros(8, 8, 1, 1),
      "logit_scale": torch.zeros(())}, "ModifiedResNet"),
])
def test_other_open_clip_towers_are_named(tmp_path, tensors, message):
    write_safetensors(tensors, path := tmp_path / "clip.safetensors")
    with pytest.raises(ValueError, match=message):
        load_encoder(path)


@pytest.mark.parametrize("extra, message", [
    ({"visual.conv1.bias": torch.zeros(64)}, "conv1.bias"),
    ({"text_decoder.x": torch.zeros(1)}, "text_decoder.x"),
])
def test_unknown_tensors_are_listed(tmp_path, extra, message):
    model, _ = make_clip()
    write_safetensors({**model.state_dict(), **extra}, path := tmp_path / "clip.safetensors")
    with pytest.raises(ValueError, match=message):
        load_encoder(path, **BARE)


def test_non_square_table_without_config_is_refused(tmp_path):
    model, _ = make_clip(image_size=(32, 48))
    write_safetensors(model.state_dict(), path := tmp_path / "clip.safetensors")
    with pytest.raises(ValueError, match="not 1 \\+ a .*open_clip_config.json"):
        load_encoder(path, **BARE)


def test_default_mean_std_are_open_clips():
    constants = pytest.importorskip("open_clip.constants")
    assert NORMALIZATION["clip"] == (constants.OPENAI_DATASET_MEAN, constants.OPENAI_DATASET_STD)


@pytest.mark.parametrize("projection", [False, True])
def test_open_clip_loads_our_directory_by_its_own_factory(tmp_path, projection):
    """`open_clip.create_model("local-dir:DIR")`, the line the README gives."""
    from vlm_vit.testing import perturbed

    config = EncoderConfig(image_size=32, patch_size=8, width=128, depth=2, heads=2,
                           mlp_width=256, pre_norm=True, act="quick_gelu", norm_eps=1e-5,
                           patch_bias=False)
    encoder = perturbed(VisionEncoder(config))
    pooler = perturbed(build_pooler("cls_linear", in_dim=128, out_dim=48, bias=False,
                                    act=None)) if projection else None
    processor = ImageProcessor.for_family("clip", size=32)
    FORMATS.get("open_clip").write(encoder, tmp_path / "oc", pooler=pooler, processor=processor)
    factory = pytest.importorskip("open_clip")
    model, _, preprocess = factory.create_model_and_transforms(f"local-dir:{tmp_path / 'oc'}")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model.eval().encode_image(x)
        ours = encoder(x).cls_token if pooler is None else pooler(
            encoder(x).tokens, num_prefix_tokens=1, grid=(4, 4))
        # measured: at most 9.5e-7 (with the projection), 4.8e-7 without
        torch.testing.assert_close(theirs, ours, atol=2e-6, rtol=0)
        torch.testing.assert_close(load_tower(tmp_path / "oc")(x), theirs, atol=2e-6, rtol=0)
    normalize = preprocess.transforms[-1]
    assert tuple(normalize.mean) == processor.mean and tuple(normalize.std) == processor.std
    back = load_encoder(tmp_path / "oc")
    assert back.config == config
    assert all(torch.equal(t, back.state_dict()[n]) for n, t in encoder.state_dict().items())


def test_an_activation_open_clip_cannot_build_is_refused(tmp_path):
    config = EncoderConfig(image_size=32, patch_size=8, width=128, depth=1, heads=2,
                           mlp_width=256, pre_norm=True, act="gelu_tanh", norm_eps=1e-5,
                           patch_bias=False)
    with pytest.raises(ValueError, match="act='gelu_tanh'"):
        FORMATS.get("open_clip").write(VisionEncoder(config), tmp_path / "oc")
    assert not (tmp_path / "oc").exists()
