"""The frozen tower's features cached per image (`vlm_vit.io.feature_cache`; issue 46): a
cold and a warm pass give the uncached tower's bytes, stacked, packed and partly cached;
every key component (weights, processor, layers, prefix, autocast) misses when it changes;
a trainable encoder is refused."""

import pytest
import torch

from vlm_vit import ImageProcessor, VisionTower, build_pooler
from vlm_vit.io.encode_cache import EncodeCache
from vlm_vit.io.feature_cache import cache_tower_features
from vlm_vit.model import VisionEncoder

from .conftest import tiny_config


def tower(seed: int = 0, feature_layer=-2, keep_prefix: bool = False, size: int = 32):
    torch.manual_seed(seed)
    encoder = VisionEncoder(tiny_config()).eval().requires_grad_(False)
    pooler = build_pooler("mlp2x_gelu", in_dim=encoder.config.width, out_dim=16)
    return VisionTower(encoder, pooler, feature_layer=feature_layer, keep_prefix=keep_prefix,
                       processor=ImageProcessor.for_family("clip", size=size))


def pixels(count: int, size: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, 3, size, size, generator=torch.Generator().manual_seed(seed))


def test_stacked_cold_warm_and_partial_give_the_uncached_bytes(tmp_path):
    model = tower()
    batch = pixels(4)
    expected = model(batch)
    cache = EncodeCache(tmp_path)
    cache_tower_features(model, cache)
    cold = model(batch)
    assert (cache.hits, cache.misses) == (0, 4)
    warm = model(batch)
    assert (cache.hits, cache.misses) == (4, 4)
    assert torch.equal(cold, expected) and torch.equal(warm, expected)
    mixed = torch.cat([batch[2:], pixels(2, seed=9)])  # two hits, two misses
    fresh = model(mixed)
    cache_tower_features(model, None)
    assert (cache.hits, cache.misses) == (6, 6)
    assert torch.allclose(fresh, model(mixed), rtol=0, atol=1e-6)  # measured 0.0 here


def test_the_pooler_still_trains_on_cached_features(tmp_path):
    model = tower()
    cache_tower_features(model, EncodeCache(tmp_path))
    model(pixels(2))  # cold
    loss = model(pixels(2)).square().sum()  # warm
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.pooler.parameters())


def test_packed_images_of_several_sizes(tmp_path):
    model = tower()
    images = [pixels(1, size=side, seed=side)[0] for side in (32, 16, 24)]
    expected = model(images)
    cache = EncodeCache(tmp_path)
    cache_tower_features(model, cache)
    cold, warm = model(images), model(images)
    assert cache.hits == 3
    for a, b, c in zip(expected, cold, warm, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    partly = model([images[1], pixels(1, size=40, seed=40)[0]])  # one hit
    assert torch.allclose(partly[0], expected[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("change", ["weights", "processor", "layers", "prefix", "autocast"])
def test_every_key_component_misses_when_it_changes(tmp_path, change):
    cache = EncodeCache(tmp_path)
    batch = pixels(2)
    first = tower()
    cache_tower_features(first, cache)
    first(batch)
    other = {"weights": lambda: tower(seed=5),
             "processor": lambda: tower(size=48),
             "layers": lambda: tower(feature_layer=-1),
             "prefix": lambda: tower(keep_prefix=True),
             "autocast": tower}[change]()
    if change == "prefix":
        other.pooler = build_pooler("mlp2x_gelu", in_dim=other.encoder.config.width, out_dim=16)
    cache_tower_features(other, cache)
    if change == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            other(batch)
    else:
        other(batch)
    assert (cache.hits, cache.misses) == (0, 4)
    if change == "autocast":  # and without autocast, the same tower hits
        other(batch)
        assert cache.hits == 2


def test_a_trainable_encoder_is_refused(tmp_path):
    model = tower()
    model.encoder.blocks[0].attn.qkv.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="needs a frozen encoder; 1 of its parameters train "
                       r"\(first 'blocks.0.attn.qkv.weight'\)"):
        cache_tower_features(model, EncodeCache(tmp_path))
    model.encoder.requires_grad_(False)
    cache_tower_features(model, EncodeCache(tmp_path))
    model.encoder.blocks[0].mlp.fc1.weight.requires_grad_(True)  # unfrozen after attaching
    with pytest.raises(ValueError, match="needs a frozen encoder"):
        model(pixels(1))
