"""AnyRes towers (LLaVA-NeXT, LLaVA-OneVision) against transformers' own, on tiny random
models carrying the same weights: token counts (ours, their processor's, their model's) and
the packed features themselves, for awkward sizes, thin strips and odd sides; saving keeps
the tiling and `image_newline`; what a tiled tower refuses."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_vit import ImageProcessor, VisionTower, build_pooler, load_tower
from vlm_vit.processor import NORMALIZATION, Tiling
from vlm_vit.processor.anyres import num_image_tokens, pack_features, tile_grid, unpadded_box

transformers = pytest.importorskip("transformers")

FEATURE_ATOL = 1e-6
TILE, PATCH = 32, 8  # 4 x 4 tokens per tile
NEXT_PINPOINTS = [[32, 64], [64, 32], [64, 64]]
WIDE_PINPOINTS = [*NEXT_PINPOINTS, [32, 320], [320, 32], [96, 96]]  # strips keep their pixels
ONEVISION_PINPOINTS = [[h, w] for h in (32, 64, 96) for w in (32, 64, 96)]
SIZES = [(950, 1256), (1256, 950), (700, 840), (640, 427), (427, 640), (1, 300), (300, 1),
         (33, 97), (31, 17), (97, 33), (5, 5)]
VISION = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
              image_size=TILE, patch_size=PATCH)
TEXT = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            vocab_size=100)


def randomized(model):
    """Every parameter moved off its initial value (unit norms and zero biases hide swaps)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model.eval()


def image(height, width):
    pixels = np.random.default_rng(height * 7919 + width).integers(0, 256, (height, width, 3))
    return Image.fromarray(pixels.astype(np.uint8))


def processor(tiling):
    mean, std = NORMALIZATION["clip"]
    return ImageProcessor(size=tiling.tile_size, mean=mean, std=std, tiling=tiling)


def our_tower(hf, tmp_path, tiling, feature_layer):
    """Our tower on `hf`'s vision weights, projector and `image_newline`."""
    hf.model.vision_tower.save_pretrained(tmp_path)
    loaded = load_tower(tmp_path, "mlp2x_gelu", out_dim=TEXT["hidden_size"],
                        feature_layer=feature_layer)
    tower = VisionTower(loaded.encoder, loaded.pooler, feature_layer=feature_layer,
                        tiling=tiling).eval()
    projector = hf.model.multi_modal_projector
    tower.pooler.load_state_dict({"0.weight": projector.linear_1.weight,
                                  "0.bias": projector.linear_1.bias,
                                  "2.weight": projector.linear_2.weight,
                                  "2.bias": projector.linear_2.bias})
    tower.image_newline.data.copy_(hf.model.image_newline)
    return tower


@pytest.fixture(scope="module")
def llava_next():
    config = transformers.LlavaNextConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION),
        text_config=transformers.LlamaConfig(**TEXT), image_grid_pinpoints=NEXT_PINPOINTS,
        vision_feature_layer=-2, vision_feature_select_strategy="default")
    return randomized(transformers.LlavaNextForConditionalGeneration(config))


@pytest.fixture(scope="module")
def onevision():
    config = transformers.LlavaOnevisionConfig(
        vision_config=transformers.SiglipVisionConfig(**VISION),
        text_config=transformers.Qwen2Config(**TEXT), image_grid_pinpoints=ONEVISION_PINPOINTS,
        vision_feature_layer=-1, vision_feature_select_strategy="full")
    return randomized(transformers.LlavaOnevisionForConditionalGeneration(config))


def their_features(hf, pixel_values, sizes):
    """transformers' packed features for our views (their processor's, as its tests show)."""
    most = max(len(views) for views in pixel_values)
    batch = torch.stack([torch.cat([v, v.new_zeros(most - len(v), *v.shape[1:])])
                         for v in pixel_values])  # their processor's padding to one batch
    with torch.no_grad():
        out = hf.model.get_image_features(pixel_values=batch, image_sizes=torch.tensor(sizes))
    return out.pooler_output


def next_processor_count(hf, size, pinpoints):
    """`LlavaNextProcessor._get_number_of_features`, built without a tokenizer."""
    counter = object.__new__(transformers.LlavaNextProcessor)
    counter.image_processor = transformers.LlavaNextImageProcessorPil(
        image_grid_pinpoints=pinpoints)
    counter.patch_size, counter.num_additional_image_tokens = PATCH, 1
    return counter._get_number_of_features(*size, TILE, TILE) - 1  # "default": no CLS


def onevision_processor_count(size, max_feature_tiles):
    counter = object.__new__(transformers.LlavaOnevisionProcessor)
    counter.image_processor = transformers.LlavaOnevisionImageProcessorPil(
        image_grid_pinpoints=ONEVISION_PINPOINTS)
    counter.num_image_tokens = (TILE // PATCH) ** 2
    counter.vision_aspect_ratio = f"anyres_max_{max_feature_tiles}"
    return counter._get_number_of_features(*size, TILE, TILE)


@pytest.mark.parametrize("pinpoints", [NEXT_PINPOINTS, WIDE_PINPOINTS], ids=["next", "wide"])
def test_llava_next_features_and_counts_match_transformers(llava_next, tmp_path, pinpoints):
    tiling = Tiling(pinpoints=pinpoints, tile_size=TILE)
    tower = our_tower(llava_next, tmp_path, tiling, feature_layer=-2)
    views, sizes = processor(tiling).tile([image(*size) for size in SIZES])
    assert sizes == SIZES
    llava_next.config.image_grid_pinpoints = pinpoints
    try:
        theirs = their_features(llava_next, views, sizes)
    finally:
        llava_next.config.image_grid_pinpoints = NEXT_PINPOINTS
    with torch.no_grad():
        ours = tower(views, image_sizes=sizes)  # every view of every image in one batch
    for size, mine, reference in zip(SIZES, ours, theirs, strict=True):
        count = tower.num_image_tokens(size)
        assert mine.shape == (count, TEXT["hidden_size"])
        assert count == reference.shape[0] == next_processor_count(llava_next, size, pinpoints)
        torch.testing.assert_close(mine, reference, atol=FEATURE_ATOL, rtol=0)


@pytest.mark.parametrize("max_feature_tiles", [1, 4])
def test_onevision_features_and_counts_match_transformers(onevision, tmp_path,
                                                          max_feature_tiles):
    """`anyres_max_N` shrinks grids of more than N tiles' worth (bilinear), as theirs."""
    tiling = Tiling(pinpoints=ONEVISION_PINPOINTS, tile_size=TILE,
                    max_feature_tiles=max_feature_tiles)
    tower = our_tower(onevision, tmp_path, tiling, feature_layer=-1)
    views, sizes = processor(tiling).tile([image(*size) for size in SIZES])
    onevision.config.vision_aspect_ratio = f"anyres_max_{max_feature_tiles}"
    theirs = their_features(onevision, views, sizes)
    with torch.no_grad():
        ours = tower(views, image_sizes=sizes)
    for size, mine, reference in zip(SIZES, ours, theirs, strict=True):
        count = tower.num_image_tokens(size)
        assert count == reference.shape[0] == onevision_processor_count(size, max_feature_tiles)
        torch.testing.assert_close(mine, reference, atol=FEATURE_ATOL, rtol=0)
    unlimited = dataclasses.replace(tiling, max_feature_tiles=None)
    shrunk = [size for size in SIZES
              if tower.num_image_tokens(size) < num_image_tokens(unlimited, size, TILE // PATCH)]
    assert 0 < len(shrunk) < len(SIZES)  # both kinds are compared


def test_saved_tower_keeps_its_tiling_and_newline(llava_next, tmp_path):
    tiling = Tiling(pinpoints=NEXT_PINPOINTS, tile_size=TILE, max_feature_tiles=1)
    theirs = our_tower(llava_next, tmp_path / "hf", tiling, feature_layer=-2)
    tower = VisionTower(theirs.encoder, theirs.pooler, feature_layer=-2,
                        processor=processor(tiling)).eval()  # the processor's tiling
    assert tower.tiling == tiling
    tower.image_newline.data.copy_(theirs.image_newline)
    tower.save_pretrained(tmp_path / "tower")
    loaded = VisionTower.from_pretrained(tmp_path / "tower").eval()
    assert loaded.tiling == tiling and loaded.processor.tiling == tiling
    assert torch.equal(loaded.image_newline, tower.image_newline)
    views, sizes = loaded.processor.tile([image(640, 427), image(1, 300)])
    with torch.no_grad():
        for mine, saved in zip(tower(views, image_sizes=sizes), loaded(views, image_sizes=sizes),
                               strict=True):
            assert torch.equal(mine, saved)
        as_tensor = loaded(views, image_sizes=torch.tensor(sizes))  # transformers' image_sizes
        assert all(torch.equal(a, b) for a, b in zip(as_tensor, loaded(views, image_sizes=sizes),
                                                     strict=True))
    assert (tmp_path / "tower" / "tiling.safetensors").is_file()
    (tmp_path / "tower" / "tiling.safetensors").unlink()
    with pytest.raises((FileNotFoundError, ValueError), match="tiling.safetensors"):
        VisionTower.from_pretrained(tmp_path / "tower")
    config = json.loads((tmp_path / "tower" / "config.json").read_text())
    config["tower"]["tiling"]["pinpoints"] = [[32, 48]]
    (tmp_path / "tower" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: tower.tiling pinpoint \(32, 48\)"):
        VisionTower.from_pretrained(tmp_path / "tower")
    untiled = VisionTower(tower.encoder, tower.pooler, feature_layer=-2)
    assert untiled.image_newline is None and "image_newline" not in untiled.state_dict()
    untiled.save_pretrained(tmp_path / "untiled")
    assert not (tmp_path / "untiled" / "tiling.safetensors").exists()


def test_a_tiled_tower_refuses_what_it_cannot_pack(llava_next, tmp_path):
    tiling = Tiling(pinpoints=NEXT_PINPOINTS, tile_size=TILE)
    tower = our_tower(llava_next, tmp_path, tiling, feature_layer=-2)
    views, sizes = processor(tiling).tile([image(640, 427)])
    with pytest.raises(ValueError, match="image_sizes"):
        tower(views)
    assert views[0].shape == (5, 3, TILE, TILE)  # 640 x 427 goes on the 64 x 64 canvas
    with pytest.raises(ValueError, match=r"image 0 of size \(640, 427\).*needs \[5, C, 32, 32\]"):
        tower([views[0][:3]], image_sizes=sizes)
    with pytest.raises(ValueError, match="1 images of views for 2 image sizes"):
        tower(views, image_sizes=sizes * 2)
    with pytest.raises(ValueError, match="no tiling"):
        VisionTower(tower.encoder, tower.pooler, feature_layer=-2)(views, image_sizes=sizes)
    with pytest.raises(ValueError, match=r"no prefix tokens \(keep_prefix=False\)"):
        VisionTower(tower.encoder, build_pooler("mlp2x_gelu", in_dim=32), feature_layer=-2,
                    keep_prefix=True, tiling=tiling)
    with pytest.raises(ValueError, match="its processor by None"):
        VisionTower(tower.encoder, tower.pooler, feature_layer=-2, tiling=tiling,
                    processor=dataclasses.replace(processor(tiling), tiling=None))
    with pytest.raises(ValueError, match=r"image size \(0, 300\)"):
        tower.num_image_tokens((0, 300))


@pytest.mark.parametrize("max_feature_tiles", [None, 1])
def test_a_token_wise_projector_maps_only_the_kept_tokens_to_the_same_features(
        llava_next, tmp_path, max_feature_tiles, monkeypatch):
    tiling = Tiling(pinpoints=WIDE_PINPOINTS, tile_size=TILE, max_feature_tiles=max_feature_tiles)
    tower = our_tower(llava_next, tmp_path, tiling, feature_layer=-2)
    views, sizes = processor(tiling).tile([image(*size) for size in SIZES])
    mapped = []
    original = type(tower.pooler).map_tokens
    monkeypatch.setattr(type(tower.pooler), "map_tokens",
                        lambda self, tokens: mapped.append(len(tokens)) or original(self, tokens))
    with torch.no_grad():
        ours = tower(views, image_sizes=sizes)
        monkeypatch.undo()
        tokens, grid = tower.select(torch.cat(views))  # LLaVA's order: project every token
        projected = tower.pooler(tokens, num_prefix_tokens=0, grid=grid)
    reference = [pack_features(part, tiling, size, tower.image_newline) for part, size
                 in zip(projected.split([len(v) for v in views]), sizes, strict=True)]
    side = TILE // PATCH
    assert mapped == [sum(side * side + math.prod(feature_grid_before_downscale(tiling, size))
                          for size in sizes)]  # one call, the unpadded tokens only
    assert mapped[0] < sum(len(v) for v in views) * side * side
    for mine, theirs in zip(ours, reference, strict=True):
        torch.testing.assert_close(mine, theirs, atol=FEATURE_ATOL, rtol=0)


def feature_grid_before_downscale(tiling, size):
    rows, cols = tile_grid(tiling, size)
    top, bottom, left, right = unpadded_box((rows * TILE // PATCH, cols * TILE // PATCH), size)
    return bottom - top, right - left


def test_a_pooler_that_is_not_token_wise_pools_every_view_first(llava_next, tmp_path):
    tiling = Tiling(pinpoints=NEXT_PINPOINTS, tile_size=TILE, newline=False)
    loaded = our_tower(llava_next, tmp_path, Tiling(pinpoints=NEXT_PINPOINTS, tile_size=TILE),
                       feature_layer=-2)
    shuffle = build_pooler("pixel_shuffle", in_dim=VISION["hidden_size"], out_dim=8)
    tower = VisionTower(loaded.encoder, shuffle, feature_layer=-2, tiling=tiling).eval()
    views, sizes = processor(tiling).tile([image(640, 427), image(33, 97)])
    with torch.no_grad():
        ours = tower(views, image_sizes=sizes)
        tokens, grid = tower.select(torch.cat(views))
        pooled = shuffle(tokens, num_prefix_tokens=0, grid=grid)
    assert [len(t) for t in ours] == [tower.num_image_tokens(size) for size in sizes]
    for mine, part, size in zip(ours, pooled.split([len(v) for v in views]), sizes,
                                strict=True):
        assert torch.equal(mine, pack_features(part, tiling, size))
