"""The ibot objective (DINOv2's masked self-distillation): packed native-resolution views equal
per-view calls, masks stay inside their images, the EMA teacher and the schedules follow
their formulas, and the trainer runs it (the teacher is what it exports)."""

import math

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.pretrain.ibot import MaskedSelfDistillation
from vlm_vit.pretrain.schedules import cosine, warmup

pytest.importorskip("torchvision")

TINY = dict(image_size=32, patch_size=8, width=32, depth=2, heads=2, mlp_width=64)
HEAD = dict(prototypes=64, head_hidden=32, head_bottleneck=16)


class Batch:
    """What `collate_views` hands the objective: columns of views by crop index."""

    def __init__(self, global_views, local_views):
        self.global_views, self.local_views = global_views, local_views


def objective(dtype=torch.float32, seed=0, **options) -> MaskedSelfDistillation:
    torch.manual_seed(seed)
    made = MaskedSelfDistillation(VisionEncoder(EncoderConfig(**TINY)), **HEAD, **options)
    with torch.no_grad():  # teacher and student apart, as after some training
        for parameter in made.student.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    return made.to(dtype)


def views(global_sizes, local_sizes, images=3, dtype=torch.float32, seed=1) -> Batch:
    """Per crop index, one size for every image (a column), or per image a size (a list)."""
    generator = torch.Generator().manual_seed(seed)

    def column(size):
        sizes = size if isinstance(size, list) else [size] * images
        return [torch.randn(3, h, w, generator=generator, dtype=dtype) for h, w in sizes]
    return Batch([column(s) for s in global_sizes], [column(s) for s in local_sizes])


def loss_and_gradients(made, batch, seed=5):
    made.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same masks for every call
    out = made(batch)
    out.loss.backward()
    return out.loss.detach(), {name: p.grad.clone() for name, p in made.named_parameters()
                               if p.grad is not None}


def assert_near(actual, expected, tolerance, name):
    """Within `tolerance` of the larger of 1 and `expected`'s largest entry (gradients reach
    ~2000 in the head's last bias here; an absolute 1e-5 would ask float32 for 5e-9)."""
    scale = max(1.0, expected.abs().max().item())
    difference = (actual - expected).abs().max().item()
    assert difference <= tolerance * scale, f"{name}: {difference:.3g} apart at scale {scale:.3g}"


SIDES = st.sampled_from([8, 16, 24, 32, 40])


@settings(max_examples=8, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(st.lists(st.tuples(SIDES, SIDES), min_size=6, max_size=6),
       st.lists(st.tuples(SIDES, SIDES), min_size=6, max_size=6))
def test_packed_views_give_the_loss_and_gradients_of_per_view_calls(global_sizes, local_sizes):
    """Native resolution: every crop its own size, masked on its own grid; one packed call
    per network equals batched calls per view size, in float64 within 1e-10."""
    per_image = [global_sizes[:3], global_sizes[3:]]  # 2 global crops of 3 images
    batch = views(per_image, [local_sizes[:3], local_sizes[3:]], dtype=torch.float64)
    made = objective(torch.float64, mask_ratio=(0.3, 0.6), mask_probability=1.0,
                     centering="softmax")
    made.packed = True
    packed_loss, packed = loss_and_gradients(made, batch)
    made.packed = False
    made.dino_center.center.zero_(), made.ibot_center.center.zero_()
    loss, grads = loss_and_gradients(made, batch)
    torch.testing.assert_close(packed_loss, loss, rtol=0, atol=1e-10)
    assert packed.keys() == grads.keys() and "mask_token" in grads
    for name in grads:
        # The position table is resized in float32 whatever its dtype (`resample_pos_embed`),
        # so its gradient, summed per image or per batch, agrees to float32's precision
        # (measured: up to 1.1e-8 of its largest entry).
        assert_near(packed[name], grads[name], 1e-6 if name == "student.pos_embed" else 1e-10,
                    name)


def test_packed_equals_per_view_in_float32_with_sinkhorn_centering():
    batch = views([[(16, 24), (32, 16), (24, 24)], [(24, 16), (16, 16), (40, 8)]],
                  [[(8, 16), (16, 8), (8, 8)]] * 2)
    made = objective(mask_probability=1.0)
    made.packed = True
    packed_loss, packed = loss_and_gradients(made, batch)
    made.packed = False
    loss, grads = loss_and_gradients(made, batch)
    assert_near(packed_loss, loss, 1e-5, "loss")
    for name in grads:  # measured: up to 1.2e-7 of each tensor's largest entry
        assert_near(packed[name], grads[name], 1e-5, name)


def test_each_mask_lies_on_its_own_crop_s_grid_and_half_the_images_are_masked():
    made = objective()
    grids = [(2, 3), (4, 1), (3, 3), (1, 5)] * 2
    torch.manual_seed(0)
    masks = made.draw_masks(grids, torch.device("cpu"))
    assert [tuple(mask.shape) for mask in masks] == grids
    assert sum(bool(mask.any()) for mask in masks) <= len(grids) // 2


def test_the_mask_token_is_what_masked_patches_become(monkeypatch):
    """A masked crop's student tokens change with the mask token; the teacher never sees
    it (its targets do not depend on it)."""
    batch = views([(16, 16), (16, 16)], [(8, 8)])
    made = objective(mask_probability=1.0, mask_ratio=(0.4, 0.5))
    torch.manual_seed(3)
    first = made(batch).metrics
    with torch.no_grad():
        made.mask_token.add_(1.0)
    torch.manual_seed(3)
    second = made(batch).metrics
    assert first["masked"] == second["masked"] > 0
    assert first["ibot"] != second["ibot"]


def test_the_ema_follows_its_cosine_and_the_teacher_is_the_exported_encoder():
    made = objective(steps=10)
    teacher = {n: p.clone() for n, p in made.encoder.named_parameters()}
    student = dict(made.student.named_parameters())
    made.after_optimizer_step(3, 10)
    momentum = 1.0 - (1.0 - 0.992) * (math.cos(math.pi * 3 / 10) + 1) / 2
    for name, value in made.encoder.named_parameters():
        torch.testing.assert_close(value, momentum * teacher[name]
                                   + (1 - momentum) * student[name], rtol=0, atol=1e-6)
    head = dict(made.head.named_parameters())
    for name, value in made.teacher_head.named_parameters():
        assert not value.requires_grad and name in head
    assert not any(p.requires_grad for p in made.encoder.parameters())
    assert int(made.steps_done) == 4


def test_the_teacher_stays_in_eval_mode_while_the_student_trains():
    made = objective().train()
    assert made.student.training and made.head.training
    assert not made.encoder.training and not made.teacher_head.training
    assert not any(module.training for module in made.encoder.modules())


def test_schedules_follow_dinov2_s_formulas():
    assert cosine(0.992, 1.0, 0, 100) == pytest.approx(0.992)
    assert cosine(0.992, 1.0, 100, 100) == pytest.approx(1.0)
    assert cosine(0.04, 0.4, 50, 100) == pytest.approx(0.22)
    made = objective(steps=100)  # the temperature warms up over 30 steps, 0.04 to 0.07
    assert made.teacher_temperature() == pytest.approx(0.04)
    made.steps_done.fill_(29 // 2)
    assert made.teacher_temperature() == pytest.approx(warmup(0.04, 0.07, 14, 30))
    assert warmup(0.04, 0.07, 29, 30) == pytest.approx(0.07)
    made.steps_done.fill_(60)
    assert made.teacher_temperature() == pytest.approx(0.07)
    parameters = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.AdamW([{"params": parameters[:1], "weight_decay": 0.04},
                                   {"params": parameters[1:], "weight_decay": 0.0}])
    made.after_optimizer_step(49, 100, optimizer)
    assert optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.22)
    assert optimizer.param_groups[1]["weight_decay"] == 0.0


def test_the_prototypes_get_no_gradient_for_the_first_hundredth_of_the_steps():
    """DINOv2's freeze_last_layer: the head's last layer is fixed for 1 epoch of 100."""
    made, batch = objective(steps=300), views([(16, 16), (16, 16)], [(8, 8)])
    last = {name for name, _ in made.named_parameters() if name.startswith("head.last_layer")}
    for done, frozen in ((0, True), (2, True), (3, False)):
        made.steps_done.fill_(done)
        _, gradients = loss_and_gradients(made, batch)
        assert last <= set(gradients)  # in the graph (DDP), zero while frozen
        assert all(bool(gradients[name].eq(0).all()) == frozen for name in last), done
        assert gradients["head.mlp.0.weight"].abs().sum() > 0
    made.steps_done.fill_(0)
    assert not objective(steps=300, freeze_prototypes=0.0).prototypes_frozen()


@pytest.mark.parametrize(("options", "message"), [
    (dict(mask_ratio=(0.1, 1.5)), r"mask ratio must lie in \[0, 1\)"),
    (dict(mask_ratio=(0.5, 0.1)), "min <= max"),
    (dict(mask_probability=2.0), "mask probability"),
    (dict(centering="median"), "centering must be one of"),
    (dict(freeze_prototypes=2.0), "freeze_prototypes is a fraction"),
])
def test_bad_settings_are_one_line(options, message):
    with pytest.raises(ValueError, match=message):
        objective(**options)


def test_one_global_crop_is_refused():
    with pytest.raises(ValueError, match="two global crops"):
        objective()(views([(16, 16)], [(8, 8)]))


def test_an_encoder_without_a_class_token_is_refused():
    with pytest.raises(ValueError, match="class token"):
        MaskedSelfDistillation(VisionEncoder(EncoderConfig(**TINY, class_token=False)), **HEAD)
