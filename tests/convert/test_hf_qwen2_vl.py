"""Hugging Face `Qwen2VisionTransformerPretrainedModel` directories (Qwen2-VL's vision tower)
load to the same function as transformers' own model, fed the same pixels: every hidden
state within 1e-5 (theirs in merge-window order, ours row-major) and the 2x2 merger's output
through our `patch_merger` pooler, on a square and a non-square image and a 2-frame clip."""

import pytest
import torch

from vlm_vit import load_encoder, load_tower
from vlm_vit.convert import detect_format
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.layers.rope_2d import merge_window_order
from vlm_vit.testing import perturbed

transformers = pytest.importorskip("transformers")

P, T, MERGE = 4, 2, 2
TINY = dict(depth=2, embed_dim=32, hidden_size=48, num_heads=4, patch_size=P,
            temporal_patch_size=T, spatial_merge_size=MERGE)
SIZES = [(16, 16), (8, 24)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    torch.manual_seed(0)
    model = perturbed(Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(**TINY)))
    directory = tmp_path_factory.mktemp("qwen2_vl")
    model.save_pretrained(directory)
    return directory, model.eval()


def flattened(clip):
    """A clip `[C, frames, H, W]` as Qwen2-VL's processor flattens it: one row per tube
    `(C, T, P, P)`, in merge-window order (`Qwen2VLImageProcessor._preprocess`); and
    grid_thw."""
    channels, frames, height, width = clip.shape
    t, rows, cols = frames // T, height // P, width // P
    tubes = clip.reshape(channels, t, T, rows // MERGE, MERGE, P, cols // MERGE, MERGE, P)
    # (t, window row, window col, row in window, col in window, C, T, P, P)
    tubes = tubes.permute(1, 3, 6, 4, 7, 0, 2, 5, 8)
    return tubes.reshape(t * rows * cols, channels * T * P * P), torch.tensor([[t, rows, cols]])


@pytest.mark.parametrize("size", SIZES)
def test_every_hidden_state_and_the_merger_match_on_an_image(saved, size):
    directory, model = saved
    assert detect_format(read_checkpoint(directory)).name == "hf_qwen2_vl"
    tower = load_tower(directory)
    ours = tower.encoder.eval()
    image = torch.randn(3, *size, generator=torch.Generator().manual_seed(3))
    # Qwen2-VL's processor repeats an image to fill the temporal patch
    patches, grid_thw = flattened(image[:, None].expand(-1, T, -1, -1))
    with torch.no_grad():
        out = ours(image[None], output_hidden_states=True)
        theirs = model(patches, grid_thw=grid_thw, output_hidden_states=True)
        pooled = tower.pooler(out.tokens, num_prefix_tokens=0, grid=out.grid)
    order = merge_window_order(out.grid, MERGE)  # their token i is our row-major token order[i]
    assert len(out.hidden_states) == len(theirs.hidden_states) == TINY["depth"] + 1
    for ours_state, their_state in zip(out.hidden_states, theirs.hidden_states, strict=True):
        # image: the Conv3d as its kernel summed over time (measured up to 1e-6 at layer 0)
        torch.testing.assert_close(ours_state[0, order], their_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.tokens[0, order], theirs.last_hidden_state,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled[0], theirs.pooler_output, atol=1e-5, rtol=1e-5)
    assert tower.pooler.num_output_tokens(out.grid) == theirs.pooler_output.shape[0]


def test_a_two_frame_clip_matches_through_the_patch_embedding(saved):
    # The encoder's forward takes images; a clip's tubes go through the same Conv3d
    # (`forward_clip`) and then the same blocks.
    directory, model = saved
    ours = load_encoder(directory).eval()
    clip = torch.randn(3, T, 8, 16, generator=torch.Generator().manual_seed(5))
    patches, grid_thw = flattened(clip)
    with torch.no_grad():
        tokens, (t, *grid) = ours.patch_embed.forward_clip(clip[None])
        assert t == 1
        run = ours.run_blocks(tokens, output_hidden_states=True, grids=[tuple(grid)])
        theirs = model(patches, grid_thw=grid_thw, output_hidden_states=True)
    order = merge_window_order(tuple(grid), MERGE)
    for ours_state, their_state in zip(run.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(ours_state[0, order], their_state, atol=1e-5, rtol=1e-5)


def test_the_architecture_read(saved):
    directory, _ = saved
    config = load_encoder(directory).config
    assert config.temporal_patch_size == T and config.pos_embed == "none"
    assert (config.rope_theta, config.rope_frequencies) == (10000.0, "shared")
    assert (config.act, config.mlp_width) == ("quick_gelu", 128)
    assert not config.class_token and not config.final_norm and not config.patch_bias
    tower = load_tower(directory)
    assert tower.pooler.pooler_spec["name"] == "patch_merger"
    assert tower.pooler.out_dim == TINY["hidden_size"]


def test_the_merger_refuses_an_odd_grid(saved):
    directory, _ = saved
    tower = load_tower(directory)
    with torch.no_grad(), pytest.raises(ValueError, match=r"patch grid 3x4 is not divisible "
                                                          r"into 2x2 merge windows"):
        tower.pooler(torch.zeros(1, 12, 32), num_prefix_tokens=0, grid=(3, 4))


def test_a_clip_in_the_packed_call_matches_every_hidden_state(saved):
    # encoder([clip, image]): 3 frames padded to 4 by repeating the last (Qwen2-VL's
    # processor), two temporal slices, attention within each slice, as transformers' tower.
    directory, model = saved
    ours = load_encoder(directory).eval()
    clip = torch.randn(3, 3, 8, 16, generator=torch.Generator().manual_seed(7))  # [F, C, H, W]
    image = torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(8))
    padded = torch.cat([clip, clip[-1:]]).transpose(0, 1)  # [C, 4, H, W]
    patches, grid_thw = flattened(padded)
    with torch.no_grad():
        out = ours([clip, image], output_hidden_states=True)
        theirs = model(patches, grid_thw=grid_thw, output_hidden_states=True)
        alone = ours(image[None]).tokens[0]
    assert out.frames == (2, 1) and out.grids == ((2, 4), (2, 4), (4, 2))
    assert out.lengths == (8, 8, 8)
    order = torch.cat([merge_window_order((2, 4), MERGE), 8 + merge_window_order((2, 4), MERGE)])
    for ours_state, their_state in zip(out.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(ours_state[:16][order], their_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.tokens[16:], alone, atol=1e-5, rtol=1e-5)


def test_a_clip_is_refused_by_an_encoder_without_temporal_patches():
    from vlm_vit import EncoderConfig, VisionEncoder

    encoder = VisionEncoder(EncoderConfig(image_size=16, patch_size=4, width=16, depth=1,
                                          heads=2, mlp_width=32))
    with pytest.raises(ValueError, match=r"image 0 must be a \[C, H, W\] tensor, got \[2, 3, "
                                         r"16, 16\] \(a \[frames, C, H, W\] clip needs an "
                                         r"encoder with a temporal patch embedding"):
        encoder([torch.zeros(2, 3, 16, 16)])


def test_the_tower_merges_a_clip_as_transformers_and_counts_its_tokens(saved):
    directory, model = saved
    tower = load_tower(directory).eval()
    clip = torch.randn(3, 3, 8, 16, generator=torch.Generator().manual_seed(7))  # 3 frames
    image = torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(8))
    patches, grid_thw = flattened(torch.cat([clip, clip[-1:]]).transpose(0, 1))
    with torch.no_grad():
        clip_tokens, image_tokens = tower([clip, image])
        theirs = model(patches, grid_thw=grid_thw).pooler_output  # both slices, merged
        alone = tower(image[None])[0]
    torch.testing.assert_close(clip_tokens, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(image_tokens, alone, atol=1e-5, rtol=1e-5)
    # 8x16 pixels: a 2x4 patch grid, 2 merged tokens per temporal slice
    assert tower.num_image_tokens((8, 16), frames=3) == clip_tokens.shape[0] == 2 * 2
    assert tower.num_image_tokens((8, 16), frames=4) == 4
    assert tower.num_image_tokens((8, 16), frames=5) == 6
    assert tower.num_image_tokens((16, 8)) == image_tokens.shape[0] == 2
    with pytest.raises(ValueError, match="a clip of 0 frames needs a positive frame count"):
        tower.num_image_tokens((8, 16), frames=0)
