"""Hugging Face `Qwen2_5_VisionTransformerPretrainedModel` directories (Qwen2.5-VL's vision
tower: RMSNorm, SwiGLU with biases, window attention but in `fullatt_block_indexes`, 2D
RoPE, Conv3d patches, an RMSNorm merger) load to the same function as transformers' own
model, fed the same pixels: every hidden state within 1e-5 (theirs in window order, ours
row-major) and the merger's output, on a square and a non-square image whose windows are cut
at the edges, and on two images in one packed call."""

import pytest
import torch

from vlm_vit import load_encoder, load_tower
from vlm_vit.config import ConfigError
from vlm_vit.convert import detect_format
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.layers.window_segments import window_partition
from vlm_vit.testing import perturbed

from .test_hf_qwen2_vl import MERGE, P, T, flattened

transformers = pytest.importorskip("transformers")

WINDOW = 4  # patches: window_size 16 pixels = 2 merge units of 2 patches of 4 pixels
TINY = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=40, num_heads=4,
            patch_size=P, temporal_patch_size=T, spatial_merge_size=MERGE,
            window_size=WINDOW * P, fullatt_block_indexes=[1])
SIZES = [(24, 24), (16, 40)]  # 6x6 and 4x10 patches: windows of 16, 8 and 4 tokens


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    torch.manual_seed(0)
    model = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**TINY))
    model = perturbed(model)
    directory = tmp_path_factory.mktemp("qwen2_5_vl")
    model.save_pretrained(directory)
    return directory, model.eval()


def their_outputs(model, images):
    """transformers' outputs for `[C, H, W]` images, each repeated over the temporal patch."""
    parts = [flattened(image[:, None].expand(-1, T, -1, -1)) for image in images]
    patches = torch.cat([p for p, _ in parts])
    grid_thw = torch.cat([g for _, g in parts])
    return model(patches, grid_thw=grid_thw, output_hidden_states=True)


@pytest.mark.parametrize("size", SIZES)
def test_every_hidden_state_and_the_merger_match_on_an_image(saved, size):
    directory, model = saved
    assert detect_format(read_checkpoint(directory)).name == "hf_qwen2_5_vl"
    tower = load_tower(directory)
    ours = tower.encoder.eval()
    image = torch.randn(3, *size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = ours(image[None], output_hidden_states=True)
        theirs = their_outputs(model, [image])
        pooled = tower.pooler(out.tokens, num_prefix_tokens=0, grid=out.grid)
    # their token i is our row-major token order[i]
    order = window_partition(out.grid, WINDOW, MERGE).order
    assert len(out.hidden_states) == len(theirs.hidden_states) == TINY["depth"] + 1
    for ours_state, their_state in zip(out.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(ours_state[0, order], their_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.tokens[0, order], theirs.last_hidden_state,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled[0], theirs.pooler_output, atol=1e-5, rtol=1e-5)


def test_two_images_in_one_call_match_their_packed_call(saved):
    directory, model = saved
    ours = load_encoder(directory).eval()
    generator = torch.Generator().manual_seed(4)
    images = [torch.randn(3, *size, generator=generator) for size in SIZES]
    with torch.no_grad():
        packed = ours(images, output_hidden_states=True)
        theirs = their_outputs(model, images)
    grids, offset, order = packed.grids, 0, []
    for grid in grids:  # their window order, image after image
        order.append(window_partition(grid, WINDOW, MERGE).order + offset)
        offset += grid[0] * grid[1]
    order = torch.cat(order)
    for ours_state, their_state in zip(packed.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(ours_state[order], their_state, atol=1e-5, rtol=1e-5)


def test_the_architecture_read(saved):
    directory, _ = saved
    config = load_encoder(directory).config
    assert (config.window_size, config.full_attention_blocks) == (WINDOW, (1,))
    assert (config.norm, config.mlp, config.act) == ("rmsnorm", "swiglu", "silu")
    assert (config.mlp_width, config.temporal_patch_size, config.pos_embed) == (48, T, "none")
    assert not config.class_token and not config.final_norm and not config.patch_bias
    tower = load_tower(directory)
    assert tower.pooler.pooler_spec["options"] == {"merge_size": MERGE, "norm": "rmsnorm"}
    assert tower.pooler.out_dim == TINY["out_hidden_size"]


@pytest.mark.parametrize("pixels", [12, 0, 6])
def test_a_window_of_no_whole_merge_units_is_refused(pixels):
    from vlm_vit.convert.hf_qwen2_5_vl import encoder_config

    with pytest.raises(ConfigError, match=rf"config.json: window_size {pixels} pixels is not a "
                                          rf"positive multiple of patch_size 4 x "
                                          rf"spatial_merge_size 2"):
        encoder_config({**TINY, "window_size": pixels})
