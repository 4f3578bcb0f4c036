"""A bare state dict (no config beside it) is read right or refused, never guessed
(`vlm_vit.convert.bare`): the heads are not in a fused qkv, so a family's reader takes
`heads=`, or its table of known architectures when the tensors' sizes are one's, or refuses
naming `heads=`. Each family is built with its own library at a head count the old rule
(width // 64) got wrong."""

import pytest
import torch

from vlm_vit import load_encoder
from vlm_vit.convert import FORMATS, Checkpoint
from vlm_vit.io.files import write_safetensors
from vlm_vit.testing import perturbed

timm = pytest.importorskip("timm")
open_clip_model = pytest.importorskip("open_clip.model")


def timm_vit(**options):
    return timm.models.vision_transformer.VisionTransformer(
        **{**dict(img_size=32, patch_size=8, num_classes=0), **options})


def open_clip_tower(width, layers, heads, quick_gelu):
    vision = open_clip_model.CLIPVisionCfg(layers=layers, width=width, head_width=width // heads,
                                           patch_size=8, image_size=32)
    return open_clip_model._build_vision_tower(16, vision, quick_gelu=quick_gelu)


# family -> (build the library's model, the image size, load_encoder's format, what else a
# bare file of it must be given). Width 64 with 2 heads: width // 64 would say 1.
FAMILIES = {
    "timm ViT": (lambda: timm_vit(embed_dim=64, depth=2, num_heads=2), 32, None, {}),
    "timm EVA-02": (lambda: timm.create_model("eva02_tiny_patch14_224", embed_dim=64, depth=2,
                                              num_heads=2, num_classes=0), 224, None, {}),
    "timm AIMv2": (lambda: timm.create_model("aimv2_large_patch14_224", img_size=28,
                                             patch_size=7, embed_dim=64, depth=2, num_heads=2,
                                             num_classes=0), 28, None, {}),
    "timm DINOv3": (lambda: timm.create_model("vit_small_patch16_dinov3", img_size=32,
                                              patch_size=8, embed_dim=64, depth=2, num_heads=2,
                                              num_classes=0), 32, "timm_dinov3", {}),
    "open_clip": (lambda: open_clip_tower(64, 2, 2, quick_gelu=False), 32, None,
                  {"act": "gelu"}),
}


def block_outputs(model, x):
    """The library's residual stream after every block, (B, T, D), by forward hooks."""
    blocks = model.transformer.resblocks if hasattr(model, "transformer") else model.blocks
    states = []
    hooks = [b.register_forward_hook(lambda module, args, out: states.append(out))
             for b in blocks]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for hook in hooks:
            hook.remove()
    batch_first = getattr(getattr(model, "transformer", None), "batch_first", True)
    return states if batch_first else [s.transpose(0, 1) for s in states]


def save_bare(tmp_path, model):
    path = tmp_path / "bare.safetensors"
    write_safetensors({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return path


def assert_every_hidden_state_equal(ours, model, size):
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = ours.eval()(x, output_hidden_states=True).hidden_states[1:]
    expected = block_outputs(model, x)
    assert len(hidden) == len(expected) == ours.config.depth
    for mine, theirs in zip(hidden, expected, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_bare_state_dict_is_refused_without_heads_and_exact_with_them(tmp_path, family):
    build, size, format, also = FAMILIES[family]
    torch.manual_seed(0)
    model = perturbed(build()).eval()
    path = save_bare(tmp_path, model)
    with pytest.raises(ValueError, match=r"does not record heads.*pass heads=") as info:
        load_encoder(path, format=format, **also)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    ours = load_encoder(path, format=format, heads=2, **also)
    assert ours.config.heads == 2
    assert_every_hidden_state_equal(ours, model, size)


def test_a_bare_open_clip_state_dict_is_refused_without_act(tmp_path):
    torch.manual_seed(0)
    path = save_bare(tmp_path, open_clip_tower(64, 2, 2, quick_gelu=True))
    with pytest.raises(ValueError, match=r"does not record act.*act='quick_gelu'.*act='gelu'"):
        load_encoder(path, heads=2)


@pytest.mark.parametrize("case", ["timm vit_tiny", "timm eva02_tiny"])
def test_a_known_architectures_shape_resolves_to_its_heads(tmp_path, case):
    torch.manual_seed(0)
    if case == "timm vit_tiny":  # (192, 12, 768, class token): vit_tiny's 3 heads
        model, size = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=0), 32
    else:  # (192, 12, SwiGLU 512): eva02_tiny's 3 heads (Eva's default would be 12)
        model, size = timm.create_model("eva02_tiny_patch14_224", num_classes=0), 224
    path = save_bare(tmp_path, perturbed(model).eval())
    ours = load_encoder(path)
    assert ours.config.heads == 3
    assert_every_hidden_state_equal(ours, model, size)


def test_a_shape_known_architectures_share_with_other_heads_is_refused():
    from vlm_vit.convert.timm import KNOWN_HEADS

    # vit_base_patch16_gap_224 (16 heads) and the SigLIP bases (12) share these tensors' sizes
    assert (768, 12, 3072, False) not in KNOWN_HEADS


def meta_state(model):
    return {k: torch.empty(v.shape, device="meta") for k, v in model.state_dict().items()}


def timm_known():
    from vlm_vit.convert import timm as timm_vit_format
    from vlm_vit.convert import timm_aimv2, timm_dinov3, timm_eva

    tables = [("timm", timm_vit_format.KNOWN_HEADS), ("timm_eva", timm_eva.KNOWN_HEADS),
              ("timm_aimv2", timm_aimv2.KNOWN_HEADS), ("timm_dinov3", timm_dinov3.KNOWN_HEADS)]
    return [(fmt, name) for fmt, table in tables for _, name in table.values()]


@pytest.mark.parametrize("format, architecture", timm_known())
def test_each_known_timm_architecture_resolves_to_its_own_heads(format, architecture):
    with torch.device("meta"):
        model = timm.create_model(architecture, pretrained=False, num_classes=0)
    checkpoint = Checkpoint(path=architecture, tensors=meta_state(model))
    converted = FORMATS.get(format).to_native(checkpoint)
    assert converted.config.heads == model.blocks[0].attn.num_heads


def test_each_known_open_clip_shape_resolves_to_its_configs_heads():
    import open_clip

    from vlm_vit.convert.open_clip import KNOWN_HEADS

    for heads, name in KNOWN_HEADS.values():
        vision = open_clip.get_model_config(name)["vision_cfg"]
        with torch.device("meta"):
            tower = open_clip_model._build_vision_tower(
                16, open_clip_model.CLIPVisionCfg(**vision), quick_gelu=False)
        checkpoint = Checkpoint(path=name, tensors=meta_state(tower), given={"act": "gelu"})
        converted = FORMATS.get("open_clip").to_native(checkpoint)
        assert converted.config.heads == heads == vision["width"] // vision.get("head_width", 64)


def test_google_npz_heads_are_proven_by_the_kernels(tmp_path):
    from .test_jax_npz import google_arrays, save, timm_from_npz, timm_model

    path = save(tmp_path / "vit.npz", google_arrays(timm_model()))  # width 32, 4 heads
    ours = load_encoder(path)
    assert ours.config.heads == 4  # the query kernel's [D, heads, head_dim]
    assert_every_hidden_state_equal(ours, timm_from_npz(path), 32)


def test_the_convert_command_takes_heads_and_act_for_a_bare_file(tmp_path, capsys):
    from vlm_vit.cli import main

    torch.manual_seed(0)
    model = perturbed(open_clip_tower(64, 2, 2, quick_gelu=True)).eval()
    path = save_bare(tmp_path, model)
    assert main(["convert", str(path), str(tmp_path / "out"), "--to", "native"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "does not record heads" in lines[0]
    assert main(["convert", str(path), str(tmp_path / "out"), "--to", "native", "--heads", "2",
                 "--act", "quick_gelu"]) == 0
    assert_every_hidden_state_equal(load_encoder(tmp_path / "out"), model, 32)
