"""DINOv2's losses against lightly's (loss and gradient), their formulas, and two gloo ranks."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlm_vit.pretrain.distillation_losses import (
    Center,
    dino_loss,
    ibot_patch_loss,
    koleo_loss,
    sinkhorn_knopp,
    softmax_center,
)

lightly_loss = pytest.importorskip("lightly.loss")
from lightly.loss.swav_loss import sinkhorn as lightly_sinkhorn  # noqa: E402
from lightly.models.utils import random_block_mask  # noqa: E402

K = 64
# lightly turns the teacher temperature into a float32 tensor: 1/16 is exact there, so the
# float64 comparisons see the same temperature.
TEACHER_TEMP = 0.0625
# Largest |ours - lightly| measured over the parametrised DINO cases: float64 loss 2.8e-14 on
# losses of 70 to 82 (relative 4e-16), gradient 2.8e-17; float32 loss 1.5e-5 (two float32
# ulps at 79, relative 2e-7), gradient 6.0e-8. Hence relative 1e-12 and 1e-6.
TOLERANCE = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-6,
                                                                              atol=1e-6)}


def logits(*shape, seed=0, dtype=torch.float64, scale=3.0, grad=False):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * scale
    return x.requires_grad_(grad)


def float32_center(seed=99, dtype=torch.float64):
    """A center lightly's float32 buffer holds exactly."""
    return logits(1, K, seed=seed, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("teachers, students", [(2, 2), (2, 8), (1, 3), (3, 2)])
def test_dino_loss_and_gradient_match_lightly(teachers, students, dtype):
    teacher = [logits(6, K, seed=v, dtype=dtype) for v in range(teachers)]
    student = [logits(6, K, seed=10 + v, dtype=dtype, grad=True) for v in range(students)]
    center = float32_center(dtype=dtype)
    reference = lightly_loss.DINOLoss(K, teacher_temp=TEACHER_TEMP).to(dtype)
    reference.center.copy_(center[None])
    expected = reference(teacher, student, teacher_temp=TEACHER_TEMP)
    expected_grad = torch.autograd.grad(expected, student)

    before = [t.clone() for t in teacher]
    loss = dino_loss(student, [softmax_center(t, center, TEACHER_TEMP) for t in teacher])
    torch.testing.assert_close(loss, expected, **TOLERANCE[dtype])
    for ours, theirs in zip(torch.autograd.grad(loss, student), expected_grad, strict=True):
        torch.testing.assert_close(ours, theirs, **TOLERANCE[dtype])
    assert all(torch.equal(a, b) for a, b in zip(teacher, before, strict=True))

    # lightly updates its center inside forward; ours is a separate call on the same logits
    running = Center(K).to(dtype)
    running.center.copy_(center)
    running.update(torch.stack(teacher))
    torch.testing.assert_close(running.center, reference.center[0], rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(teachers=st.integers(1, 3), students=st.integers(1, 5), batch=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_dino_loss_matches_lightly_for_any_views(teachers, students, batch, seed):
    if teachers * students == min(teachers, students):  # one view each: no pair to compare
        with pytest.raises(ValueError, match="no pair of different views"):
            dino_loss([logits(batch, K)] * students, [logits(batch, K)] * teachers)
        return
    teacher = [logits(batch, K, seed=seed + v) for v in range(teachers)]
    student = [logits(batch, K, seed=seed + 100 + v) for v in range(students)]
    reference = lightly_loss.DINOLoss(K, teacher_temp=TEACHER_TEMP).double()
    expected = reference(teacher, student, teacher_temp=TEACHER_TEMP)
    probs = [softmax_center(t, torch.zeros(1, K), TEACHER_TEMP) for t in teacher]
    torch.testing.assert_close(dino_loss(student, probs), expected, rtol=1e-12, atol=1e-12)


def test_dino_loss_is_the_mean_over_pairs_of_different_views():
    """Two global and one local view: pairs (t0, s1), (t0, s2), (t1, s0), (t1, s2)."""
    teacher = [torch.softmax(logits(3, K, seed=v), -1) for v in range(2)]
    student = [logits(3, K, seed=10 + v) for v in range(3)]

    def cross_entropy(t, s):
        return -(teacher[t] * torch.log_softmax(student[s] / 0.1, -1)).sum(-1).mean()

    expected = sum(cross_entropy(t, s) for t, s in [(0, 1), (0, 2), (1, 0), (1, 2)]) / 4
    torch.testing.assert_close(dino_loss(student, teacher), expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="same"):
        dino_loss(student, [teacher[0][:2], teacher[1]])


def ibot_inputs(mask, dtype, seed=0):
    masked = int(mask.sum())
    return (logits(masked, K, seed=seed, dtype=dtype, grad=True),
            logits(masked, K, seed=seed + 1, dtype=dtype))


def ibot_against_lightly(mask, dtype):
    """Ours with `image_index` read off lightly's `[B, H, W]` mask, against lightly."""
    student, teacher = ibot_inputs(mask, dtype)
    center = float32_center(dtype=dtype)
    reference = lightly_loss.IBOTPatchLoss(K, teacher_temp=TEACHER_TEMP).to(dtype)
    reference.center.center.copy_(center)
    expected = reference(teacher, student, mask, teacher_temp=TEACHER_TEMP)
    expected_grad, = torch.autograd.grad(expected, student)
    image_index = mask.nonzero()[:, 0]  # row-major, the order of mask-boolean indexing
    before = teacher.clone()
    loss = ibot_patch_loss(student, softmax_center(teacher, center, TEACHER_TEMP), image_index,
                           num_images=mask.shape[0])
    grad, = torch.autograd.grad(loss, student)
    assert torch.equal(teacher, before)
    return loss, expected, grad, expected_grad


def test_ibot_patch_loss_and_gradient_match_lightly_float64():
    # lightly's weights 1 / (masked tokens) are float32 even for float64 inputs: counts that
    # are powers of two make them exact, so the comparison can be at 1e-12 (measured: loss
    # 1.4e-14, gradient 0; on the block masks below, float64, it is 9.3e-7 from those weights).
    mask = torch.zeros(5, 3, 4, dtype=torch.bool)
    for image, count in enumerate([1, 2, 0, 8, 4]):
        mask[image].view(-1)[torch.randperm(12, generator=torch.Generator().manual_seed(image))
                             [:count]] = True
    loss, expected, grad, expected_grad = ibot_against_lightly(mask, torch.float64)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)


def test_ibot_patch_loss_and_gradient_match_lightly_on_block_masks():
    random.seed(0)
    mask = random_block_mask((8, 5, 7))  # half the images masked, uneven counts
    assert 0 < (mask.sum((1, 2)) > 0).sum() < 8
    # measured max |difference|: loss 3.8e-6 (of 38, relative 1e-7), gradient 0
    loss, expected, grad, expected_grad = ibot_against_lightly(mask, torch.float32)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-6)


def test_ibot_patch_loss_on_images_of_different_grids():
    """The mean over images of each image's own loss, lightly run on each image alone."""
    grids, counts = [(2, 3), (4, 1), (3, 3), (5, 2)], [4, 0, 2, 1]
    student, teacher, index, expected = [], [], [], 0.0
    for image, ((h, w), count) in enumerate(zip(grids, counts, strict=True)):
        mask = torch.zeros(1, h, w, dtype=torch.bool)
        mask.view(-1)[:count] = True
        s, t = ibot_inputs(mask, torch.float64, seed=10 * image)
        probs = torch.softmax(t / TEACHER_TEMP, -1)
        if count:
            reference = lightly_loss.IBOTPatchLoss(K, teacher_temp=TEACHER_TEMP).double()
            expected = expected + reference(t, s, mask, teacher_temp=TEACHER_TEMP)
        student.append(s)
        teacher.append(probs)
        index.append(torch.full((count,), image))
    loss = ibot_patch_loss(torch.cat(student), torch.cat(teacher), torch.cat(index), len(grids))
    torch.testing.assert_close(loss, expected / len(grids), rtol=1e-12, atol=1e-12)


def test_ibot_patch_loss_without_masked_tokens_and_with_bad_input():
    student = logits(0, K, grad=True)
    loss = ibot_patch_loss(student, logits(0, K), torch.zeros(0, dtype=torch.long), 4)
    assert loss.item() == 0.0 and loss.requires_grad
    with pytest.raises(IndexError):
        ibot_patch_loss(logits(2, K), logits(2, K), torch.tensor([0, 4]), 4)
    with pytest.raises(ValueError, match=r"image_index must be \[2\]"):
        ibot_patch_loss(logits(2, K), logits(2, K), torch.tensor([0]), 4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_koleo_loss_and_gradient_match_lightly(dtype):
    x = logits(16, 32, dtype=dtype, grad=True)
    expected = lightly_loss.KoLeoLoss()(x)
    expected_grad, = torch.autograd.grad(expected, x)
    before = x.detach().clone()
    loss = koleo_loss(x)
    grad, = torch.autograd.grad(loss, x)
    # measured: equal to the last bit in both precisions
    torch.testing.assert_close(loss, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(grad, expected_grad, **TOLERANCE[dtype])
    assert torch.equal(x.detach(), before)


def test_koleo_loss_of_a_known_configuration():
    """Four unit vectors at right angles: each neighbour lies sqrt(2) away."""
    x = torch.tensor([[2.0, 0.0], [0.0, 3.0], [-1.0, 0.0], [0.0, -5.0]], dtype=torch.float64)
    torch.testing.assert_close(koleo_loss(x), -torch.log(torch.tensor(2.0**0.5 + 1e-8,
                                                                      dtype=torch.float64)))
    with pytest.raises(ValueError, match="B >= 2"):
        koleo_loss(x[:1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [0.05, TEACHER_TEMP, 0.1])
def test_sinkhorn_knopp_matches_lightly(temperature, dtype):
    # lightly's sinkhorn omits DINOv2's division by K in the row step, a constant that the
    # column step cancels, and subtracts no maximum: the same targets up to rounding
    # (measured max |difference|: float64 5.6e-16, float32 5.4e-7).
    scores = logits(32, K, dtype=dtype, scale=1.0)
    expected = lightly_sinkhorn(scores, iterations=3, epsilon=temperature)
    before = scores.clone()
    targets = sinkhorn_knopp(scores, temperature)
    torch.testing.assert_close(targets, expected, **TOLERANCE[dtype])
    assert torch.equal(scores, before)
    torch.testing.assert_close(targets.sum(-1), torch.ones(32, dtype=dtype))  # distributions


def test_sinkhorn_knopp_balances_the_prototypes():
    """Each column step is exact; after enough iterations the rows balance too."""
    targets = sinkhorn_knopp(logits(16, 8, scale=1.0), 0.5, iterations=50)
    torch.testing.assert_close(targets.sum(0), torch.full((8,), 2.0, dtype=torch.float64))
    torch.testing.assert_close(targets.sum(1), torch.ones(16, dtype=torch.float64))


@settings(max_examples=25, deadline=None)
@given(shift=st.floats(-1e3, 1e3), seed=st.integers(0, 2**16))
def test_sinkhorn_knopp_ignores_a_constant_and_stays_finite(shift, seed):
    scores = logits(12, 16, seed=seed, scale=1.0)
    # exp(1000 / 0.05) overflows even in float64 without the subtracted maximum; the tolerance
    # is the rounding of scores + shift (1e-13 at 1000) amplified by 1 / 0.05
    shifted = sinkhorn_knopp(scores + shift, 0.05)
    assert torch.isfinite(shifted).all()
    torch.testing.assert_close(shifted, sinkhorn_knopp(scores, 0.05), rtol=1e-9, atol=1e-12)


def test_softmax_center_is_centered_sharpened_softmax():
    teacher, center = logits(4, K, grad=True), logits(1, K, seed=5)
    probs = softmax_center(teacher, center, 0.04)
    torch.testing.assert_close(probs, torch.softmax((teacher.detach() - center) / 0.04, -1))
    assert not probs.requires_grad  # targets never reach the teacher


def test_center_follows_its_exponential_moving_average():
    center = Center(K, momentum=0.9)
    expected = torch.zeros(1, K)
    for step in range(3):
        batch = logits(2, 5, K, seed=step, dtype=torch.float32)  # any [..., K]
        center.update(batch)
        expected = 0.9 * expected + 0.1 * batch.reshape(-1, K).mean(0, keepdim=True)
        torch.testing.assert_close(center.center, expected, rtol=1e-6, atol=1e-6)
    center.update(torch.zeros(0, K))  # no rows: no change, no NaN
    torch.testing.assert_close(center.center, expected, rtol=1e-6, atol=1e-6)
    assert [name for name, _ in center.named_buffers()] == ["center"]
    with pytest.raises(ValueError, match="momentum"):
        Center(K, momentum=1.5)


def _two_ranks(rank, path, port):
    """One of two gloo ranks: uneven shares of one batch, both made global by all-reduce."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    scores = logits(7, K, scale=1.0)
    result = {}
    # 3 and 4 rows: uneven on purpose; then none on rank 0 (a batch without masked tokens)
    for split, rows in [("uneven", [slice(0, 3), slice(3, 7)]), ("empty", [slice(0, 0),
                                                                           slice(0, 7)])]:
        center = Center(K)
        center.update(scores[rows[rank]])
        result[split] = dict(targets=sinkhorn_knopp(scores[rows[rank]], 0.05),
                             center=center.center,
                             local=sinkhorn_knopp(scores[rows[rank]], 0.05, distributed=False))
    torch.save(result, f"{path}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow  # two processes and a rendezvous
def test_sinkhorn_and_center_over_two_ranks_equal_one_process(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_ranks, args=(str(tmp_path), port), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    scores = logits(7, K, scale=1.0)
    single = Center(K)
    single.update(scores)
    for split in ("uneven", "empty"):
        torch.testing.assert_close(torch.cat([r[split]["targets"] for r in ranks]),
                                   sinkhorn_knopp(scores, 0.05), rtol=1e-12, atol=1e-12)
        for r in ranks:
            torch.testing.assert_close(r[split]["center"], single.center, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ranks[0]["uneven"]["local"], sinkhorn_knopp(scores[:3], 0.05))
    assert ranks[0]["empty"]["local"].shape == (0, K)
