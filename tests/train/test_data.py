"""Image folders: discovery, deterministic augmentation, bad files, labelled evaluation."""

from __future__ import annotations

import pytest
import torch

from tests.train.toy import image_folder, write_bad_images, write_noise_images
from vlm_vit.processor import NORMALIZATION, ImageLoadError, ImageProcessor
from vlm_vit.train import ImageFolder, LabelledImageFolder, UndecodableImage, collate_images

MEAN, STD = NORMALIZATION["imagenet"]


def test_finds_images_recursively_sorted_and_ignores_other_files(tmp_path):
    write_noise_images(tmp_path / "b", 2)
    write_noise_images(tmp_path / "a" / "deep", 2)
    (tmp_path / "a" / "readme.txt").write_text("not an image")
    (tmp_path / "UPPER.PNG").write_bytes((tmp_path / "b" / "img_000.png").read_bytes())
    folder = image_folder(tmp_path)
    relative = [p.relative_to(tmp_path).as_posix() for p in folder.files]
    assert relative == ["UPPER.PNG", "a/deep/img_000.png", "a/deep/img_001.png",
                        "b/img_000.png", "b/img_001.png"]


def test_an_empty_folder_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        image_folder(tmp_path)


def test_augmentation_depends_only_on_seed_epoch_and_index(tmp_path):
    write_noise_images(tmp_path, 3)
    folder = image_folder(tmp_path)
    first = folder[1]
    assert first.shape == (3, 32, 32) and first.dtype == torch.float32

    rng = torch.get_rng_state()
    torch.manual_seed(999)  # the global RNG must not matter...
    assert torch.equal(folder[1], first)
    torch.manual_seed(999)
    folder[1]
    after = torch.rand(1)
    torch.manual_seed(999)
    assert torch.equal(torch.rand(1), after)  # ...nor be consumed
    torch.set_rng_state(rng)

    assert torch.equal(image_folder(tmp_path)[1], first)  # a new process, say
    assert not torch.equal(folder[2], first)
    folder.set_epoch(1)
    assert not torch.equal(folder[1], first)
    assert not torch.equal(image_folder(tmp_path, seed=1)[1], first)


def test_full_crop_without_flip_is_the_normalised_image(tmp_path):
    write_noise_images(tmp_path, 1, size=(32, 32))
    folder = ImageFolder(tmp_path, 32, mean=MEAN, std=STD, scale=(1.0, 1.0), flip=False)
    expected = ImageProcessor(size=32, mean=MEAN, std=STD)(folder.files[0])[0]
    torch.testing.assert_close(folder[0], expected, atol=1e-6, rtol=0)


def test_bad_files_become_markers_that_collate_drops(tmp_path):
    write_noise_images(tmp_path, 2)
    truncated, text = write_bad_images(tmp_path)
    folder = image_folder(tmp_path)
    items = [folder[i] for i in range(len(folder))]
    markers = [item for item in items if isinstance(item, UndecodableImage)]
    assert sorted(m.path for m in markers) == sorted([str(truncated), str(text)])
    assert all(m.reason for m in markers)

    batch = collate_images([*items, None])
    assert batch.pixel_values.shape == (2, 3, 32, 32)
    assert len(batch.undecodable) == 3 and batch.undecodable[-1].path == "<unknown>"
    assert collate_images([markers[0]]).pixel_values.shape[0] == 0
    with pytest.raises(TypeError, match="str"):
        collate_images(["not an image"])


def test_labelled_folder_has_classes_labels_and_a_deterministic_transform(tmp_path):
    write_noise_images(tmp_path / "dog", 2, seed=1)
    write_noise_images(tmp_path / "cat", 3, seed=2)
    folder = LabelledImageFolder(tmp_path, 32, mean=MEAN, std=STD)
    assert folder.classes == ["cat", "dog"] and len(folder) == 5
    assert [label for _, label in folder.samples] == [0, 0, 0, 1, 1]
    image, label = folder[4]
    assert image.shape == (3, 32, 32) and label == 1
    assert torch.equal(folder[4][0], image)
    expected = ImageProcessor(size=32, mean=MEAN, std=STD)(folder.samples[4][0])[0]
    assert torch.equal(image, expected)

    write_bad_images(tmp_path / "cat")
    folder = LabelledImageFolder(tmp_path, 32, mean=MEAN, std=STD)
    bad = next(i for i, (path, _) in enumerate(folder.samples) if path.suffix == ".jpg")
    with pytest.raises(ImageLoadError, match="notes.jpg"):
        folder[bad]


def test_labelled_folder_agrees_with_evaluation_on_classes_and_labels(tmp_path):
    from vlm_vit.eval import read_class_folder

    write_noise_images(tmp_path / "dog", 2, seed=1)
    write_noise_images(tmp_path / "cat", 3, seed=2)
    write_noise_images(tmp_path / ".ipynb_checkpoints", 1, seed=3)  # hidden: not a class
    folder = LabelledImageFolder(tmp_path, 32, mean=MEAN, std=STD)
    files, labels, classes = read_class_folder(tmp_path)
    assert folder.classes == classes == ["cat", "dog"]
    assert [(path, label) for path, label in folder.samples] == list(
        zip(files, labels, strict=True))
