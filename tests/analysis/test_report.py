import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.analysis import analyze, image_attention
from vlm_vit.processor import ImageProcessor

from ..conftest import tiny_config


@pytest.fixture(scope="module")
def photos():
    """Three real photographs from scikit-image, as uint8 arrays."""
    from skimage import data

    return [data.astronaut(), data.coffee(), data.chelsea()]


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    return VisionEncoder(tiny_config(depth=2, num_register_tokens=2)).eval()


def test_three_images_average_the_distances_of_each_alone(encoder, photos, tmp_path):
    processor = ImageProcessor.for_family("imagenet", size=32)
    together = analyze(encoder, photos, tmp_path / "all", processor, draw=False)
    alone = [analyze(encoder, [photo], tmp_path / str(i), processor, draw=False)
             for i, photo in enumerate(photos)]
    for key in ("mean_attention_distance", "prefix_attention"):
        average = np.mean([np.array(result[key]) for result in alone], axis=0)
        assert np.allclose(together[key], average, atol=1e-5)
    maps = [entry["map"] for entry in together["attention_rollout"]["maps"]]
    assert maps == [result["attention_rollout"]["maps"][0]["map"] for result in alone]
    assert together["figures"] == [] and (tmp_path / "all" / "analysis.json").is_file()


def test_the_encoder_only_ever_sees_one_image(encoder, photos, tmp_path):
    seen = []
    def record(module, args, kwargs, output):
        seen.append((args[0].shape[0], output.attentions[0].shape[0]))
    handle = encoder.register_forward_hook(record, with_kwargs=True)
    try:
        batch = torch.rand(2, 3, 32, 32)  # a batch tensor counts as two images
        result = analyze(encoder, [*photos, batch], tmp_path, draw=False)
    finally:
        handle.remove()
    assert seen == [(1, 1)] * 5  # pixels and attention maps: batch 1, once per image
    assert result["images"] == ["images[0]", "images[1]", "images[2]", "images[3][0]",
                                "images[3][1]"]


def test_image_attention_matches_a_batch_of_one_through_the_fast_path(encoder):
    """The explicit-softmax maps `output_attentions` returns, times each block's values and
    through its projection, give what the SDPA kernel gives; and the tokens are unchanged."""
    pixels = torch.randn(1, 3, 32, 32)
    inputs = []  # each block's input tokens, from the maps' run
    hooks = [block.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
             for block in encoder.blocks]
    with torch.inference_mode():
        explicit = encoder(pixels, output_attentions=True)
        for hook in hooks:
            hook.remove()
        fast = encoder(pixels)
        torch.testing.assert_close(explicit.tokens, fast.tokens, rtol=0, atol=1e-5)
        assert len(explicit.attentions) == len(inputs) == len(encoder.blocks)
        for block, x, maps in zip(encoder.blocks, inputs, explicit.attentions, strict=True):
            attention = block.attn
            h = block.norm1(x)
            batch, tokens, width = h.shape
            v = attention.qkv(h).reshape(batch, tokens, 3, attention.heads,
                                         attention.head_dim)[:, :, 2].transpose(1, 2)
            from_maps = attention.proj((maps @ v).transpose(1, 2).reshape(batch, tokens, width))
            sdpa, none = attention(h)  # need_weights=False: F.scaled_dot_product_attention
            assert none is None
            torch.testing.assert_close(from_maps, sdpa, rtol=0, atol=1e-5)
            torch.testing.assert_close(maps.sum(-1), torch.ones_like(maps[..., 0]))
    item = image_attention(encoder, pixels)
    assert item.distance.shape == (2, 4) and item.prefix_share.shape == (2, 4)
    assert item.rollout.shape == (4, 4) and item.grid == (4, 4)
    assert (item.prefix_share > 0).all()  # the class token and registers draw some weight
    with pytest.raises(ValueError, match=r"one image \[1, C, H, W\], got \[2, 3, 32, 32\]"):
        image_attention(encoder, torch.randn(2, 3, 32, 32))


def test_no_images_is_an_error(encoder, tmp_path):
    with pytest.raises(ValueError, match="at least one image"):
        analyze(encoder, [], tmp_path)


def test_a_one_channel_encoder_without_class_token_is_analysed(tmp_path):
    torch.manual_seed(0)
    grey = VisionEncoder(EncoderConfig(image_size=16, patch_size=8, width=16, depth=1, heads=2,
                                       mlp_width=32, in_channels=1, class_token=False))
    item = image_attention(grey, torch.rand(1, 1, 16, 16))  # pixels as the encoder takes them
    assert item.rollout.shape == (2, 2) and (item.prefix_share == 0).all()
    from vlm_vit.analysis.figures import plot_embedding_filters

    components = np.random.default_rng(0).random((4, 1, 8, 8))  # drawn as grey pictures
    path = plot_embedding_filters(components, tmp_path / "filters.png")
    assert Image.open(path).size == (700, 450)


def test_importing_the_analysis_does_not_import_matplotlib():
    code = ("import sys, vlm_vit.analysis, vlm_vit.cli.analyze; "
            "print('matplotlib' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "False\n"


@pytest.mark.parametrize("mechanism", ["rope", "hybrid", "qwen2_vl"])
def test_towers_without_a_table_or_an_rgb_patch_convolution_are_analysed(mechanism, photos,
                                                                         tmp_path):
    """A RoPE tower has no position table to compare, a hybrid's and a video tower's patch
    embedding is no RGB filter bank: those parts are null, the rest is measured."""
    from tests.test_mechanisms import encoder_for

    encoder = encoder_for(mechanism).eval()
    result = analyze(encoder, photos[:1], tmp_path, draw=False)
    assert (result["position_similarity"] is None) == (encoder.pos_embed is None)
    assert (result["embedding_filters"] is None) == (mechanism != "rope")
    assert len(result["mean_attention_distance"]) == encoder.config.depth
