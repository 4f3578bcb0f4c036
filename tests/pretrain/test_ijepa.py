"""The ijepa objective (I-JEPA): its masks are the official collator's (lightly's copy of it),
its predictor and its loss and gradients equal lightly's predictor and the official loss on
the same weights and masks, packed images equal their own stacked calls, the masks stay
inside their images, and the EMA follows its formula."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.pretrain.ijepa import JointEmbeddingPredictive, linear
from vlm_vit.pretrain.jepa_predictor import lightly_state_dict
from vlm_vit.pretrain.multiblock_masking import (
    BlockMasks,
    batch_masks,
    block_size,
    common_length,
)

TINY = dict(image_size=64, patch_size=8, width=32, depth=2, heads=4, mlp_width=64)
PREDICTOR = dict(predictor_width=32, predictor_depth=2, min_keep=2)


def objective(dtype=torch.float32, seed=0, **options) -> JointEmbeddingPredictive:
    torch.manual_seed(seed)
    made = JointEmbeddingPredictive(VisionEncoder(EncoderConfig(**TINY)),
                                    **{**PREDICTOR, **options})
    with torch.no_grad():  # context and target encoders apart, as after some training
        for parameter in made.student.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    return made.to(dtype)


def lightly_collator(size, patch, **options):
    lightly_data = pytest.importorskip("lightly.data")
    return lightly_data.IJEPAMaskCollator(
        input_size=size, patch_size=patch, enc_mask_scale=(0.85, 1.0),
        pred_mask_scale=(0.15, 0.2), aspect_ratio=(0.75, 1.5), nenc=1, npred=4,
        min_keep=10, **options)


# -- masks ----------------------------------------------------------------------------------


def test_block_sizes_are_the_official_collators():
    collator = lightly_collator(224, 16)
    for seed in range(200):
        for scale, aspect in (((0.15, 0.2), (0.75, 1.5)), ((0.85, 1.0), (1.0, 1.0)),
                              ((0.2, 0.8), (0.3, 3.0))):
            theirs = collator._sample_block_size(torch.Generator().manual_seed(seed), scale,
                                                 aspect)
            draw = float(torch.rand(1, generator=torch.Generator().manual_seed(seed)))
            assert block_size(draw, (14, 14), scale, aspect) == theirs


def test_a_batch_of_masks_equals_the_official_collators_draw_for_draw():
    """lightly's `IJEPAMaskCollator` is the official collator line for line: its sizes come
    from a generator seeded by its batch counter, its positions from the global RNG. Seeded
    alike, ours gives the same context and target indices, cut to the same lengths."""
    collator = lightly_collator(224, 16)
    images = [torch.zeros(1) for _ in range(6)]
    for batch in range(40):
        torch.manual_seed(1000 + batch)
        _, enc, pred = collator(images)  # its counter: seed `batch`
        ours = common_length(batch_masks(
            [(14, 14)] * 6, torch.Generator().manual_seed(1000 + batch),
            size_generator=torch.Generator().manual_seed(batch)))
        assert torch.equal(torch.stack([m.context for m in ours]), enc[0])
        for j in range(4):
            assert torch.equal(torch.stack([m.targets[j] for m in ours]), pred[j])


@settings(max_examples=30, deadline=None, phases=[Phase.generate])
@given(grids=st.lists(st.tuples(st.integers(4, 20), st.integers(4, 20)), min_size=1,
                      max_size=5), seed=st.integers(0, 2**31))
def test_masks_stay_inside_each_image(grids, seed):
    masks = batch_masks(grids, torch.Generator().manual_seed(seed), min_keep=0)
    for (rows, cols), mask in zip(grids, masks, strict=True):
        assert len(mask.targets) == 4 and len(mask.context) > 0
        for index in [mask.context, *mask.targets]:
            assert index.dtype == torch.int64 and int(index.min()) >= 0
            assert int(index.max()) < rows * cols
            assert torch.equal(index, index.unique())  # ascending, no repeats


def test_the_context_leaves_out_every_target_block():
    """At I-JEPA's settings the context never needed to drop a constraint in 200 images."""
    masks = batch_masks([(14, 14)] * 200, torch.Generator().manual_seed(0))
    for mask in masks:
        assert not torch.isin(mask.context, torch.cat(mask.targets)).any()
        assert len(mask.context) > 10 and all(len(t) > 10 for t in mask.targets)


def test_a_grid_too_small_for_its_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match="min_keep=10"):
        batch_masks([(4, 4)], torch.Generator().manual_seed(0))


# -- predictor and loss against lightly -----------------------------------------------------


def lightly_predictor(made: JointEmbeddingPredictive, grid):
    """lightly's `IJEPAPredictorTIMM` holding our predictor's weights."""
    modules = pytest.importorskip("lightly.models.modules")
    ours = made.predictor
    theirs = modules.IJEPAPredictorTIMM(
        num_patches=grid[0] * grid[1], depth=len(ours.blocks), mlp_dim=ours.embed.in_features,
        predictor_embed_dim=ours.width, num_heads=ours.blocks[0].attn.heads)
    state = lightly_state_dict(ours)
    # lightly's sin-cos table, made in float32, is ours; ours is made in float64 and goes in,
    # so that float64 compares the rest to 1e-12.
    table = ours.positions(grid, torch.zeros((), dtype=torch.float64))
    torch.testing.assert_close(theirs.decoder.pos_embed[0].double(), table, rtol=0, atol=1e-7)
    state["decoder.pos_embed"] = table[None]
    theirs = theirs.to(next(ours.parameters()).dtype)
    theirs.load_state_dict(state)
    return theirs


def fixed_masks(grid, images, seed=3):
    return common_length(batch_masks([grid] * images, torch.Generator().manual_seed(seed),
                                      min_keep=2))


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_loss_and_gradients_equal_lightlys_predictor_and_the_official_loss(dtype, tolerance):
    """The official step (the lightly example's): target features layer-normed, gathered by
    `apply_masks`, repeated by `repeat_interleave_batch`; the context encoder's kept tokens
    through lightly's predictor; `SmoothL1Loss`. lightly's own `IJEPABackbone` is not the
    reference: its class token shifts every index by one."""
    utils = pytest.importorskip("lightly.models.utils")
    grid, images = (8, 8), 3
    made, masks = objective(dtype), fixed_masks(grid, 3)
    pixels = torch.randn(images, 3, 64, 64, generator=torch.Generator().manual_seed(2),
                         dtype=dtype)
    out = made(pixels, masks=masks)
    out.loss.backward()
    ours = {n: p.grad.clone() for n, p in made.named_parameters() if p.grad is not None}

    reference = lightly_predictor(made, grid)
    made.zero_grad(set_to_none=True)
    enc = [torch.stack([m.context for m in masks])]
    pred = [torch.stack([m.targets[j] for m in masks]) for j in range(4)]
    with torch.no_grad():
        h = made.encoder(pixels).patch_tokens
        h = F.layer_norm(h, (h.size(-1),))
        h = utils.repeat_interleave_batch(utils.apply_masks(h, pred), images, repeat=1)
    x = made.student(pixels, keep=enc[0]).patch_tokens
    z = reference(x, enc, pred)
    loss = torch.nn.SmoothL1Loss()(z, h)
    loss.backward()
    torch.testing.assert_close(out.loss, loss, rtol=0, atol=tolerance)
    names = {"predictor.embed.": "predictor_embed.", "predictor.proj.": "predictor_proj.",
             "predictor.": "decoder."}
    for name, grad in ours.items():
        if name.startswith("student."):
            expected = dict(made.named_parameters())[name].grad
        else:
            key = next(new + name[len(old):] for old, new in names.items()
                       if name.startswith(old))
            expected = dict(reference.named_parameters())[key].grad
            if name == "predictor.mask_token":
                expected = expected.reshape(-1)
        scale = max(1.0, expected.abs().max().item())
        torch.testing.assert_close(grad, expected, rtol=0, atol=tolerance * scale, msg=name)
    assert any(n.startswith("student.") for n in ours)
    assert not any(n.startswith("encoder.") for n in ours)  # the target gets no gradient


# -- packed ---------------------------------------------------------------------------------


def per_image(made, images, masks):
    """Each image alone as a stacked batch of one: the loss over every predicted feature,
    summed, and the element count."""
    total, count = 0.0, 0
    for image, mask in zip(images, masks, strict=True):
        patch = made.student.config.patch_size
        grid = (image.shape[-2] // patch, image.shape[-1] // patch)
        prediction, target = made.predict_stacked(image[None], [mask], grid)
        total = total + F.smooth_l1_loss(prediction, target, reduction="sum")
        count += target.numel()
    return total / count


@settings(max_examples=8, deadline=None, phases=[Phase.generate])
@given(sizes=st.lists(st.tuples(st.integers(5, 9), st.integers(5, 9)), min_size=1,
                      max_size=4), seed=st.integers(0, 2**31))
def test_packed_images_equal_their_own_stacked_calls(sizes, seed):
    made = objective(torch.float64)
    generator = torch.Generator().manual_seed(seed)
    images = [torch.randn(3, 8 * h, 8 * w, generator=generator, dtype=torch.float64)
              for h, w in sizes]
    masks = batch_masks(list(sizes), generator, min_keep=2)
    packed = made(images, masks=masks).loss
    packed.backward()
    grads = {n: p.grad.clone() for n, p in made.named_parameters() if p.grad is not None}
    made.zero_grad(set_to_none=True)
    alone = per_image(made, images, masks)
    alone.backward()
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-10)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, dict(made.named_parameters())[name].grad, rtol=0,
                                   atol=1e-10, msg=name)


def test_a_stacked_batch_packed_equals_it_stacked_when_its_masks_share_lengths():
    made = objective(torch.float64)
    pixels = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(4),
                         dtype=torch.float64)
    masks = fixed_masks((8, 8), 3)  # cut to common lengths
    stacked = made(pixels, masks=masks).loss
    made.packed = True
    torch.testing.assert_close(made(pixels, masks=masks).loss, stacked, rtol=0, atol=1e-12)


# -- EMA and options ------------------------------------------------------------------------


def test_the_ema_follows_its_linear_momentum_and_the_target_is_the_exported_encoder():
    made = objective()
    before = {n: p.detach().clone() for n, p in made.encoder.named_parameters()}
    student = {n: p.detach().clone() for n, p in made.student.named_parameters()}
    made.after_optimizer_step(25, 100)
    momentum = 0.996 + 0.004 * 25 / 100
    assert linear(0.996, 1.0, 25, 100) == pytest.approx(momentum)
    assert linear(0.996, 1.0, 100, 100) == pytest.approx(1.0)
    for name, value in made.encoder.named_parameters():
        expected = momentum * before[name] + (1 - momentum) * student[name]
        torch.testing.assert_close(value.detach(), expected, rtol=1e-6, atol=1e-7, msg=name)
    assert not any(p.requires_grad for p in made.encoder.parameters())
    made.train()
    assert not made.encoder.training and made.student.training


def test_the_weight_decay_rises_along_its_cosine():
    made = objective()
    optimizer = torch.optim.AdamW([{"params": list(made.student.parameters()),
                                    "weight_decay": 0.04},
                                   {"params": list(made.predictor.parameters()),
                                    "weight_decay": 0.0}])
    made.after_optimizer_step(49, 100, optimizer)
    assert optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.22)
    assert optimizer.param_groups[1]["weight_decay"] == 0.0


@pytest.mark.parametrize("options,message", [
    (dict(target_scale=(0.3, 0.2)), "target_scale"),
    (dict(context_scale=(0.0, 1.0)), "context_scale"),
    (dict(aspect_ratio=(2.0, 1.0)), "aspect_ratio"),
    (dict(targets=0), "target block"),
    (dict(predictor_width=30), "divisible"),
])
def test_a_bad_option_is_one_clear_error(options, message):
    with pytest.raises(ValueError, match=message):
        objective(**options)


def test_an_encoder_with_rope_is_refused():
    encoder = VisionEncoder(EncoderConfig(**{**TINY, "pos_embed": "none", "rope_theta": 100.0}))
    with pytest.raises(ValueError, match="RoPE"):
        JointEmbeddingPredictive(encoder, **PREDICTOR)


def test_masks_given_must_be_one_per_image():
    made = objective()
    with pytest.raises(ValueError, match="2 masks for 3 images"):
        made(torch.randn(3, 3, 64, 64), masks=fixed_masks((8, 8), 2))
    assert isinstance(fixed_masks((8, 8), 2)[0], BlockMasks)
