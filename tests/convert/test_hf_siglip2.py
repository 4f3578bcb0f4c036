"""Hugging Face SigLIP 2: NaFlex `Siglip2VisionModel` directories load to the same function as
transformers' model (our packed tokens against its padded batch on the valid tokens, every
hidden state, and its MAP head as our `attention_pool`), for three aspect ratios sized by
transformers' own processor at two budgets; the fixed-resolution SigLIP 2 shape (a
`SiglipVisionModel`, patch 16 at 256) is read by `hf_siglip`."""

import json

import pytest
import torch

from vlm_vit import load_encoder, load_processor, load_tower
from vlm_vit.convert import detect_format
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.processor.geometry import naflex_size
from vlm_vit.testing import perturbed

transformers = pytest.importorskip("transformers")

ATOL = 1e-5  # measured (sdpa and eager): tokens 3e-6, embeddings 3e-7, pooled 9e-7
PATCH = 8
# An 8 x 8 position grid: budget 32 shrinks it (antialiasing matters), 160 enlarges it.
TINY_VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=48, patch_size=PATCH, num_patches=64)
TINY_TEXT = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=32, vocab_size=100)
BUDGETS = (32, 160)
IMAGE_SIZES = [(300, 300), (300, 400), (180, 320)]  # 1:1, 3:4, 16:9 (height, width)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Siglip2VisionModel(transformers.Siglip2VisionConfig(**TINY_VISION))
    model = perturbed(model)
    directory = tmp_path_factory.mktemp("siglip2")
    model.save_pretrained(directory)
    return directory, model


def their_inputs(budget):
    """Random RGB images at `IMAGE_SIZES` through transformers' NaFlex processor."""
    generator = torch.Generator().manual_seed(7)
    images = [torch.randint(0, 256, (3, h, w), generator=generator, dtype=torch.uint8)
              for h, w in IMAGE_SIZES]
    processor = transformers.Siglip2ImageProcessor(patch_size=PATCH, max_num_patches=budget)
    return processor(images=images, return_tensors="pt")


def unpatchify(patches, grid):
    """transformers' `[rows * cols, P * P * C]` patches, each flattened (row, column,
    channel), back to the `[C, H, W]` image they came from."""
    rows, cols = grid
    return patches[:rows * cols].reshape(rows, cols, PATCH, PATCH, 3) \
        .permute(4, 0, 2, 1, 3).reshape(3, rows * PATCH, cols * PATCH)


@pytest.mark.parametrize("budget", BUDGETS)
def test_packed_tokens_and_pooled_output_match_transformers(saved, budget):
    directory, model = saved
    assert detect_format(read_checkpoint(directory)).name == "hf_siglip2"
    inputs = their_inputs(budget)
    grids = [tuple(int(s) for s in shape) for shape in inputs.spatial_shapes]
    for (height, width), (rows, cols) in zip(IMAGE_SIZES, grids, strict=True):
        assert naflex_size(height, width, patch=PATCH, max_num_patches=budget) == \
            (rows * PATCH, cols * PATCH)
    images = [unpatchify(p, g) for p, g in zip(inputs.pixel_values, grids, strict=True)]
    encoder, tower = load_encoder(directory).eval(), load_tower(directory).eval()
    with torch.no_grad():
        theirs = model(**inputs, output_hidden_states=True)
        ours = encoder(images, output_hidden_states=True)
        pooled = tower(images)
    assert ours.grids == tuple(grids)
    for index, (part, length) in enumerate(zip(ours.tokens.split(list(ours.lengths)),
                                               ours.lengths, strict=True)):
        torch.testing.assert_close(part, theirs.last_hidden_state[index, :length],
                                   atol=ATOL, rtol=0)
        for mine, reference in zip(ours.hidden_states, theirs.hidden_states, strict=True):
            torch.testing.assert_close(mine.split(list(ours.lengths))[index],
                                       reference[index, :length], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.stack(pooled), theirs.pooler_output, atol=ATOL, rtol=0)


def test_the_architecture_and_processor_read(saved):
    directory, _ = saved
    config = load_encoder(directory).config
    assert (config.pos_resize_mode, config.pos_resize_antialias) == ("bilinear", True)
    assert (config.image_size, config.patch_size, config.grid) == ((64, 64), PATCH, (8, 8))
    assert not config.class_token and not config.pre_norm and config.final_norm
    assert load_tower(directory).pooler.pooler_spec["name"] == "attention_pool"
    transformers.Siglip2ImageProcessor(patch_size=PATCH, max_num_patches=160) \
        .save_pretrained(directory)
    processor = load_processor(directory)
    assert (processor.resize_mode, processor.patch_multiple, processor.max_num_patches) == \
        ("native", PATCH, 160)
    assert (processor.resample, processor.mean, processor.std) == \
        ("bilinear", (0.5,) * 3, (0.5,) * 3)


def test_siglip2_model_drops_the_text_tower(tmp_path, saved):
    _, vision_model = saved
    config = transformers.Siglip2Config(text_config=TINY_TEXT, vision_config=TINY_VISION)
    model = transformers.Siglip2Model(config)
    model.vision_model.load_state_dict(vision_model.state_dict())
    model.save_pretrained(tmp_path)
    images = [torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(2))]
    ours, reference = load_tower(tmp_path).eval(), load_tower(saved[0]).eval()
    with torch.no_grad():
        assert torch.equal(ours(images)[0], reference(images)[0])


def test_a_non_square_position_table_is_refused(tmp_path):
    transformers.Siglip2VisionModel(transformers.Siglip2VisionConfig(**TINY_VISION)) \
        .save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_patches": 48}))
    with pytest.raises(ValueError, match=r"config.json: num_patches must be a positive square "
                                         r"\(the position table is a square grid\), got 48"):
        load_encoder(tmp_path)


def test_fixed_resolution_siglip2_is_a_siglip_vision_model(tmp_path):
    # google/siglip2-base-patch16-256's shape at tiny width: SiglipVisionModel, patch 16 at
    # 256 (a 16 x 16 grid), SiglipImageProcessor resizing to 256 x 256 bilinearly.
    config = transformers.SiglipVisionConfig(hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=48,
                                             image_size=256, patch_size=16)
    model = perturbed(transformers.SiglipVisionModel(config))
    model.save_pretrained(tmp_path)
    transformers.SiglipImageProcessor(size={"height": 256, "width": 256}, resample=2) \
        .save_pretrained(tmp_path)
    assert detect_format(read_checkpoint(tmp_path)).name == "hf_siglip"
    x = torch.randn(2, 3, 256, 256, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = model(pixel_values=x)
        tokens = load_encoder(tmp_path).eval()(x).tokens
        pooled = load_tower(tmp_path).eval()(x)
    torch.testing.assert_close(tokens, theirs.last_hidden_state, atol=ATOL, rtol=0)
    torch.testing.assert_close(pooled, theirs.pooler_output, atol=ATOL, rtol=0)
    processor = load_processor(tmp_path)
    assert (processor.size, processor.resize_mode, processor.resample) == \
        ((256, 256), "squash", "bilinear")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_our_position_resize_is_siglip2s_on_many_grids(dtype):
    # The encoder's resize (bilinear, antialiased, float32 inside, cast back) against
    # Siglip2VisionEmbeddings.resize_positional_embeddings, shrinking and enlarging a 16 x 16
    # table along either axis or both, strips included.
    from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionEmbeddings

    from vlm_vit.layers.pos_embed import resample_pos_embed

    table = torch.randn(16, 16, 24, generator=torch.Generator().manual_seed(5)).to(dtype)
    grids = [(1, 1), (1, 256), (256, 1), (3, 5), (5, 3), (7, 16), (16, 7), (16, 16), (9, 28),
             (17, 15), (31, 33), (64, 4), (12, 21), (24, 42)]
    for rows, cols in grids:
        theirs = Siglip2VisionEmbeddings.resize_positional_embeddings(
            table, torch.tensor([[rows, cols]]), max_length=rows * cols)[0]
        ours = resample_pos_embed(table.reshape(1, 256, 24), (16, 16), (rows, cols),
                                  mode="bilinear", antialias=True)[0]
        assert ours.dtype == dtype
        # measured: float32 within 4.8e-7 (the sums' order); bfloat16 one rounding step apart
        tolerance = 2e-6 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(ours.float(), theirs.float(), atol=tolerance, rtol=tolerance)
