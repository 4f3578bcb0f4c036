"""timm's AIMv2 (`aimv2_large_patch14_224`'s arguments at tiny size: RMSNorm, SwiGLU, a norm on
the patch embeddings, no biases on the attention output and the MLP, mean pooling) loads to
the same function as timm's own model: every hidden state, the final tokens and the pooled
output within 1e-5 on perturbed weights, at the native size, at another (timm's
`dynamic_img_size`) and packed; written back by our `timm_aimv2` writer, timm builds it and
loads it strictly. A bare state dict, which does not record its heads, and hostile
`model_args` are refused by name before a model is built (issue 45)."""

import json

import pytest
import torch

from vlm_vit import load_encoder, load_tower
from vlm_vit.convert import FORMATS, detect_format
from vlm_vit.io.files import write_safetensors
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.testing import perturbed

from .refusals import assert_refused_before_building

timm = pytest.importorskip("timm")
timm_hub = pytest.importorskip("timm.models._hub")

ARCHITECTURE = "aimv2_large_patch14_224"
TINY = dict(img_size=28, patch_size=7, embed_dim=32, depth=2, num_heads=2, num_classes=0)
OTHER_SIZE = (35, 21)


def save_aimv2(folder, **options):
    """A tiny timm AIMv2 at random init (perturbed), saved in timm's hub layout."""
    torch.manual_seed(0)
    args = {**TINY, **options}
    model = perturbed(timm.create_model(ARCHITECTURE, pretrained=False, dynamic_img_size=True,
                                        **args))
    timm_hub.save_for_hf(model, str(folder), model_args=args, safe_serialization=True)
    return folder, model


def timm_states(model, x):
    """timm's tokens after the embedding and after every block, the final tokens and the
    pooled output."""
    tokens = model.norm_pre(model._pos_embed(model.patch_embed(x)))
    states = [tokens]
    for block in model.blocks:
        tokens = block(tokens)
        states.append(tokens)
    final = model.norm(tokens)
    return states, final, model.forward_head(final)


def assert_matches(ours, tower, model, x):
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        states, final, pooled = timm_states(model.eval(), x)
        mine = [*out.hidden_states, out.tokens, tower(x)]
    assert len(out.hidden_states) == TINY["depth"] + 1
    for ours_tensor, theirs in zip(mine, [*states, final, pooled], strict=True):
        torch.testing.assert_close(ours_tensor, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", [{}, dict(qkv_bias=True, proj_bias=True)],
                         ids=["aimv2", "biased"])
def test_every_hidden_state_and_the_pool_match_timm(tmp_path, options):
    folder, model = save_aimv2(tmp_path, **options)
    checkpoint = read_checkpoint(folder)
    assert detect_format(checkpoint).name == "timm_aimv2"
    assert not FORMATS.get("timm").matches(checkpoint)  # the generic ViT leaves it alone
    ours, tower = load_encoder(folder).eval(), load_tower(folder).eval()
    assert (ours.config.heads, ours.config.mlp_width, ours.config.norm_eps,
            ours.config.patch_norm) == (2, 88, 1e-5, True)
    assert tower.pooler.pooler_spec["name"] == "mean"
    for size in [(28, 28), OTHER_SIZE]:
        x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
        assert_matches(ours, tower, model, x)


def test_packed_images_match_timm_image_by_image(tmp_path):
    folder, model = save_aimv2(tmp_path)
    ours = load_encoder(folder).eval()
    images = [torch.randn(3, *size, generator=torch.Generator().manual_seed(2))
              for size in (OTHER_SIZE, (28, 28))]
    with torch.no_grad():
        packed = ours(images)
        expected = [timm_states(model, image[None])[1][0] for image in images]
    for i, theirs in enumerate(expected):
        torch.testing.assert_close(packed.tokens[packed.offsets[i]:packed.offsets[i + 1]],
                                   theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", [{}, dict(qkv_bias=True, proj_bias=True)],
                         ids=["aimv2", "biased"])
def test_written_back_timm_loads_strictly_the_same_model(tmp_path, options):
    folder, original = save_aimv2(tmp_path / "original", **options)
    ours, tower = load_encoder(folder).eval(), load_tower(folder).eval()
    destination = tmp_path / "written"
    FORMATS.get("timm_aimv2").write(ours, destination, pooler=tower.pooler)
    meta = json.loads((destination / "config.json").read_text())
    assert meta["model_args"]["proj_bias"] is bool(options)
    from safetensors.torch import load_file

    again = timm.create_model(meta["architecture"], pretrained=False, dynamic_img_size=True,
                              **meta["model_args"]).eval()
    again.load_state_dict(load_file(destination / "model.safetensors"), strict=True)
    for size in [(28, 28), OTHER_SIZE]:
        x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(3))
        assert_matches(ours, tower, again, x)
    hub = timm.create_model(f"local-dir:{destination}", pretrained=True).eval()  # strict too
    x = torch.randn(1, 3, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(hub(x), original(x), atol=1e-5, rtol=1e-5)


def test_a_bare_state_dict_is_refused_naming_the_heads(tmp_path):
    _, model = save_aimv2(tmp_path / "saved")
    write_safetensors(model.state_dict(), tmp_path / "bare.safetensors")
    with pytest.raises(ValueError, match=r"does not record heads.*pass heads=.*num_heads"):
        load_encoder(tmp_path / "bare.safetensors")


@pytest.mark.parametrize(("change", "named"), [
    (dict(num_heads=3), "width 32 is not divisible by heads 3"),
    (dict(num_heads=0), "model_args.num_heads"),
    (dict(img_size=7 * 10**6), "model_args.img_size"),
    (dict(embed_dim=10**6), "model_args.embed_dim is 1000000 but the weights hold 32"),
    (dict(global_pool="map"), "global_pool='map'"),
], ids=["heads_not_dividing", "zero_heads", "huge_image", "huge_width", "map_pool"])
def test_hostile_model_args_are_refused_before_a_model_is_built(tmp_path, monkeypatch, change,
                                                                 named):
    folder, _ = save_aimv2(tmp_path)
    meta = json.loads((folder / "config.json").read_text())
    meta["model_args"].update(change)
    (folder / "config.json").write_text(json.dumps(meta))
    assert_refused_before_building(folder, monkeypatch, named)


def test_the_writer_refuses_what_timm_aimv2_cannot_hold_by_name(tmp_path):
    from vlm_vit import EncoderConfig, VisionEncoder

    encoder = VisionEncoder(EncoderConfig(image_size=28, patch_size=7, width=32, depth=1,
                                          heads=2, mlp_width=64))
    with pytest.raises(ValueError) as error:
        FORMATS.get("timm_aimv2").write(encoder, tmp_path / "refused")
    assert str(error.value) == (
        "timm's AIMv2 cannot hold this encoder: norm='layernorm' (timm's AIMv2 needs "
        "'rmsnorm'); norm_eps=1e-06 (timm's AIMv2 needs 1e-05); mlp='mlp' (timm's AIMv2 needs "
        "'swiglu'); act='gelu' (timm's AIMv2 needs 'silu'); patch_norm=False (timm's AIMv2 "
        "needs True); class_token=True (timm's AIMv2 needs False)")
    assert not (tmp_path / "refused").exists()
