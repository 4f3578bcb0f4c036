import numpy as np
import pytest
import torch

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.pretrain.masking import split_counts
from vlm_vit.pretrain.mpp import MaskedPatchPrediction, color_targets

from .conftest_data import photo_batch, train_briefly


def tiny(**overrides):
    torch.manual_seed(0)
    config = dict(image_size=32, patch_size=8, width=32, depth=2, heads=4, mlp_width=64)
    return VisionEncoder(EncoderConfig(**{**config, **overrides}))


def test_split_counts_are_exact():
    assert split_counts(98, (0.8, 0.1, 0.1)) == (78, 10, 10)
    assert split_counts(8, (0.8, 0.1, 0.1)) == (6, 1, 1)


@pytest.mark.parametrize("patches", [196, 16, 15])
def test_corruption_counts_are_exact_per_image(patches):
    objective = MaskedPatchPrediction(tiny())
    plan = objective.plan(5, patches, generator=torch.Generator().manual_seed(0))
    corrupt = int(round(patches * 0.5))
    n_mask, n_replace, n_keep = split_counts(corrupt, (0.8, 0.1, 0.1))
    assert plan.corrupted.sum(1).tolist() == [corrupt] * 5
    assert plan.masked.sum(1).tolist() == [n_mask] * 5
    assert plan.replaced.sum(1).tolist() == [n_replace] * 5
    kept = plan.corrupted & ~plan.masked & ~plan.replaced
    assert kept.sum(1).tolist() == [n_keep] * 5
    assert not (plan.masked & plan.replaced).any() and not (plan.masked & ~plan.corrupted).any()
    own = torch.arange(5 * patches).reshape(5, patches)
    assert torch.equal(plan.source_index[~plan.replaced], own[~plan.replaced])
    assert (plan.source_index[plan.replaced] != own[plan.replaced]).all()  # never itself


def test_split_holds_over_many_draws():
    objective = MaskedPatchPrediction(tiny())
    plan = objective.plan(200, 196, generator=torch.Generator().manual_seed(1))
    assert plan.masked.sum().item() / plan.corrupted.sum().item() == pytest.approx(78 / 98)
    assert plan.replaced.sum().item() / plan.corrupted.sum().item() == pytest.approx(10 / 98)
    # every position is corrupted about half of the time: the draw is uniform
    rate = plan.corrupted.float().mean(0)
    assert rate.min() > 0.38 and rate.max() < 0.62


def test_the_encoder_sees_the_corruption_and_never_touches_the_class_token():
    encoder = tiny()
    objective = MaskedPatchPrediction(encoder)
    seen = {}
    encoder.blocks[0].register_forward_pre_hook(lambda m, args: seen.setdefault("z0", args[0]))
    pixels = torch.randn(3, 3, 32, 32)
    objective(pixels, generator=torch.Generator().manual_seed(4))
    plan = objective.plan(3, 16, generator=torch.Generator().manual_seed(4))
    z0 = seen["z0"]
    table = encoder.pos_embed
    torch.testing.assert_close(z0[:, 0], (encoder.cls_token + table[:, 0]).expand(3, 1, -1)[:, 0])
    embeddings, _ = encoder.patch_embed(pixels)
    flat = embeddings.reshape(-1, 32)
    expected = torch.where(plan.masked[..., None], objective.mask_token,
                           flat[plan.source_index.reshape(-1)].reshape(3, 16, 32))
    torch.testing.assert_close(z0[:, 1:], expected + table[:, 1:])


def test_color_target_of_pure_colours_and_known_patches():
    red = torch.zeros(1, 3, 16, 16)
    red[:, 0] = 1.0
    assert color_targets(red, 8).tolist() == [[448] * 4]  # 64 * 7
    blue = torch.zeros(1, 3, 8, 8)
    blue[:, 2] = 1.0
    assert color_targets(blue, 8).tolist() == [[7]]
    rng = np.random.default_rng(0)
    pixels = rng.random((2, 3, 16, 24)).astype(np.float32)
    expected = np.zeros((2, 6), dtype=int)
    for b in range(2):
        for index, (r, c) in enumerate([(r, c) for r in range(2) for c in range(3)]):
            means = pixels[b, :, 8 * r:8 * r + 8, 8 * c:8 * c + 8].mean(axis=(1, 2))
            levels = np.minimum(np.floor(means * 8), 7).astype(int)
            expected[b, index] = levels[0] * 64 + levels[1] * 8 + levels[2]
    assert color_targets(torch.from_numpy(pixels), 8).tolist() == expected.tolist()


def test_loss_falls_on_real_images():
    objective = MaskedPatchPrediction(tiny())
    losses = train_briefly(objective, photo_batch())
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])
