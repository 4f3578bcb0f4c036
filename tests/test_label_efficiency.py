"""Fine-tuning with k labels per class (vlm_vit.recipes.label_efficiency), layer-wise LR decay."""

import numpy as np
import pytest
import torch

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.adapt.finetune import ImageClassifier
from vlm_vit.recipes.label_efficiency import (
    FinetuneRecipe,
    ShiftedImages,
    finetune_accuracy,
    fingerprint,
    shot_rows,
    translate,
)
from vlm_vit.train import TrainConfig
from vlm_vit.train.trainer import optimizer_groups


def encoder(seed: int = 0) -> VisionEncoder:
    torch.manual_seed(seed)
    return VisionEncoder(EncoderConfig(image_size=16, patch_size=8, width=32, depth=2, heads=4,
                                       mlp_width=64))


def test_translate_moves_the_image_and_fills_with_the_background():
    image = torch.arange(1.0, 17.0).reshape(1, 4, 4)
    moved = translate(image, 1, -2)
    assert torch.equal(moved[0, 1:, :2], image[0, :3, 2:])
    assert (moved[0, 0] == 1).all() and (moved[0, :, 2:] == 1).all()
    assert torch.equal(translate(image, 0, 0), image)


def test_shifted_images_repeat_to_a_batch_and_depend_only_on_seed_epoch_and_index():
    images, labels = torch.randn(3, 1, 8, 8), torch.tensor([0, 1, 2])
    data = ShiftedImages(images, labels, shift=2, min_length=10, seed=5)
    assert len(data) == 12 and data[4][1] == 1
    again = ShiftedImages(images, labels, shift=2, min_length=10, seed=5)
    assert all(torch.equal(data[i][0], again[i][0]) for i in range(12))
    other_seed = ShiftedImages(images, labels, shift=2, min_length=10, seed=6)
    assert any(not torch.equal(data[i][0], other_seed[i][0]) for i in range(12))
    data.set_epoch(1)
    assert any(not torch.equal(data[i][0], again[i][0]) for i in range(12))
    still = ShiftedImages(images, labels, shift=0, min_length=1, seed=5)
    assert torch.equal(still[2][0], images[2])


def test_shot_rows_draw_k_per_class_from_the_pool_only():
    labels = np.repeat(np.arange(3), 10)
    pool = np.arange(0, 30, 2)  # 5 rows of each class
    rows = shot_rows(labels, pool, 2, seed=0)
    assert np.isin(rows, pool).all() and np.bincount(labels[rows]).tolist() == [2, 2, 2]
    assert np.array_equal(shot_rows(labels, pool, None, seed=0), pool)
    assert not np.array_equal(rows, shot_rows(labels, pool, 2, seed=1))


def test_fingerprints_tell_weights_apart():
    a, b = encoder(0), encoder(0)
    assert fingerprint(a) == fingerprint(b) != fingerprint(encoder(1))
    with torch.no_grad():
        b.norm.weight[0] += 1e-6
    assert fingerprint(a) != fingerprint(b)


def stripes(count: int = 40):
    """Two classes a fine-tuned encoder separates easily: horizontal or vertical stripes,
    each at a random phase, with noise."""
    generator = torch.Generator().manual_seed(0)
    labels = np.arange(count) % 2
    phases = torch.randint(0, 4, (count,), generator=generator)
    lines = (torch.arange(16)[None, :] + phases[:, None]) % 4 < 2  # (count, 16)
    images = torch.randn(count, 3, 16, 16, generator=generator) * 0.3
    for index in range(count):
        pattern = lines[index][:, None] if labels[index] == 0 else lines[index][None, :]
        images[index] += 1.5 * pattern.expand(16, 16).float()
    return images, labels


def test_finetuning_learns_leaves_the_encoder_alone_and_refuses_overlap():
    images, labels = stripes()
    start = encoder()
    before = fingerprint(start)
    recipe = FinetuneRecipe(steps=60, batch_size=16, lr=3e-3, shift=1)
    accuracy = finetune_accuracy(start, images, labels, np.arange(20), np.arange(20, 40),
                                 recipe, seed=0)
    assert accuracy >= 0.8  # chance is 0.5
    assert fingerprint(start) == before
    with pytest.raises(ValueError, match="overlap"):
        finetune_accuracy(start, images, labels, np.arange(20), np.arange(19, 40), recipe,
                          seed=0)


def test_layer_decay_gives_each_layer_its_learning_rate():
    classifier = ImageClassifier(encoder(), 3, pooling="mean", layer_decay=0.5)
    groups = optimizer_groups(classifier, TrainConfig(lr=1e-3))
    lr_of = {name: group["lr"] for group in groups for name in group["names"]}
    assert lr_of["head.weight"] == lr_of["backbone.norm.weight"] == pytest.approx(1e-3)
    assert lr_of["backbone.blocks.1.mlp.fc1.weight"] == pytest.approx(1e-3 * 0.5)
    assert lr_of["backbone.blocks.0.attn.qkv.bias"] == pytest.approx(1e-3 * 0.25)
    assert lr_of["backbone.pos_embed"] == lr_of["backbone.patch_embed.proj.weight"] \
        == pytest.approx(1e-3 * 0.125)
    assert groups[0]["lr"] == pytest.approx(1e-3)  # the logged group runs at the schedule's LR
    assert sum(len(g["params"]) for g in groups) == len(list(classifier.parameters()))
    decays = {name: group["weight_decay"] for group in groups for name in group["names"]}
    assert decays["backbone.blocks.0.attn.qkv.bias"] == 0 and decays["head.weight"] > 0
    with pytest.raises(ValueError, match="layer_decay must lie in"):
        ImageClassifier(encoder(), 3, layer_decay=1.5)


def test_without_layer_decay_every_group_runs_at_the_one_lr():
    groups = optimizer_groups(ImageClassifier(encoder(), 3), TrainConfig(lr=2e-3))
    assert {group["lr"] for group in groups} == {2e-3}


def test_finetune_many_progress_is_a_bar_and_done_reports_each_run(capsys):
    from vlm_vit.recipes.label_efficiency import FinetuneJob, finetune_many

    images, labels = stripes()
    recipe = FinetuneRecipe(steps=2, batch_size=8)
    jobs = [FinetuneJob(encoder(), np.arange(20), seed) for seed in (0, 1)]
    quiet = finetune_many(jobs, images, labels, np.arange(20, 40), recipe)
    assert "fine-tuning" not in capsys.readouterr().err
    assert finetune_many(jobs, images, labels, np.arange(20, 40), recipe,
                         progress=True) == quiet
    assert "fine-tuning: 100%" in capsys.readouterr().err
    finished = []
    assert finetune_many(jobs, images, labels, np.arange(20, 40), recipe,
                         done=lambda index, accuracy: finished.append((index, accuracy))) == quiet
    assert finished == list(enumerate(quiet))  # each run as it ends, in order
