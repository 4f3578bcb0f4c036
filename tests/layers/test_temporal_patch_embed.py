"""The temporal patch embedding: its image case is the 2D patch embedding, and it equals
transformers' Qwen2-VL PatchEmbed on the same weights."""

import pytest
import torch

from vlm_vit.layers.patch_embed import PatchEmbed
from vlm_vit.layers.temporal_patch_embed import TemporalPatchEmbed, inflate_patch_kernel

P, C, D, T = 4, 3, 16, 2


def _repeated(image, frames=T):
    return image[:, :, None].expand(-1, -1, frames, -1, -1)  # (B, C, frames, H, W)


def test_a_repeated_frame_equals_the_2d_embedding_exactly():
    torch.manual_seed(0)
    flat = PatchEmbed(P, C, D, bias=True)
    temporal = TemporalPatchEmbed(P, C, D, temporal_patch_size=T, bias=True)
    with torch.no_grad():
        temporal.proj.weight.copy_(inflate_patch_kernel(flat.proj.weight, T))
        temporal.proj.bias.copy_(flat.proj.bias)
    image = torch.randn(2, C, 3 * P, 5 * P)
    tokens, grid = temporal(image)
    expected, expected_grid = flat(image)
    assert grid == expected_grid == (3, 5)
    assert torch.equal(tokens, expected)  # the inflated kernel sums back to W exactly
    # the Conv3d on the repeated frame: the same map, summed in another order (measured 7.2e-7)
    clip_tokens, clip_grid = temporal.forward_clip(_repeated(image))
    assert clip_grid == (1, 3, 5)
    torch.testing.assert_close(clip_tokens, expected, rtol=0, atol=2e-6)
    # on integers every sum is exact in any order: equal bit for bit
    with torch.no_grad():
        flat.proj.weight.copy_(torch.randint(-4, 5, flat.proj.weight.shape) * 2.0)
        temporal.proj.weight.copy_(inflate_patch_kernel(flat.proj.weight, T))
        flat.proj.bias.copy_(torch.randint(-4, 5, (D,)))
        temporal.proj.bias.copy_(flat.proj.bias)
    integers = torch.randint(0, 256, image.shape).float()
    assert torch.equal(temporal.forward_clip(_repeated(integers))[0], flat(integers)[0])


def test_a_trained_kernel_acts_on_images_as_its_sum_over_time():
    torch.manual_seed(0)
    temporal = TemporalPatchEmbed(P, C, D, temporal_patch_size=T)  # frames differ
    image = torch.randn(1, C, 2 * P, 2 * P)
    # measured 4.8e-7 (5 seeds)
    torch.testing.assert_close(temporal(image)[0], temporal.forward_clip(_repeated(image))[0],
                               rtol=0, atol=2e-6)
    flat = PatchEmbed(P, C, D, bias=False)
    with torch.no_grad():
        flat.proj.weight.copy_(temporal.proj.weight.sum(dim=2))
    assert torch.equal(temporal(image)[0], flat(image)[0])


def _qwen_patches(clip):
    """A clip `[1, C, frames, H, W]` as Qwen2-VL's processor flattens it: one row per tube
    `(C, T, P, P)`, tubes by time then row-major (merge size 1)."""
    _, channels, frames, height, width = clip.shape
    tubes = clip[0].reshape(channels, frames // T, T, height // P, P, width // P, P)
    return tubes.permute(1, 3, 5, 0, 2, 4, 6).reshape(-1, channels * T * P * P)


def test_matches_qwen2_vl_patch_embed_on_the_same_weights():
    from transformers.models.qwen2_vl.modeling_qwen2_vl import PatchEmbed as QwenPatchEmbed

    torch.manual_seed(0)
    theirs = QwenPatchEmbed(patch_size=P, temporal_patch_size=T, in_channels=C, embed_dim=D)
    ours = TemporalPatchEmbed(P, C, D, temporal_patch_size=T)
    ours.load_state_dict(theirs.state_dict())  # the same name: proj.weight
    clip = torch.randn(1, C, 4, 3 * P, 2 * P)
    tokens, grid = ours.forward_clip(clip)
    assert grid == (2, 3, 2)
    # measured 0: the same Conv3d on the same tubes
    torch.testing.assert_close(tokens[0], theirs(_qwen_patches(clip)), rtol=0, atol=1e-6)
    image = torch.randn(1, C, 3 * P, 2 * P)  # an image, as Qwen2-VL's processor repeats it
    torch.testing.assert_close(ours(image)[0][0], theirs(_qwen_patches(_repeated(image))),
                               rtol=0, atol=2e-6)  # measured 4.8e-7


def test_bad_inputs_are_refused():
    temporal = TemporalPatchEmbed(P, C, D, temporal_patch_size=T)
    with pytest.raises(ValueError, match=r"3 frames is not a multiple of the temporal patch"):
        temporal.forward_clip(torch.randn(1, C, 3, P, P))
    with pytest.raises(ValueError, match=r"image size 5x4 is not a positive multiple"):
        temporal(torch.randn(1, C, 5, 4))
    with pytest.raises(ValueError, match=r"a clip must be \[B, 3, frames, H, W\]"):
        temporal.forward_clip(torch.randn(1, C, P, P))
