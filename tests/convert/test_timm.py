"""timm state dicts load to the same function as timm's own VisionTransformer."""

import json

import pytest
import torch

from vlm_vit import load_encoder, load_tower
from vlm_vit.convert.timm import TimmFormat
from vlm_vit.io.files import write_safetensors

vision_transformer = pytest.importorskip("timm.models.vision_transformer")

# width 128 with 2 heads: no known architecture's shape, so a bare file needs heads=2.
BASE = dict(img_size=32, patch_size=8, embed_dim=128, depth=2, num_heads=2, num_classes=0)
CASES = {
    "class-token": dict(),
    "avg-no-class-token": dict(class_token=False, global_pool="avg", fc_norm=False),
    "registers-in-table": dict(reg_tokens=2),
    "no-embed-class-registers": dict(reg_tokens=3, no_embed_class=True),
    "pre-norm-no-final-norm": dict(pre_norm=True, final_norm=False),
    "classifier-head": dict(num_classes=10),
}


def timm_model(**options):
    torch.manual_seed(0)
    return vision_transformer.VisionTransformer(**{**BASE, **options}).eval()


def compare(ours, theirs, size=(32, 32)):
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        blocks = theirs.forward_intermediates(x, norm=False, intermediates_only=True,
                                              output_fmt="NLC")
        expected = theirs.forward_features(x)
    torch.testing.assert_close(out.tokens, expected, atol=1e-4, rtol=1e-4)
    assert len(out.hidden_states) - 1 == len(blocks) == ours.config.depth
    for hidden, block in zip(out.hidden_states[1:], blocks, strict=True):
        torch.testing.assert_close(hidden[:, out.num_prefix_tokens:], block, atol=1e-4,
                                   rtol=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_timm_state_dict_parity(tmp_path, case):
    theirs = timm_model(**CASES[case])
    path = tmp_path / "weights.safetensors"
    write_safetensors(theirs.state_dict(), path)
    ours = load_encoder(path, heads=2).eval()
    assert ours.config.heads == 2 and ours.config.depth == 2
    compare(ours, theirs)


def test_pth_file_and_classifier_head_ignored(tmp_path):
    theirs = timm_model(num_classes=10)
    torch.save({"state_dict": theirs.state_dict()}, tmp_path / "checkpoint.pth")
    compare(load_encoder(tmp_path / "checkpoint.pth", heads=2).eval(), theirs)


def test_non_square_matches_dynamic_img_size(tmp_path):
    theirs = timm_model(dynamic_img_size=True)
    write_safetensors(theirs.state_dict(), tmp_path / "w.safetensors")
    compare(load_encoder(tmp_path / "w.safetensors", heads=2).eval(), theirs, size=(24, 48))


def test_heads_from_timm_config_json(tmp_path):
    theirs = timm_model(embed_dim=64, num_heads=4)  # the width // 64 rule would say 1
    write_safetensors(theirs.state_dict(), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(
        {"architecture": "vit_custom", "model_args": {"num_heads": 4, "img_size": [32, 32]}}))
    ours = load_encoder(tmp_path).eval()
    assert ours.config.heads == 4
    compare(ours, theirs)


def test_native_pooler_is_the_class_token(tmp_path):
    theirs = timm_model()
    write_safetensors(theirs.state_dict(), tmp_path / "w.safetensors")
    tower = load_tower(tmp_path / "w.safetensors", heads=2).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(tower(x), theirs(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("registers", [0, 2])
def test_round_trip_native_timm_native_is_bit_exact(tmp_path, registers):
    from vlm_vit import VisionEncoder

    from ..conftest import tiny_config

    torch.manual_seed(0)
    encoder = VisionEncoder(tiny_config(num_register_tokens=registers, pre_norm=True,
                                        patch_bias=False)).eval()  # timm ties the two
    TimmFormat().write(encoder, tmp_path / "timm")
    back = load_encoder(tmp_path / "timm")
    assert back.config == encoder.config
    for name, tensor in encoder.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    # and timm itself computes the same function from the written file
    from safetensors.torch import load_file

    from vlm_vit.convert.timm import build_timm_model

    theirs = build_timm_model(encoder.config).eval()
    theirs.load_state_dict(load_file(tmp_path / "timm" / "model.safetensors"))
    compare(encoder, theirs)


TIMM_FRONT_DOOR = {
    "paper vit-ti/16": ("vit-ti/16", {}, "vit_tiny_patch16_224"),
    "custom tiny": (None, {}, "vit_base_patch16_224"),
    "clip-style, eps 1e-5": (None, dict(pre_norm=True, patch_bias=False, act="quick_gelu",
                                        norm_eps=1e-5), "vit_base_patch16_clip_224"),
    "registers": (None, dict(num_register_tokens=2), "vit_base_patch16_224"),
}


@pytest.mark.parametrize("case", sorted(TIMM_FRONT_DOOR))
def test_timm_loads_what_we_write_by_its_own_front_door(tmp_path, case):
    """`timm.create_model("local-dir:DIR", pretrained=True)`, the line the README gives."""
    import json

    import timm

    from vlm_vit import EncoderConfig, VisionEncoder

    from ..conftest import tiny_config

    variant, options, architecture = TIMM_FRONT_DOOR[case]
    torch.manual_seed(0)
    config = EncoderConfig.from_name(variant) if variant else tiny_config(**options)
    encoder = VisionEncoder(config).eval()
    TimmFormat().write(encoder, tmp_path / "timm")
    assert json.loads((tmp_path / "timm" / "config.json").read_text())["architecture"] == \
        architecture
    theirs = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    x = torch.randn(1, 3, *config.image_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, timm_tokens = encoder(x).tokens, theirs.forward_features(x)
    torch.testing.assert_close(timm_tokens, ours, atol=1e-6, rtol=0)  # measured: 0.0


@pytest.mark.parametrize("options, message", [
    (dict(norm_eps=1e-4), "norm_eps=0.0001"),
    (dict(pre_norm=True), "ties the patch embedding's bias to pre-norm"),
])
def test_what_timm_s_factory_cannot_build_is_refused(tmp_path, options, message):
    from vlm_vit import VisionEncoder

    from ..conftest import tiny_config

    with pytest.raises(ValueError, match=message):
        TimmFormat().write(VisionEncoder(tiny_config(**options)), tmp_path / "timm")
    assert not (tmp_path / "timm").exists()
