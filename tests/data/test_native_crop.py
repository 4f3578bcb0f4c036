"""`NativeCrop` (I-JEPA's crop at native resolution) and `collate_native`: seeded, within the
token budget at the crop's own aspect ratio, and collated into `PackedImages`."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from vlm_vit.data.native_crop import NativeCrop
from vlm_vit.data.samples import UndecodableImage, collate_images, collate_native
from vlm_vit.packing import PackedImages

skimage_data = pytest.importorskip("skimage.data")
pytest.importorskip("torchvision.transforms.v2")


@pytest.fixture(scope="module")
def coffee() -> Image.Image:
    return Image.fromarray(skimage_data.coffee()).reduce(4)  # 100 x 150


def test_a_crop_is_seeded_and_keeps_its_aspect_within_the_budget(coffee):
    crop = NativeCrop(patch_size=8, tokens=16)
    image = crop.decoder.load(coffee, "coffee")
    first, again, other = crop(image, 3), crop(image, 3), crop(image, 4)
    assert torch.equal(first, again) and not torch.equal(first, other)
    shapes = {crop(image, seed).shape for seed in range(40)}
    assert len(shapes) > 1  # the boxes' aspect ratios differ, and so do the crops'
    for channels, height, width in shapes:
        assert channels == 3 and height % 8 == 0 and width % 8 == 0
        assert (height // 8) * (width // 8) <= 16
        assert (height // 8) * (width // 8) >= 12  # the budget is filled, not padded


def test_the_crop_is_normalised_and_unflipped_by_default(coffee):
    crop = NativeCrop(patch_size=8, tokens=64, scale=(1.0, 1.0), mean=(0.5,) * 3,
                      std=(0.5,) * 3)
    image = crop.decoder.load(coffee, "coffee")
    pixels = crop(image, 0)
    assert pixels.dtype == torch.float32 and float(pixels.min()) >= -1.0
    assert float(pixels.max()) <= 1.0
    flipped = NativeCrop(patch_size=8, tokens=64, scale=(1.0, 1.0), flip=True,
                         mean=(0.5,) * 3, std=(0.5,) * 3)
    draws = [flipped(image, seed) for seed in range(8)]
    assert any(torch.equal(d, pixels) for d in draws)
    assert any(torch.equal(d, pixels.flip(-1)) for d in draws)  # flip=True flips some


@pytest.mark.parametrize(("options", "message"), [
    (dict(patch_size=0, tokens=16), "patch_size must be a positive int"),
    (dict(patch_size=8, tokens=True), "tokens must be a positive int"),
    (dict(patch_size=8, tokens=16, scale=(0.5, 0.2)), "scale must be"),
])
def test_bad_arguments_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        NativeCrop(**options)


def test_collate_native_packs_images_of_different_sizes_and_drops_undecodable_ones():
    images = [torch.zeros(3, 16, 24), torch.ones(3, 8, 8)]
    bad = UndecodableImage("broken.jpg", "not an image")
    batch = collate_native([images[0], bad, None, images[1]])
    assert isinstance(batch.pixel_values, PackedImages) and len(batch.pixel_values) == 2
    assert all(torch.equal(a, b) for a, b in zip(batch.pixel_values, images, strict=True))
    assert [item.path for item in batch.undecodable] == ["broken.jpg", "<unknown>"]
    with pytest.raises(TypeError, match="collate_native got a str; expected a"):
        collate_native(["x"])
    with pytest.raises(TypeError, match="collate_images got a str; expected a"):
        collate_images(["x"])
