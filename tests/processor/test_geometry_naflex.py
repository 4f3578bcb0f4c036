"""SigLIP 2's NaFlex size rule (`naflex_size`) equals transformers'
`get_image_size_for_max_num_patches` on many sizes: both orientations, odd and prime sides,
tiny images (scaled up), huge strips, and the default and a large budget."""

import random

import pytest

from vlm_vit.processor.geometry import naflex_size

siglip2 = pytest.importorskip("transformers.models.siglip2.image_processing_pil_siglip2")

BUDGETS = (256, 1024)
SIZES = [
    (1080, 1920), (1920, 1080), (400, 600), (600, 400), (224, 224), (256, 256), (512, 512),
    (1, 1), (1, 2), (3, 5), (15, 17), (16, 16), (17, 16), (31, 33), (97, 101), (999, 1001),
    (1, 100_000), (100_000, 1), (5, 2507), (2939, 10), (16, 65_536), (4097, 4095),
    (768, 1024), (1024, 768), (3000, 40), (40, 3000), (7919, 7907), (12_000, 9_000),
]
rng = random.Random(0)
SIZES += [(rng.randint(1, 4000), rng.randint(1, 4000)) for _ in range(150)]
SIZES += [(rng.randint(1, 64), rng.randint(1, 20_000)) for _ in range(25)]  # strips


@pytest.mark.parametrize("budget", BUDGETS)
def test_equals_transformers_on_many_sizes(budget):
    for patch in (16, 14):
        for height, width in SIZES:
            expected = siglip2.get_image_size_for_max_num_patches(height, width, patch, budget)
            ours = naflex_size(height, width, patch=patch, max_num_patches=budget)
            assert ours == expected, (height, width, patch, budget)
            rows, cols = ours[0] // patch, ours[1] // patch
            assert ours == (rows * patch, cols * patch) and 1 <= rows * cols <= budget


def test_worked_numbers_of_the_docstring():
    assert naflex_size(1080, 1920, patch=16, max_num_patches=256) == (192, 336)
    assert naflex_size(1080, 1920, patch=16, max_num_patches=1024) == (384, 672)
    assert naflex_size(400, 600, patch=16, max_num_patches=256) == (208, 304)
    assert naflex_size(224, 224, patch=16, max_num_patches=256) == (256, 256)
    assert naflex_size(1, 100_000, patch=16, max_num_patches=256) == (16, 4096)


@pytest.mark.parametrize("arguments, message", [
    ((0, 10, 16, 256), "height must be a positive int, got 0"),
    ((10, 2.5, 16, 256), "width must be a positive int, got 2.5"),
    ((10, 10, True, 256), "patch must be a positive int, got True"),
    ((10, 10, 16, 0), "max_num_patches must be a positive int, got 0"),
    ((1, 10**9, 16, 1), r"cannot be scaled to at most 1 patches of 16 .* gives 1 x 63"),
])
def test_bad_arguments_are_refused_by_name(arguments, message):
    height, width, patch, budget = arguments
    with pytest.raises(ValueError, match=message):
        naflex_size(height, width, patch=patch, max_num_patches=budget)


@pytest.mark.parametrize("budget", BUDGETS)
def test_the_naflex_processor_gives_siglip2s_pixels(budget):
    # ImageProcessor(resize_mode="native", max_num_patches=N): naflex_size, then the plain
    # resize. Siglip2ImageProcessorPil's pixels exactly (its torchvision backend differs by
    # one 8-bit level where it antialiases differently), small images scaled up.
    import numpy as np
    import torch
    from PIL import Image
    from transformers import Siglip2ImageProcessorPil

    from vlm_vit import ImageProcessor

    rng = np.random.default_rng(0)
    for height, width in [(512, 512), (300, 400), (180, 320), (37, 300), (20, 30)]:
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        ours = ImageProcessor(resize_mode="native", patch_multiple=16, max_num_patches=budget,
                              resample="bilinear", mean=(0.5,) * 3, std=(0.5,) * 3)(image)[0]
        out = Siglip2ImageProcessorPil(patch_size=16, max_num_patches=budget)(
            images=image, return_tensors="pt")
        rows, cols = (int(side) for side in out.spatial_shapes[0])
        # [rows * cols, 16 * 16 * 3] patches, each flattened (row, column, channel)
        theirs = out.pixel_values[0, :rows * cols].reshape(rows, cols, 16, 16, 3) \
            .permute(4, 0, 2, 1, 3).reshape(3, rows * 16, cols * 16)
        assert ours.shape == theirs.shape == (3, *naflex_size(height, width, patch=16,
                                                               max_num_patches=budget))
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_max_num_patches_is_checked():
    from vlm_vit import ImageProcessor

    for bad in [dict(max_num_patches=0), dict(max_num_patches=64, max_output_pixels=4096),
                dict(max_num_patches=2.5)]:
        with pytest.raises(ValueError, match="max_num_patches"):
            ImageProcessor(resize_mode="native", patch_multiple=16, **bad)
    with pytest.raises(ValueError, match="max_num_patches 64 needs resize_mode 'native'"):
        ImageProcessor(max_num_patches=64)
    processor = ImageProcessor(resize_mode="native", patch_multiple=16, max_num_patches=64)
    assert ImageProcessor.from_dict(processor.to_dict()) == processor
