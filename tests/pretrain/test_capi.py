"""The capi objective (CAPI): its masks are lightly's `random_inverse_block_mask` draw for
draw, its position-wise Sinkhorn-Knopp and loss equal lightly's `CAPILoss`, its predictor
equals lightly's `CAPIPredictorTIMM`, a whole step's loss and gradients equal lightly's parts
around the same encoder, packed images equal one call each, and the EMA follows its
formula."""

import warnings

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.layers.rope_2d import grid_positions
from vlm_vit.pretrain.capi import ClusterPredictiveMasking
from vlm_vit.pretrain.capi_predictor import CAPIPredictor, lightly_state_dict
from vlm_vit.pretrain.cluster_losses import cluster_cross_entropy, positionwise_sinkhorn
from vlm_vit.pretrain.inverse_block_masking import (
    InverseBlockMask,
    batch_inverse_block_masks,
)
from vlm_vit.pretrain.schedules import cosine

TINY = dict(image_size=64, patch_size=8, width=32, depth=2, heads=4, mlp_width=64)
OPTIONS = dict(clusters=24, predictor_depth=2)


def objective(dtype=torch.float32, seed=0, **options) -> ClusterPredictiveMasking:
    torch.manual_seed(seed)
    made = ClusterPredictiveMasking(VisionEncoder(EncoderConfig(**TINY)),
                                    **{**OPTIONS, **options})
    with torch.no_grad():  # student and teacher apart, as after some training
        for parameter in made.student.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    return made.to(dtype)


# -- masks ----------------------------------------------------------------------------------


def test_masks_equal_lightlys_inverse_block_masks_draw_for_draw():
    utils = pytest.importorskip("lightly.models.utils")
    for seed in range(30):
        torch.manual_seed(seed)
        keep, mask = utils.random_inverse_block_mask((5, 1 + 64), mask_ratio=0.65)
        ours = batch_inverse_block_masks([(8, 8)] * 5, torch.Generator().manual_seed(seed))
        assert torch.equal(torch.stack([m.visible for m in ours]) + 1, keep[:, 1:])
        assert torch.equal(torch.stack([m.masked for m in ours]) + 1, mask)


@settings(max_examples=30, deadline=None, phases=[Phase.generate])
@given(grids=st.lists(st.tuples(st.integers(1, 16), st.integers(1, 16)), min_size=1,
                      max_size=4), ratio=st.floats(0.0, 0.95), seed=st.integers(0, 2**31))
def test_each_mask_lies_on_its_own_grid_with_exact_counts(grids, ratio, seed):
    for (rows, cols), mask in zip(grids, batch_inverse_block_masks(
            grids, torch.Generator().manual_seed(seed), ratio=ratio), strict=True):
        patches = rows * cols
        assert len(mask.masked) == int(patches * ratio)
        assert torch.equal(torch.cat([mask.visible, mask.masked]).sort().values,
                           torch.arange(patches))


# -- targets and loss -----------------------------------------------------------------------


def test_the_positionwise_sinkhorn_equals_lightlys():
    capi_loss = pytest.importorskip("lightly.loss.capi_loss")
    logits = torch.randn(5, 9, 12, generator=torch.Generator().manual_seed(0),
                         dtype=torch.float64)
    expected = capi_loss.sinkhorn_knopp(logits / 0.06, iterations=3)
    ours = positionwise_sinkhorn(logits.flatten(0, 1), torch.arange(9).repeat(5), 9, 0.06)
    torch.testing.assert_close(ours.reshape(5, 9, 12), expected, rtol=0, atol=1e-12)


def test_images_of_other_grids_share_the_positions_they_have():
    """An image of another grid changes the assignments only at the positions it has."""
    logits = torch.randn(2 * 9 + 4, 6, generator=torch.Generator().manual_seed(1),
                         dtype=torch.float64)
    square = torch.arange(9).repeat(2)
    small = torch.tensor([0, 1, 3, 4])  # a 2 x 2 image in the 3 x 3 grid's corner
    both = positionwise_sinkhorn(logits, torch.cat([square, small]), 9, 0.06)
    alone = positionwise_sinkhorn(logits[:18], square, 9, 0.06)
    untouched = ~torch.isin(square, small)
    torch.testing.assert_close(both[:18][untouched], alone[untouched], rtol=0, atol=1e-12)
    assert not torch.allclose(both[:18][~untouched], alone[~untouched])
    torch.testing.assert_close(both.sum(-1), torch.ones(22, dtype=torch.float64))


def test_the_loss_and_its_gradient_equal_lightlys_capi_loss():
    loss_module = pytest.importorskip("lightly.loss")
    generator = torch.Generator().manual_seed(2)
    teacher = torch.randn(4, 9, 12, generator=generator, dtype=torch.float64)
    student = torch.randn(4, 5, 12, generator=generator, dtype=torch.float64,
                          requires_grad=True)
    index = torch.stack([torch.randperm(9, generator=generator)[:5] for _ in range(4)])
    expected = loss_module.CAPILoss()(teacher, student, teacher_index=index)
    (expected_grad,) = torch.autograd.grad(expected, student)
    targets = positionwise_sinkhorn(teacher.flatten(0, 1), torch.arange(9).repeat(4), 9, 0.06)
    picked = targets.reshape(4, 9, 12).gather(1, index[..., None].expand(-1, -1, 12))
    ours = cluster_cross_entropy(student.flatten(0, 1), picked.flatten(0, 1), 0.12)
    (grad,) = torch.autograd.grad(ours, student)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)


# -- predictor ------------------------------------------------------------------------------


def lightly_predictor(ours: CAPIPredictor, grid):
    """lightly's `CAPIPredictorTIMM` with our predictor's weights (query and key rows in
    timm's RoPE order)."""
    modules = pytest.importorskip("lightly.models.modules")
    width, heads = ours.mask_token.shape[0], ours.blocks[0].heads
    theirs = modules.CAPIPredictorTIMM(width, grid, depth=len(ours.blocks), num_heads=heads)
    theirs.load_state_dict(lightly_state_dict(ours))
    return theirs.to(ours.mask_token.dtype)


def test_the_predictor_equals_lightlys_on_the_same_weights():
    torch.manual_seed(0)
    ours = CAPIPredictor(32, depth=2, heads=4)
    grid = (8, 8)
    theirs = lightly_predictor(ours, grid)
    generator = torch.Generator().manual_seed(3)
    context = torch.randn(3, 20, 32, generator=generator, requires_grad=True)
    visible = torch.stack([torch.randperm(64, generator=generator)[:20].sort().values
                           for _ in range(3)])
    masked = torch.stack([torch.randperm(64, generator=generator)[:7] for _ in range(3)])
    expected = theirs(context, visible, masked)
    where = grid_positions(grid)
    out = torch.stack(ours(list(context), [where[v] for v in visible],
                           [where[m] for m in masked]))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    (grad,) = torch.autograd.grad(out.square().sum(), context)
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), context)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-4)


# -- the whole step -------------------------------------------------------------------------


def test_a_step_equals_lightlys_parts_around_the_same_encoder():
    """lightly's CAPI example around our encoder: `CAPIProjectionHead` (bias) as the
    clustering head, `CAPIPredictorTIMM`, `CAPIProjectionHead(weight_norm=True)` as the
    student head, `CAPILoss` for both losses."""
    modules = pytest.importorskip("lightly.models.modules")
    loss_module = pytest.importorskip("lightly.loss")
    made = objective()
    generator = torch.Generator().manual_seed(4)
    pixels = torch.randn(3, 3, 64, 64, generator=generator)
    masks = batch_inverse_block_masks([(8, 8)] * 3, generator)
    out = made(pixels, masks=masks)
    out.loss.backward()
    ours = {n: p.grad.clone() for n, p in made.named_parameters() if p.grad is not None}
    made.zero_grad(set_to_none=True)

    with warnings.catch_warnings():  # the old torch weight_norm
        warnings.simplefilter("ignore", FutureWarning)
        student_head = modules.CAPIProjectionHead(32, 24, weight_norm=True)
    student_head.layer.weight_v.data.copy_(made.prototypes.detach())
    teacher_head = modules.CAPIProjectionHead(32, 24, bias=True)
    teacher_head.load_state_dict({"layer.weight": made.clustering.weight.detach(),
                                  "layer.bias": made.clustering.bias.detach()})
    predictor = lightly_predictor(made.predictor, (8, 8))
    visible = torch.stack([m.visible for m in masks])
    masked = torch.stack([m.masked for m in masks])
    with torch.no_grad():
        features = made.encoder(pixels).patch_tokens
    teacher_logits = teacher_head(features)
    context = made.student(pixels, keep=visible).patch_tokens
    student_logits = student_head(predictor(context, visible, masked))
    criterion = loss_module.CAPILoss()
    loss = criterion(teacher_logits, student_logits, teacher_index=masked) \
        + criterion(teacher_logits, teacher_logits)
    loss.backward()
    torch.testing.assert_close(out.loss, loss, rtol=0, atol=1e-5)
    expected = {"prototypes": student_head.layer.weight_v.grad,
                "clustering.weight": teacher_head.layer.weight.grad,
                "clustering.bias": teacher_head.layer.bias.grad}
    for name, grad in ours.items():
        if name.startswith("student."):
            reference = dict(made.named_parameters())[name].grad
        elif name in expected:
            reference = expected[name]
        else:
            continue  # the predictor: its own test above
        scale = max(1.0, reference.abs().max().item())
        torch.testing.assert_close(grad, reference, rtol=0, atol=1e-4 * scale, msg=name)
    assert not any(n.startswith("encoder.") for n in ours)  # the teacher gets no gradient


@settings(max_examples=6, deadline=None, phases=[Phase.generate])
@given(sizes=st.lists(st.tuples(st.integers(2, 8), st.integers(2, 8)), min_size=1,
                      max_size=4), seed=st.integers(0, 2**31))
def test_packed_images_equal_one_call_each(sizes, seed):
    made = objective(torch.float64)
    generator = torch.Generator().manual_seed(seed)
    images = [torch.randn(3, 8 * h, 8 * w, generator=generator, dtype=torch.float64)
              for h, w in sizes]
    masks = batch_inverse_block_masks(list(sizes), generator)
    results = []
    for packed in (True, False):
        made.packed = packed
        made.zero_grad(set_to_none=True)
        loss = made(images, masks=masks).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in made.named_parameters()
                                        if p.grad is not None}))
    (packed_loss, packed_grads), (loss, grads) = results
    torch.testing.assert_close(packed_loss, loss, rtol=0, atol=1e-10)
    assert packed_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=0, atol=1e-10, msg=name)


# -- EMA and options ------------------------------------------------------------------------


def test_the_ema_follows_its_cosine_and_the_teacher_is_the_exported_encoder():
    made = objective()
    before = {n: p.detach().clone() for n, p in made.encoder.named_parameters()}
    student = {n: p.detach().clone() for n, p in made.student.named_parameters()}
    made.after_optimizer_step(30, 100)
    momentum = cosine(0.996, 1.0, 30, 100)
    for name, value in made.encoder.named_parameters():
        expected = momentum * before[name] + (1 - momentum) * student[name]
        torch.testing.assert_close(value.detach(), expected, rtol=1e-6, atol=1e-7, msg=name)
    made.train()
    assert not made.encoder.training and made.student.training


def test_predict_fraction_scores_a_share_of_each_image_s_masked_patches():
    made = objective(predict_fraction=0.05)
    masks = made.draw_masks([(8, 8), (3, 5)])
    assert [len(m.masked) for m in masks] == [2, 1]  # int(41 * 0.05), at least one
    assert all(not torch.isin(m.masked, m.visible).any() for m in masks)
    assert isinstance(masks[0], InverseBlockMask)


@pytest.mark.parametrize("options,message", [
    (dict(mask_ratio=1.0), "mask ratio"),
    (dict(predict_fraction=0.0), "predict_fraction"),
    (dict(clusters=1), "at least 2 clusters"),
])
def test_a_bad_option_is_one_clear_error(options, message):
    with pytest.raises(ValueError, match=message):
        objective(**options)
