import numpy as np
import pytest
import torch

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.convert.hf_vit import KEY_MAP as HF_VIT_KEYS
from vlm_vit.convert.keymap import fuse_qkv, rename
from vlm_vit.layers import sincos_2d_pos_embed
from vlm_vit.pretrain.mae import MaskedAutoencoder, patchify, unpatchify
from vlm_vit.pretrain.masking import random_masking

from .conftest_data import photo_batch, train_briefly

SIZES = dict(image_size=32, patch_size=8, width=32, depth=2, heads=4, mlp_width=64)


def tiny_mae(mask_ratio=0.75, **encoder):
    torch.manual_seed(0)
    return MaskedAutoencoder(VisionEncoder(EncoderConfig(**{**SIZES, **encoder})),
                             mask_ratio=mask_ratio, decoder_width=32, decoder_depth=1,
                             decoder_heads=4)


def test_the_encoder_sees_exactly_the_visible_tokens():
    mae = tiny_mae(num_register_tokens=2)
    widths = []
    mae.encoder.blocks[0].register_forward_pre_hook(lambda m, args: widths.append(args[0].shape))
    mae(torch.randn(3, 3, 32, 48))  # 4 x 6 = 24 patches, int(24 * 0.25) = 6 visible
    assert widths == [torch.Size([3, 1 + 2 + 6, 32])]


def test_mask_round_trips_through_ids_restore():
    noise = torch.rand(4, 16, generator=torch.Generator().manual_seed(0))
    ids_keep, mask, ids_restore = random_masking(4, 16, 0.75, noise=noise)
    assert ids_keep.shape == (4, 4) and mask.sum(1).tolist() == [12.0] * 4
    shuffled = torch.argsort(noise, dim=1)
    assert torch.equal(torch.gather(shuffled, 1, ids_restore), torch.arange(16).expand(4, -1))
    visible = torch.zeros(4, 16).scatter_(1, ids_keep, 1.0)
    assert torch.equal(visible, 1 - mask)  # the kept patches are exactly the unmasked ones


def test_patchify_round_trip_and_layout():
    pixels = torch.randn(2, 3, 16, 24)
    patches = patchify(pixels, 8)
    assert patches.shape == (2, 6, 192)
    assert torch.equal(unpatchify(patches, 8, (2, 3)), pixels)
    # patch (row 1, col 2), pixel (p=3, q=5), channel 1 sits at (3 * 8 + 5) * 3 + 1
    assert patches[0, 5, (3 * 8 + 5) * 3 + 1] == pixels[0, 1, 8 + 3, 16 + 5]


def test_norm_pix_loss_matches_its_formula():
    mae = tiny_mae()
    pixels, prediction = torch.randn(2, 3, 32, 32), torch.randn(2, 16, 192)
    mask = torch.zeros(2, 16)
    mask[:, ::3] = 1
    target = patchify(pixels, 8)
    mean, var = target.mean(-1, keepdim=True), target.var(-1, unbiased=True, keepdim=True)
    normalised = (target - mean) / torch.sqrt(var + 1e-6)
    per_patch = ((prediction - normalised) ** 2).mean(-1)
    expected = (per_patch * mask).sum() / mask.sum()
    torch.testing.assert_close(mae.forward_loss(pixels, prediction, mask), expected)


def test_mask_ratio_zero_encodes_every_patch_in_order():
    mae = tiny_mae(mask_ratio=0.0).eval()
    pixels = torch.randn(2, 3, 32, 32)
    ids_keep, mask, _ = random_masking(2, 16, 0.0)
    with torch.no_grad():
        assert torch.equal(mae.forward_encoder(pixels, ids_keep), mae.encoder(pixels).tokens)
        assert torch.isfinite(mae(pixels).loss)
    assert mask.sum() == 0


def test_loss_falls_on_real_images():
    mae = tiny_mae()
    losses = train_briefly(mae, photo_batch())
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])


def test_matches_hugging_face_vit_mae():
    """Same weights and noise: the same loss and predictions as ViTMAEForPreTraining."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTMAEConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        image_size=32, patch_size=8, decoder_hidden_size=32, decoder_num_hidden_layers=1,
        decoder_num_attention_heads=4, decoder_intermediate_size=128, layer_norm_eps=1e-6,
        mask_ratio=0.75, norm_pix_loss=True)
    torch.manual_seed(0)
    theirs = transformers.ViTMAEForPreTraining(config).eval()
    theirs.decoder.initialize_weights(16)  # transformers 5.24's _init_weights leaves zeros
    hf = theirs.state_dict()
    ours = tiny_mae().eval()
    encoder = {k.removeprefix("vit."): v for k, v in hf.items() if k.startswith("vit.")}
    encoder = rename(encoder, HF_VIT_KEYS, 2)
    fuse_qkv(encoder, 2)
    ours.encoder.load_state_dict(encoder)
    decoder = {k.replace("decoder.decoder_layers.", "layers."): v for k, v in hf.items()
               if k.startswith("decoder.decoder_layers.")}
    decoder = {k.replace("blocks.", "decoder_blocks."): v
               for k, v in rename(decoder, HF_VIT_KEYS, 1).items()}
    fuse_qkv(decoder, 1, part="decoder_blocks.{}.attn.{}")
    for name in ("decoder_embed", "decoder_norm", "decoder_pred"):
        decoder.update({f"{name}.{k}": hf[f"decoder.{name}.{k}"] for k in ("weight", "bias")})
    decoder["mask_token"] = hf["decoder.mask_token"]
    ours.load_state_dict({**{f"encoder.{k}": v for k, v in encoder.items()}, **decoder})
    # MAE's fixed decoder table is our sin-cos table with a zero class entry
    torch.testing.assert_close(hf["decoder.decoder_pos_embed"][0, 1:],
                               sincos_2d_pos_embed((4, 4), 32))
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    noise = torch.rand(2, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = theirs(pixel_values=pixels, noise=noise)
        loss = ours(pixels, noise=noise).loss
        ids_keep, mask, ids_restore = random_masking(2, 16, 0.75, noise=noise)
        prediction = ours.forward_decoder(ours.forward_encoder(pixels, ids_keep), ids_restore,
                                          (4, 4))
    torch.testing.assert_close(mask, expected.mask)
    torch.testing.assert_close(prediction, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, expected.loss, atol=1e-6, rtol=1e-5)
