"""DINOv2 multi-crop: seeded views, square and native sizes, the distortions, the collate and
`ViewBatch`, and `ImageFolder(augmentation=...)`."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_vit.data.folders import ImageFolder, describe_dataset
from vlm_vit.data.multicrop import (
    CROP_RATIO,
    MultiCrop,
    ViewBatch,
    Views,
    collate_views,
    grid_size,
)
from vlm_vit.data.samples import UndecodableImage
from vlm_vit.data.shards.decode import ImageDecode

skimage_data = pytest.importorskip("skimage.data")
v2 = pytest.importorskip("torchvision.transforms.v2")
transforms = pytest.importorskip("torchvision.transforms")

PATCH = 8
SQUARE = dict(patch_size=PATCH, global_size=32, local_size=16, local_crops=3)
NATIVE = dict(patch_size=PATCH, global_tokens=16, local_tokens=4, local_crops=3)


@pytest.fixture(scope="module")
def photos() -> list[Image.Image]:
    """Three real photos, shrunk to keep the tests fast: 128 x 128, 96 x 144, 80 x 120."""
    images = [skimage_data.astronaut(), skimage_data.chelsea(), skimage_data.coffee()]
    return [Image.fromarray(image).reduce(factor)
            for image, factor in zip(images, (4, 3, 5), strict=True)]


def views_of(multicrop: MultiCrop, photo: Image.Image, seed: int) -> Views:
    return multicrop(multicrop.decoder.load(photo), seed)


def all_views(views: Views) -> list[torch.Tensor]:
    return [*views.global_views, *views.local_views]


def same_views(first: Views, second: Views) -> bool:
    pairs = list(zip(all_views(first), all_views(second), strict=True))
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("settings", [SQUARE, NATIVE], ids=["square", "native"])
def test_the_views_depend_on_the_seed_only(photos, settings):
    multicrop = MultiCrop(**settings)
    first = views_of(multicrop, photos[1], 7)
    torch.manual_seed(999)  # the caller's RNG must not matter...
    assert same_views(views_of(multicrop, photos[1], 7), first)
    torch.manual_seed(1)
    assert same_views(views_of(multicrop, photos[1], 7), first)
    assert not same_views(views_of(multicrop, photos[1], 8), first)  # ... the seed does
    # and every view of one image is a draw of its own
    assert not torch.equal(first.local_views[0], first.local_views[1])


def test_the_caller_s_rng_is_left_untouched(photos):
    multicrop = MultiCrop(**SQUARE)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    views_of(multicrop, photos[0], 3)
    assert torch.equal(torch.get_rng_state(), state)


def test_square_mode_gives_two_global_and_the_local_crops_at_their_sides(photos):
    views = views_of(MultiCrop(**SQUARE), photos[2], 0)
    assert [view.shape for view in views.global_views] == [(3, 32, 32)] * 2
    assert [view.shape for view in views.local_views] == [(3, 16, 16)] * 3
    assert all(type(view) is torch.Tensor and view.dtype == torch.float32
               for view in all_views(views))


def test_square_global_crop_one_matches_torchvision_s_random_resized_crop(photos):
    """Parity: crop 1's box and resize are `RandomResizedCrop`'s, then its distortions."""
    multicrop = MultiCrop(**SQUARE)
    torch.manual_seed(11)
    reference = v2.Compose([
        v2.ToImage(),
        v2.RandomResizedCrop(32, scale=multicrop.global_scale, ratio=CROP_RATIO,
                             interpolation=v2.InterpolationMode.BICUBIC, antialias=True),
        multicrop.global_transforms[0]])(photos[1])
    assert torch.equal(views_of(multicrop, photos[1], 11).global_views[0], reference)


@pytest.mark.parametrize("seed", range(4))
def test_native_views_fit_the_budget_on_the_patch_grid_with_their_box_s_aspect(
        photos, seed, monkeypatch):
    from vlm_vit.data import multicrop as module

    boxes, budgets = [], []  # each crop's box as torchvision draws it, and its budget
    draw = transforms.RandomResizedCrop.get_params

    def recording_box(*args):
        boxes.append(draw(*args))
        return boxes[-1]

    def recording_budget(height, width, **kwargs):
        budgets.append(kwargs["max_patches"])
        return grid_size(height, width, **kwargs)

    monkeypatch.setattr(transforms.RandomResizedCrop, "get_params", recording_box)
    monkeypatch.setattr(module, "grid_size", recording_budget)
    views = views_of(MultiCrop(**NATIVE), photos[2], seed)
    assert budgets == [16, 16, 4, 4, 4]
    for view, (*_, box_height, box_width), budget in zip(all_views(views), boxes, budgets,
                                                         strict=True):
        height, width = view.shape[1:]
        assert height % PATCH == 0 and width % PATCH == 0
        rows, cols = height // PATCH, width // PATCH
        assert rows * cols <= budget
        aspect = box_width / box_height
        assert abs(cols - rows * aspect) <= 0.5 or abs(rows - cols / aspect) <= 0.5


def test_grid_size_known_values():
    assert grid_size(224, 224, patch=14, max_patches=256) == (224, 224)
    assert grid_size(96, 96, patch=14, max_patches=36) == (84, 84)
    assert grid_size(9, 9, patch=14, max_patches=36) == (84, 84)  # small crops scale up
    assert grid_size(400, 600, patch=16, max_patches=256) == (208, 304)
    assert grid_size(600, 400, patch=16, max_patches=256) == (304, 208)
    assert grid_size(10, 1000, patch=4, max_patches=36) == (4, 144)  # one row of 36


def test_grid_size_is_the_largest_grid_within_half_a_patch_of_the_aspect():
    generator, checked = np.random.default_rng(0), 0
    for _ in range(200):
        height, width = (int(side) for side in generator.integers(1, 2000, size=2))
        budget = int(generator.integers(1, 400))
        out_height, out_width = grid_size(height, width, patch=7, max_patches=budget)
        rows, cols = out_height // 7, out_width // 7
        assert (out_height % 7, out_width % 7) == (0, 0) and rows * cols <= budget
        aspect = width / height
        fits = [r * c for r in range(1, budget + 1) for c in range(1, budget // r + 1)
                if abs(c - r * aspect) <= 0.5 or abs(r - c / aspect) <= 0.5]
        if fits:  # else the aspect is too far out for the budget: one row or column
            checked += 1
            assert rows * cols == max(fits), (height, width, budget)
        else:
            assert 1 in (rows, cols)
    assert checked > 150


def test_the_views_are_normalised_with_the_given_mean_and_std(photos):
    plain = views_of(MultiCrop(**SQUARE, mean=(0, 0, 0), std=(1, 1, 1)), photos[0], 4)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)
    normalised = views_of(MultiCrop(**SQUARE, mean=mean, std=std), photos[0], 4)
    shape = (3, 1, 1)
    for pixels, view in zip(all_views(plain), all_views(normalised), strict=True):
        assert pixels.min() >= 0 and pixels.max() <= 1
        expected = (pixels - torch.tensor(mean).view(shape)) / torch.tensor(std).view(shape)
        torch.testing.assert_close(view, expected)


def test_the_distortions_are_dinov2_s_and_only_global_crop_two_is_solarised():
    multicrop = MultiCrop(**SQUARE)

    def steps(compose, kind):
        return [step for step in compose.transforms if isinstance(step, kind)]

    def blur_probability(compose):
        (blur,) = [step for step in steps(compose, v2.RandomApply)
                   if isinstance(step.transforms[0], v2.GaussianBlur)]
        assert blur.transforms[0].kernel_size == (9, 9)
        return blur.p

    first, second = multicrop.global_transforms
    local = multicrop.local_transform
    (solarize,) = steps(second, v2.RandomSolarize)
    assert (solarize.threshold, solarize.p) == (128, 0.2)
    assert steps(first, v2.RandomSolarize) == [] == steps(local, v2.RandomSolarize)
    assert [blur_probability(compose) for compose in (first, second, local)] == [1.0, 0.1, 0.5]
    for compose in (first, second, local):
        (flip,) = steps(compose, v2.RandomHorizontalFlip)
        (grayscale,) = steps(compose, v2.RandomGrayscale)
        (jitter,) = [step for step in steps(compose, v2.RandomApply)
                     if isinstance(step.transforms[0], v2.ColorJitter)]
        assert (flip.p, grayscale.p, jitter.p) == (0.5, 0.2, 0.8)
        assert isinstance(compose.transforms[-1], v2.Normalize)


def test_solarisation_with_probability_one_inverts_the_bright_pixels_of_crop_two(photos):
    multicrop = MultiCrop(**SQUARE, mean=(0, 0, 0), std=(1, 1, 1))
    before = views_of(multicrop, photos[0], 2)
    for step in multicrop.global_transforms[1].transforms:
        if isinstance(step, v2.RandomSolarize):
            step.p = 1.0
    after = views_of(multicrop, photos[0], 2)
    assert torch.equal(after.global_views[0], before.global_views[0])
    assert after.global_views[1].max() < 128 / 255  # every pixel at 128 or more inverted
    assert same_views(Views([], after.local_views), Views([], before.local_views))


def collated(multicrop: MultiCrop, photos: list[Image.Image], count: int) -> list[Views]:
    return [views_of(multicrop, photos[index % len(photos)], index) for index in range(count)]


def test_the_collate_drops_undecodable_items_and_keeps_the_order(photos):
    items = collated(MultiCrop(**SQUARE), photos, 3)
    bad = UndecodableImage("broken.png", "cannot identify image file")
    batch = collate_views([items[0], bad, items[1], None, items[2]])
    assert batch.undecodable == [bad, UndecodableImage("<unknown>", "the dataset returned None")]
    views = batch.pixel_values
    assert isinstance(views, ViewBatch) and len(views) == 3
    assert [column.shape for column in views.global_views] == [(3, 3, 32, 32)] * 2
    assert [column.shape for column in views.local_views] == [(3, 3, 16, 16)] * 3
    for index, item in enumerate(items):
        assert torch.equal(views.global_views[1][index], item.global_views[1])
        assert torch.equal(views.local_views[2][index], item.local_views[2])
    assert len(collate_views([bad]).pixel_values) == 0
    with pytest.raises(TypeError, match="Tensor"):
        collate_views([torch.zeros(3, 8, 8)])


def test_native_views_of_different_sizes_collate_to_lists(photos):
    items = collated(MultiCrop(**NATIVE), photos, 6)
    views = collate_views(items).pixel_values
    sizes = {item.global_views[0].shape for item in items}
    assert len(sizes) > 1 and isinstance(views.global_views[0], list)
    assert all(views.global_views[0][index] is item.global_views[0]
               for index, item in enumerate(items))


@pytest.mark.parametrize("settings", [SQUARE, NATIVE], ids=["square", "native"])
def test_a_view_batch_splits_like_tensor_split_and_moves(photos, settings):
    items = collated(MultiCrop(**settings), photos, 5)
    views = collate_views(items).pixel_values
    moved = views.to("cpu", non_blocking=True)
    assert isinstance(moved, ViewBatch) and len(moved) == 5
    for sections in (1, 2, 3, 7):
        pieces = moved.tensor_split(sections)
        expected = torch.tensor_split(torch.arange(5), sections)
        assert all(isinstance(piece, ViewBatch) for piece in pieces)
        assert [len(piece) for piece in pieces] == [len(share) for share in expected]
        rejoined = [(piece, row) for piece in pieces for row in range(len(piece))]
        for index, (piece, row) in enumerate(rejoined):  # the shares keep the image order
            assert torch.equal(piece.global_views[1][row], items[index].global_views[1])
            assert torch.equal(piece.local_views[0][row], items[index].local_views[0])


def test_an_image_folder_augments_with_a_ready_multicrop(photos, tmp_path):
    for index, photo in enumerate(photos):
        photo.save(tmp_path / f"photo_{index}.png")
    multicrop = MultiCrop(**SQUARE)
    folder = ImageFolder(tmp_path, augmentation=multicrop, seed=3)
    assert len(folder) == 3 and folder.augmentation is multicrop
    item = folder[1]
    assert isinstance(item, Views) and item.global_views[0].shape == (3, 32, 32)
    assert same_views(folder[1], item)
    folder.set_epoch(1)
    assert not same_views(folder[1], item)
    described = describe_dataset(folder)  # the run configuration records the settings
    assert described["transform"] == repr(multicrop) and "image_size" not in described
    # the shard decoder's folder is the same augmentation with its seed
    twin = ImageDecode(multicrop, seed=3).folder(tmp_path)
    assert twin.augmentation is multicrop and twin.seed == 3
    assert same_views(twin[1], item)
    with pytest.raises(ValueError, match="not both"):
        ImageFolder(tmp_path, 32, augmentation=multicrop)
    with pytest.raises(ValueError, match="augmentation="):
        ImageFolder(tmp_path)


@pytest.mark.parametrize("settings, named", [
    (dict(patch_size=0), "patch_size"),
    (dict(patch_size=8, global_size=30), "global_size .* 30 .*nearest: 32"),
    (dict(patch_size=14), "local_size .* 96 .*nearest: 98"),
    (dict(patch_size=8, local_crops=-1), "local_crops .* -1"),
    (dict(patch_size=8, global_scale=(0.5, 0.2)), r"global_scale .*\(0.5, 0.2\)"),
    (dict(patch_size=8, local_scale=(0.0, 0.3)), r"local_scale .*\(0.0, 0.3\)"),
    (dict(patch_size=8, local_scale=(0.1, 1.5)), r"local_scale .*\(0.1, 1.5\)"),
    (dict(patch_size=8, global_tokens=0, local_tokens=4), "global_tokens .* 0"),
    (dict(patch_size=8, global_tokens=16), "local_tokens"),
    (dict(patch_size=8, local_tokens=4), "local_tokens 4 needs global_tokens"),
    (dict(patch_size=8, global_tokens=16, local_tokens=4, global_size=32), "global_size 32"),
    (dict(patch_size=8, mean=(0.5, 0.5)), "mean"),
])
def test_bad_arguments_are_one_line_value_errors_naming_the_value(settings, named):
    with pytest.raises(ValueError, match=named) as error:
        MultiCrop(**settings)
    assert "\n" not in str(error.value)


def test_native_mode_without_local_crops_needs_no_local_budget(photos):
    views = views_of(MultiCrop(patch_size=PATCH, global_tokens=16, local_crops=0), photos[0], 1)
    assert len(views.global_views) == 2 and views.local_views == []
    assert math.prod(views.global_views[0].shape[1:]) <= 16 * PATCH * PATCH
