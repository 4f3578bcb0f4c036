"""Packed encoding of differently sized images (vlm_vit.packing) against each image alone."""

import pytest
import torch
import torch.nn.functional as F

from vlm_vit import VisionEncoder
from vlm_vit.layers import Segments, varlen_attention
from vlm_vit.packing import PackedOutput, encode_packed

from .conftest import tiny_config

STYLES = {
    "clip": dict(pre_norm=True, act="quick_gelu", norm_eps=1e-5, patch_bias=False),
    "paper": dict(),
    "registers": dict(num_register_tokens=4),
    "siglip": dict(class_token=False, act="gelu_tanh"),
}
# square, tall, wide, 1 x N and N x 1, and one grid equal to the native one (no resize)
SIZES = [(24, 24), (40, 16), (16, 48), (8, 56), (32, 8), (32, 32)]
ATOL = 1e-5


def encoder_for(style: str, seed: int = 0) -> VisionEncoder:
    torch.manual_seed(seed)
    encoder = VisionEncoder(tiny_config(**STYLES[style])).eval()
    with torch.no_grad():  # make the class / register tokens and biases matter
        for parameter in encoder.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    encoder._pos_cache.clear()
    return encoder


def photos(sizes=SIZES, seed=1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h, w, generator=generator) for h, w in sizes]


def assert_close(a, b):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("maps", [False, True], ids=["sdpa", "explicit-maps"])
def test_each_image_equals_itself_alone_at_every_layer(style, maps):
    encoder = encoder_for(style)
    images = photos()
    with torch.no_grad():
        packed = encoder(images, output_hidden_states=True, output_attentions=maps,
                         feature_layers=[1, -1])
        assert isinstance(packed, PackedOutput)
        parts = packed.split()
        assert len(parts) == len(images) == len(packed)
        for image, part in zip(images, parts, strict=True):
            alone = encoder(image[None], output_hidden_states=True, output_attentions=maps,
                            feature_layers=[1, -1])
            assert part.grid == alone.grid and part.num_prefix_tokens == alone.num_prefix_tokens
            assert_close(part.tokens, alone.tokens)
            assert_close(part.patch_tokens, alone.patch_tokens)
            if alone.cls_token is None:
                assert part.cls_token is None
            else:
                assert_close(part.cls_token, alone.cls_token)
            for name in ("hidden_states", "features", "attentions")[:3 if maps else 2]:
                ours, theirs = getattr(part, name), getattr(alone, name)
                assert len(ours) == len(theirs)
                for a, b in zip(ours, theirs, strict=True):
                    assert_close(a, b)


def test_the_packed_layout():
    encoder = encoder_for("registers")
    images = photos()
    with torch.no_grad():
        packed = encoder(images)
    prefix = 1 + 4
    lengths = [prefix + (h // 8) * (w // 8) for h, w in SIZES]
    assert packed.lengths == tuple(lengths)
    assert packed.grids == tuple((h // 8, w // 8) for h, w in SIZES)
    assert packed.tokens.shape == (sum(lengths), 32)
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    mask = packed.patch_mask()
    assert mask.sum() == sum(lengths) - prefix * len(images)
    assert not mask[:prefix].any() and mask[prefix:lengths[0]].all()


def test_features_alone_stop_the_run_after_the_deepest_layer():
    encoder = encoder_for("clip")
    ran = []
    for index, block in enumerate(encoder.blocks):
        block.register_forward_hook(lambda *_, index=index: ran.append(index))
    with torch.no_grad():
        packed = encoder(photos(), feature_layers=[1])
        alone = encoder(photos()[2][None], feature_layers=[1])
    assert ran == [0, 0]  # one call each, packed and alone: block 1 of 3 only
    assert packed.tokens is None and packed.features[0].shape[0] == sum(packed.lengths)
    assert_close(packed.split()[2].features[0], alone.features[0])


@pytest.mark.parametrize("sizes", [SIZES, [(24, 24), (16, 48), (24, 24), (48, 16), (24, 24)]],
                         ids=["distinct-lengths", "repeated-lengths"])
def test_no_token_attends_across_images(sizes):
    """Bit for bit, also between images of one length (one batched attention call)."""
    encoder = encoder_for("paper")
    images = photos(sizes)
    changed = [image.clone() for image in images]
    changed[1] = torch.randn_like(changed[1]) * 10
    with torch.no_grad():
        before, after = encoder(images).split(), encoder(changed).split()
        alone = [encoder(image[None]) for image in images]
    for index in set(range(len(images))) - {1}:
        assert torch.equal(before[index].tokens, after[index].tokens)
        assert_close(before[index].tokens, alone[index].tokens)
    assert not torch.allclose(before[1].tokens, after[1].tokens)


def test_each_image_gets_its_own_cached_position_table():
    encoder = encoder_for("paper")
    with torch.no_grad():
        encoder(photos())
    grids = {key[0] for key in encoder._pos_cache}
    assert grids == {(h // 8, w // 8) for h, w in SIZES} - {encoder.config.grid}


def test_the_full_mask_is_never_built(monkeypatch):
    encoder = encoder_for("paper")
    seen = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        seen.append((q.shape[-2], kwargs.get("attn_mask", args[0] if args else None)))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        packed = encoder(photos())
    assert len(seen) == len(SIZES) * encoder.config.depth
    assert max(length for length, _ in seen) == max(packed.lengths)
    assert all(mask is None for _, mask in seen)


def test_the_nested_tensor_backend_agrees():
    encoder = encoder_for("clip")
    images = photos()
    segments_out = encode_packed(encoder, images, backend="segments")
    nested_out = encode_packed(encoder, images, backend="nested")
    assert_close(nested_out.tokens, segments_out.tokens)
    nested_out.tokens.square().mean().backward()  # it also trains
    assert encoder.blocks[0].attn.qkv.weight.grad is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention varlen needs CUDA")
def test_flash_attention_varlen_agrees_on_cuda():
    pytest.importorskip("flash_attn")
    encoder = encoder_for("clip").cuda().to(torch.bfloat16)
    images = [image.cuda() for image in photos()]
    with torch.no_grad():
        flash = encode_packed(encoder, images, backend="flash").tokens.float()
        reference = encode_packed(encoder, images, backend="segments").tokens.float()
    torch.testing.assert_close(flash, reference, atol=3e-2, rtol=3e-2)


def test_auto_backend_is_per_image_sdpa_on_a_cpu():
    q = torch.zeros(5, 2, 4)
    assert Segments((2, 3)).resolve(q) == "segments"
    assert Segments((2, 3), backend="nested").resolve(q) == "nested"
    with pytest.raises(ValueError, match="backend 'fast' is not one of"):
        Segments((2, 3), backend="fast")


@pytest.mark.parametrize("lengths", [(4, 2, 3), (3, 2, 3, 3, 1, 2)],
                         ids=["distinct", "repeated-lengths"])
def test_varlen_attention_is_block_diagonal_attention(lengths):
    """Images of one length run as one batched call: still each alone, forward and backward."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 2, 4, generator=generator, requires_grad=True)
               for _ in range(3))
    document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = document[:, None] == document[None, :]  # the mask the backends never build
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                              v.transpose(0, 1), attn_mask=allowed)
    weights = torch.randn(expected.transpose(0, 1).shape, generator=generator)
    reference = torch.autograd.grad((expected.transpose(0, 1) * weights).sum(), (q, k, v))
    for backend in ("segments", "nested"):
        out, _ = varlen_attention(q, k, v, Segments(lengths, backend=backend))
        assert_close(out, expected.transpose(0, 1))
        for ours, theirs in zip(torch.autograd.grad((out * weights).sum(), (q, k, v)),
                                reference, strict=True):
            assert_close(ours, theirs)
    out, maps = varlen_attention(q, k, v, Segments(lengths), need_weights=True)
    assert_close(out, expected.transpose(0, 1))
    assert [tuple(m.shape) for m in maps] == [(2, n, n) for n in lengths]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gradients_equal_the_per_image_computation(checkpointing):
    images = photos()
    targets = [torch.randn(1, 1 + (h // 8) * (w // 8), 32,
                           generator=torch.Generator().manual_seed(i))
               for i, (h, w) in enumerate(SIZES)]

    def loss(out, index):
        return (out - targets[index]).square().mean()

    packed_encoder, alone_encoder = encoder_for("clip").train(), encoder_for("clip").train()
    packed_encoder.gradient_checkpointing = checkpointing
    parts = packed_encoder(images).split()
    sum(loss(part.tokens, i) for i, part in enumerate(parts)).backward()
    sum(loss(alone_encoder(image[None]).tokens, i) for i, image in enumerate(images)).backward()
    named = dict(alone_encoder.named_parameters())
    for name, parameter in packed_encoder.named_parameters():
        assert parameter.grad is not None, name
        assert_close(parameter.grad, named[name].grad)


@pytest.mark.parametrize("images, message", [
    ([], "non-empty list"),
    ([torch.zeros(3, 16, 16), torch.zeros(1, 16, 16)], r"image 1 has 1 channels \(\[1, 16, 16\]\)"),
    ([torch.zeros(3, 16, 16), torch.zeros(3, 16, 20)], "image 1 is 16x20: each side must be"),
    ([torch.zeros(3, 16, 16), torch.zeros(3, 0, 16)], "image 1 is 0x16"),
    ([torch.zeros(1, 3, 16, 16)], r"image 0 must be a \[C, H, W\] tensor, got \[1, 3, 16, 16\]"),
])
def test_bad_lists_are_refused_naming_the_image(images, message):
    with pytest.raises(ValueError, match=message):
        encoder_for("paper")(images)


def test_budgets_and_grid_limits_are_enforced_by_name():
    encoder = encoder_for("paper")
    images = photos([(16, 16), (64, 16)])  # 1 + 4 and 1 + 16 tokens
    with pytest.raises(ValueError, match="make 22 tokens, over the budget of 21"):
        encode_packed(encoder, images, max_tokens=21)
    assert encode_packed(encoder, images, max_tokens=22).tokens.shape[0] == 22
    with pytest.raises(ValueError, match="image 1 is 64x16, a 8x2 grid, over the maximum grid 6x6"):
        encode_packed(encoder, images, max_grid=(6, 6))


def test_masking_needs_a_fixed_size_batch():
    encoder = encoder_for("paper")
    with pytest.raises(ValueError, match="not a list of images"):
        encoder(photos(), keep=torch.zeros(1, 2, dtype=torch.long))


def test_forward_packed_is_what_a_list_gives_and_takes_the_packing_options():
    encoder = encoder_for("paper")
    images = photos(SIZES[:3])
    with torch.no_grad():
        through_forward = encoder(images, feature_layers=[-2])
        named = encoder.forward_packed(images, feature_layers=[-2])
        direct = encode_packed(encoder, images, feature_layers=[-2])
    assert isinstance(named, PackedOutput)
    assert named.lengths == through_forward.lengths == direct.lengths
    for a, b, c in zip(named.features, through_forward.features, direct.features, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(ValueError, match="budget of 10"):
        encoder.forward_packed(images, max_tokens=10)
    with pytest.raises(ValueError, match="maximum grid 2x2"):
        encoder.forward_packed(images, max_grid=(2, 2))


def test_packing_needs_only_what_its_protocol_names():
    import ast
    import inspect
    import typing

    from vlm_vit import packing

    hints = typing.get_type_hints(packing.encode_packed)
    assert hints["encoder"] is packing.PackableEncoder  # typed against the protocol, not model
    imported = {node.module for node in ast.walk(ast.parse(inspect.getsource(packing)))
                if isinstance(node, ast.ImportFrom)}
    assert "vlm_vit.model" not in imported  # the model imports packing, never the reverse


# -- masks (native-resolution masked pretraining, issue 42) ----------------------------------


def test_each_image_s_mask_equals_that_image_masked_alone():
    """Every image masked over its own grid (one unmasked): each packed image's tokens equal
    that image encoded alone with its mask, so a mask never reaches another image."""
    encoder = encoder_for("registers")
    images = photos()
    generator = torch.Generator().manual_seed(3)
    masks = [torch.rand(image.shape[1] // 8, image.shape[2] // 8, generator=generator) < 0.4
             for image in images]
    masks[2] = None
    token = torch.randn(encoder.config.width, generator=generator)
    with torch.no_grad():
        packed = encoder.forward_packed(images, masks=masks, mask_token=token)
        for out, image, mask in zip(packed.split(), images, masks, strict=True):
            options = {} if mask is None else {"mask": mask.reshape(1, -1), "mask_token": token}
            alone = encoder(image[None], **options).tokens[0]
            assert_close(out.tokens[0], alone)
            if mask is not None and mask.any():  # the mask changed this image's tokens
                assert not torch.allclose(alone, encoder(image[None]).tokens[0], atol=1e-3)


@pytest.mark.parametrize(("masks", "message"), [
    ([None], "1 masks for 2 images"),
    ([torch.zeros(2, 2, dtype=torch.bool), None], r"mask 0 .* 3x3 grid, got \[2, 2\]"),
    ([None, torch.zeros(6, dtype=torch.long)], "mask 1 must be a bool tensor"),
])
def test_masks_that_do_not_fit_their_images_are_refused_naming_the_image(masks, message):
    encoder = encoder_for("paper")
    with pytest.raises(ValueError, match=message):
        encoder.forward_packed(photos([(24, 24), (16, 24)]), masks=masks,
                               mask_token=torch.zeros(encoder.config.width))


# -- keeps (I-JEPA's context encoder at native resolution, issue 43) ------------------------


def test_each_image_s_kept_patches_equal_that_image_keeping_them_alone():
    """Each packed image keeps its own patches (one keeps all): its tokens equal that image
    encoded alone with `keep`, the dropped patches never entering the sequence."""
    encoder = encoder_for("registers")
    images = photos()
    generator = torch.Generator().manual_seed(4)
    keeps = [torch.randperm(image.shape[1] // 8 * (image.shape[2] // 8),
                            generator=generator)[:5].sort().values for image in images]
    keeps[1] = None
    with torch.no_grad():
        packed = encoder.forward_packed(images, keeps=keeps)
        for out, image, keep in zip(packed.split(), images, keeps, strict=True):
            options = {} if keep is None else {"keep": keep[None]}
            alone = encoder(image[None], **options).tokens[0]
            assert_close(out.tokens[0], alone)
            assert out.patch_tokens.shape[1] == (len(keep) if keep is not None
                                                 else image.shape[1] * image.shape[2] // 64)


@pytest.mark.parametrize(("keeps", "message"), [
    ([None], "1 keeps for 2 images"),
    ([torch.tensor([0, 9]), None], r"keep 0 .* in \[0, 9\) \(its 3x3 grid\), got \[2\]"),
    ([None, torch.tensor([0.0])], "keep 1 must be a non-empty 1-D integer tensor"),
    ([None, torch.zeros(0, dtype=torch.long)], "keep 1 must be a non-empty"),
])
def test_keeps_that_do_not_fit_their_images_are_refused_naming_the_image(keeps, message):
    encoder = encoder_for("paper")
    with pytest.raises(ValueError, match=message):
        encoder.forward_packed(photos([(24, 24), (16, 24)]), keeps=keeps)
