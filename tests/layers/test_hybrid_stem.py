"""The hybrid stem (ResNet-v2, group norm, weight-standardised convs) against timm's
`vit_base_r50_s16_384` patch embedding on the same random weights, and its grid at 224 and
384."""

import pytest
import torch

from vlm_vit.layers.hybrid_stem import (
    HybridPatchEmbed,
    WeightStandardizedConv2d,
    same_padding,
    same_padding_divisible,
)

LAYERS = (2, 1, 2)  # fewer blocks than (3, 4, 9) to keep the test fast; same construction


def _timm_hybrid(img_size, device="cpu"):
    import timm

    with torch.device(device):  # depth 1: only the patch embedding matters here
        return timm.create_model("vit_base_r50_s16_384", pretrained=False, img_size=img_size,
                                 depth=1)


@pytest.fixture(scope="module")
def pair():
    from timm.models.vision_transformer_hybrid import _resnetv2

    torch.manual_seed(0)
    # the helper vit_base_r50_s16_384 builds its backbone with (StdConv2dSame eps 1e-8,
    # GroupNormAct 32, "same" stem, preact=False), with fewer blocks per stage
    backbone = _resnetv2(LAYERS).eval()
    proj = torch.nn.Conv2d(1024, 64, 1)
    with torch.no_grad():  # off their init (unit scales, zero shifts, zeroed norm3)
        for name, parameter in backbone.named_parameters():
            if "norm" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.5 + name.endswith("weight"))
    ours = HybridPatchEmbed(64, layers=LAYERS).eval()
    # the key map is the identity on timm's `patch_embed.*` names
    state = {f"backbone.{k}": v for k, v in backbone.state_dict().items()}
    state.update({f"proj.{k}": v for k, v in proj.state_dict().items()})
    ours.load_state_dict(state, strict=True)
    return ours, torch.nn.ModuleDict({"backbone": backbone, "proj": proj})


def _reference(theirs, x):
    return theirs.proj(theirs.backbone(x)).flatten(2).transpose(1, 2)


@pytest.mark.parametrize("size", [(64, 64), (48, 80)])
def test_matches_timm_resnetv2_of_vit_base_r50_s16_384(pair, size):
    ours, theirs = pair
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        tokens, grid = ours(x)
        expected = _reference(theirs, x)
    assert grid == (size[0] // 16, size[1] // 16)
    # float32: standardisation by var_mean against timm's batch_norm, then many convs and
    # norms: measured 8.6e-6 on outputs up to 3.4 (3 seeds; 5.4e-5 with all of (3, 4, 9));
    # float64 below: 1.5e-14, the same arithmetic
    torch.testing.assert_close(tokens, expected, rtol=0, atol=5e-5)


def test_matches_timm_in_float64(pair):
    ours, theirs = pair
    x = torch.randn(1, 3, 48, 64, dtype=torch.float64)
    with torch.no_grad():
        tokens, _ = ours.double()(x)
        expected = _reference(theirs.double(), x)
    ours.float(), theirs.float()
    torch.testing.assert_close(tokens, expected, rtol=0, atol=1e-10)


def test_grid_for_224_and_384_inputs():
    with torch.device("meta"):  # shapes only: no arithmetic
        ours = HybridPatchEmbed(768)
    for side, grid in ((224, (14, 14)), (384, (24, 24))):
        theirs = _timm_hybrid(side, "meta").patch_embed
        assert theirs.grid_size == grid
        # the full (3, 4, 9) backbone: every timm name and shape, no more
        ours.load_state_dict(theirs.state_dict(), strict=True, assign=True)
        assert ours.grid(side, side) == grid
        tokens, forward_grid = ours(torch.empty(1, 3, side, side, device="meta"))
        assert forward_grid == grid and tokens.shape == (1, grid[0] * grid[1], 768)
    assert ours.patch_size == 16


def test_same_padding_puts_the_odd_pixel_after():
    assert same_padding(64, 7, 2) == (2, 3)  # the stem
    assert same_padding(64, 3, 2) == (0, 1)  # a strided 3x3
    assert same_padding(63, 3, 2) == (1, 1)
    assert same_padding(64, 1, 2) == (0, 0)
    # on a side the stride divides, the padding does not depend on the size
    for kernel, stride in ((7, 2), (3, 2), (3, 1), (1, 2), (1, 1)):
        for size in range(stride, 100, stride):
            assert same_padding_divisible(kernel, stride)[:2] == same_padding(size, kernel, stride)


def test_weight_standardisation_ignores_the_kernels_scale_and_shift():
    torch.manual_seed(0)
    conv = WeightStandardizedConv2d(4, 8, 3)
    x = torch.randn(1, 4, 6, 6)
    out = conv(x)
    with torch.no_grad():
        conv.weight.mul_(3.0).add_(0.5)
    torch.testing.assert_close(conv(x), out, rtol=0, atol=5e-5)  # measured 1.1e-5


def test_bad_configs_and_sizes_are_refused():
    with pytest.raises(ValueError, match=r"image size 202x224 is not a positive multiple of the "
                                         r"hybrid backbone's stride 4"):
        HybridPatchEmbed(32, layers=(1,)).grid(202, 224)  # the stem alone strides 4
    with pytest.raises(ValueError, match=r"at least one stage"):
        HybridPatchEmbed(32, layers=())
    with pytest.raises(ValueError, match=r"stem width 48 is not divisible by group norm's 32"):
        HybridPatchEmbed(32, layers=(1,), stem_width=48)


def test_exports_for_any_size_on_the_stride():
    # the padding is fixed at construction, so the traced program holds no size guard
    from torch.export import Dim, export

    class Tokens(torch.nn.Module):
        def __init__(self, embed):
            super().__init__()
            self.embed = embed

        def forward(self, pixel_values):
            return self.embed(pixel_values)[0]

    torch.manual_seed(0)
    embed = HybridPatchEmbed(32, layers=(1, 1)).eval()
    stride = embed.patch_size  # 8
    rows, cols = Dim("rows", min=1, max=64), Dim("cols", min=1, max=64)
    program = export(Tokens(embed), (torch.randn(1, 3, 4 * stride, 4 * stride),),
                     dynamic_shapes=({2: stride * rows, 3: stride * cols},))
    x = torch.randn(1, 3, 5 * stride, 7 * stride)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), embed(x)[0], rtol=0, atol=1e-6)
