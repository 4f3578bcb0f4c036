"""AnyRes tiling (`vlm_vit.processor.anyres`): the canvas choice and the token counts equal
transformers' on hundreds of sizes, the pixels equal their LLaVA-NeXT and OneVision image
processors', the setting survives `processor_config.json`, and bad settings and sizes are
refused one error each."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_vit.processor import NORMALIZATION, PROCESSOR_CONFIG_NAME, ImageProcessor, Tiling
from vlm_vit.processor.anyres import (
    MAX_TILES,
    best_resolution,
    num_image_tokens,
    num_views,
    pack_features,
)

transformers = pytest.importorskip("transformers")

PIXEL_ATOL = 1e-5
NEXT = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]  # llava-v1.6's
ONEVISION = [[h, w] for h in range(384, 2305, 384) for w in range(384, 2305, 384)]
TINY = [[32, 64], [64, 32], [64, 64]]
SIZES = [(950, 1256), (1256, 950), (700, 840), (640, 427), (427, 640), (1, 300), (300, 1),
         (1, 1), (2, 3), (33, 97), (97, 33), (335, 673), (1009, 337), (4000, 3)]


def many_sizes():
    rng = np.random.default_rng(0)
    random = [tuple(int(side) for side in pair) for pair in rng.integers(1, 3000, (150, 2))]
    return SIZES + random + [(h, h * 7 + 1) for h in (1, 5, 48, 49)]


def image(height, width):
    pixels = np.random.default_rng(height * 7919 + width).integers(0, 256, (height, width, 3))
    return Image.fromarray(pixels.astype(np.uint8))


def clip_processor(tiling):
    mean, std = NORMALIZATION["clip"]
    return ImageProcessor(size=tiling.tile_size, mean=mean, std=std, tiling=tiling)


def test_the_canvas_is_transformers_choice():
    from transformers.image_processing_utils import select_best_resolution
    for pinpoints, tile in [(NEXT, 336), (ONEVISION, 384), (TINY, 32)]:
        tiling = Tiling(pinpoints=pinpoints, tile_size=tile)
        for size in many_sizes():
            assert best_resolution(tiling, size) == select_best_resolution(size, pinpoints), size


def test_token_counts_are_their_processors_counts():
    """LLaVA-NeXT (CLIP-L/14-336: 24 x 24 per tile, the CLS dropped) and OneVision
    (SigLIP-384/14: 27 x 27, anyres_max_9) as their processors count them."""
    next_counter = object.__new__(transformers.LlavaNextProcessor)
    next_counter.image_processor = transformers.LlavaNextImageProcessorPil(
        image_grid_pinpoints=NEXT)
    next_counter.patch_size, next_counter.num_additional_image_tokens = 14, 1
    onevision_counter = object.__new__(transformers.LlavaOnevisionProcessor)
    onevision_counter.image_processor = transformers.LlavaOnevisionImageProcessorPil()
    onevision_counter.num_image_tokens, onevision_counter.vision_aspect_ratio = 729, "anyres_max_9"
    llava_next = Tiling(pinpoints=NEXT, tile_size=336)
    onevision = Tiling(pinpoints=ONEVISION, tile_size=384, max_feature_tiles=9)
    for size in many_sizes():
        assert num_image_tokens(llava_next, size, 24) == \
            next_counter._get_number_of_features(*size, 336, 336) - 1, size
        assert num_image_tokens(onevision, size, 27) == \
            onevision_counter._get_number_of_features(*size, 384, 384), size


@pytest.mark.parametrize("family", ["llava_next", "onevision"])
def test_pixels_are_their_image_processors(family):
    """Their PIL image processors (transformers 5's slow ones), on CLIP's mean and std."""
    if family == "llava_next":
        theirs = transformers.LlavaNextImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
            image_grid_pinpoints=TINY + [[32, 320], [320, 32]])
    else:
        theirs = transformers.LlavaOnevisionImageProcessorPil(
            size={"height": 32, "width": 32}, image_grid_pinpoints=TINY + [[96, 96]],
            image_mean=NORMALIZATION["clip"][0], image_std=NORMALIZATION["clip"][1])
    tiling = Tiling(pinpoints=theirs.image_grid_pinpoints, tile_size=32)
    images = [image(*size) for size in SIZES]
    ours, sizes = clip_processor(tiling).tile(images)
    assert sizes == SIZES
    for size, mine, picture in zip(SIZES, ours, images, strict=True):
        reference = theirs(picture, return_tensors="pt", do_pad=False).pixel_values[0]
        assert mine.shape == (num_views(tiling, size), 3, 32, 32) == reference.shape
        torch.testing.assert_close(mine, reference, atol=PIXEL_ATOL, rtol=0)


def test_float_images_are_tiled_like_uint8_ones():
    tiling = Tiling(pinpoints=TINY, tile_size=32)
    picture = image(40, 90)
    as_float = torch.from_numpy(np.array(picture)).permute(2, 0, 1).float() / 255
    (from_uint8,), _ = clip_processor(tiling).tile([picture])
    (from_float,), sizes = clip_processor(tiling).tile([as_float])
    assert sizes == [(40, 90)] and from_float.shape == from_uint8.shape == (3, 3, 32, 32)
    assert (from_float - from_uint8).abs().mean() < 0.05  # antialiased vs PIL bicubic


def test_the_tiling_survives_processor_config(tmp_path):
    tiling = Tiling(pinpoints=[(32, 64), [64, 32]], tile_size=32, newline=False,
                    max_feature_tiles=4)
    processor = clip_processor(tiling)
    processor.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / PROCESSOR_CONFIG_NAME).read_text())["tiling"]
    assert saved == {"pinpoints": [[32, 64], [64, 32]], "tile_size": 32, "base_image": True,
                     "newline": False, "max_feature_tiles": 4}
    loaded = ImageProcessor.from_pretrained(tmp_path)
    assert loaded == processor and loaded.tiling == tiling
    assert loaded.tiling.pinpoints == ((32, 64), (64, 32))
    assert ImageProcessor.from_dict(ImageProcessor().to_dict()).tiling is None
    (tmp_path / PROCESSOR_CONFIG_NAME).write_text(json.dumps(
        {**processor.to_dict(), "tiling": {**saved, "pinpoints": [[32, 48]]}}))
    with pytest.raises(ValueError, match=rf"{PROCESSOR_CONFIG_NAME}: tiling pinpoint \(32, 48\)"):
        ImageProcessor.from_pretrained(tmp_path)


def test_a_call_returns_each_images_views():
    tiling = Tiling(pinpoints=TINY, tile_size=32, base_image=False)
    out = clip_processor(tiling)([image(64, 64), image(10, 10)])
    assert [views.shape for views in out] == [(4, 3, 32, 32), (2, 3, 32, 32)]
    with pytest.raises(ValueError, match="tile\\(\\) needs a processor with tiling"):
        ImageProcessor().tile([image(10, 10)])


def test_features_are_packed_base_first_then_rows_with_newlines():
    """A 64 x 64 canvas of 2 x 2 tiles, 2 x 2 tokens each, holding a 64 x 32 image: the grid
    is 4 x 4, its left and right quarters padding; each kept row ends with the newline."""
    tiling = Tiling(pinpoints=[(64, 64)], tile_size=32)
    tokens = torch.arange(5 * 4, dtype=torch.float32).reshape(5, 4, 1)  # view v, token i: 4v + i
    newline = torch.tensor([-1.0])
    packed = pack_features(tokens, tiling, (64, 32), newline)[:, 0].tolist()
    assert packed[:4] == [0, 1, 2, 3]  # the base view
    # tiles 1 2 / 3 4; grid row 0 = tile 1 row 0, tile 2 row 0: 4 5 | 8 9; keep columns 1..2
    assert packed[4:] == [5, 8, -1, 7, 10, -1, 13, 16, -1, 15, 18, -1]
    assert len(packed) == num_image_tokens(tiling, (64, 32), 2)
    with pytest.raises(ValueError, match="newline"):
        pack_features(tokens, tiling, (64, 32))
    with pytest.raises(ValueError, match=r"do not fit an image of size \(64, 32\): 2x2 tiles"):
        pack_features(tokens[:4], tiling, (64, 32), newline)


@pytest.mark.parametrize(("settings", "match"), [
    (dict(pinpoints=[], tile_size=32), "pinpoints must be a non-empty list"),
    (dict(pinpoints=[[32, 48]], tile_size=32), r"\(32, 48\) is not a multiple of the tile size 32"),
    (dict(pinpoints=[[32, 32 * (MAX_TILES + 1)]], tile_size=32),
     rf"needs {MAX_TILES + 1} tiles of 32x32, more than the budget of {MAX_TILES}"),
    (dict(pinpoints=[[32, -32]], tile_size=32), "not a \\(height, width\\) pair of positive"),
    (dict(pinpoints=[[32, 32]], tile_size=0), "tile_size must be an int"),
    (dict(pinpoints=[[32, 32]], tile_size=32, newline="yes"), "newline must be true or false"),
    (dict(pinpoints=[[32, 32]], tile_size=32, max_feature_tiles=0), "anyres_max_N"),
])
def test_bad_tilings_are_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        Tiling(**settings)


def test_bad_sizes_and_mismatched_processors_are_refused():
    tiling = Tiling(pinpoints=TINY, tile_size=32)
    for size in [(0, 300), (300, 0), (-1, 5), (2.5, 3), (3,)]:
        with pytest.raises(ValueError, match=r"image size .* must be two positive ints to tile "
                                             r"it \(tile_size 32, pinpoints \[\(32, 64\)"):
            num_image_tokens(tiling, size, 4)
    with pytest.raises(ValueError, match=r"needs size \(32, 32\).*got size \(64, 64\)"):
        ImageProcessor(size=64, tiling=tiling)
    with pytest.raises(ValueError, match="resize_mode 'native'"):
        dataclasses.replace(clip_processor(tiling), resize_mode="native", patch_multiple=8)
    with pytest.raises(ValueError, match="tiling has unknown keys \\['pinpoint'\\]"):
        ImageProcessor(size=32, tiling={"pinpoint": TINY, "tile_size": 32})
