"""Objectives by name, as `vlm-vit pretrain --objective` and the demo build them."""

from __future__ import annotations

from vlm_vit.model import VisionEncoder

MAE_PAPER_WIDTH = 768  # ViT-B: from here up, MAE's own decoder (512 wide, 8 deep)


def default_mae_decoder(encoder_width: int) -> tuple[int, int]:
    """MAE's decoder (width, depth) for an encoder of this width: the paper's 512 x 8 for
    ViT-B and larger; for smaller encoders as wide as the encoder and 4 deep, so the decoder
    stays lighter than the encoder (512 x 8 around a vit-ti/16 would hold 5x its weights)."""
    if encoder_width >= MAE_PAPER_WIDTH:
        return 512, 8
    return encoder_width, 4


def build_objective(name: str, encoder: VisionEncoder, *, mean, std, mask_ratio: float = 0.75,
                    decoder_width: int | None = None, decoder_depth: int | None = None):
    """The objective module named `name` around `encoder`; MAE's decoder defaults to
    `default_mae_decoder`."""
    if name == "mpp":
        from vlm_vit.pretrain.mpp import MaskedPatchPrediction

        return MaskedPatchPrediction(encoder, mean=mean, std=std)
    from vlm_vit.pretrain.mae import MaskedAutoencoder

    width, depth = default_mae_decoder(encoder.config.width)
    decoder_width, decoder_depth = decoder_width or width, decoder_depth or depth
    heads = max(h for h in (16, 8, 4, 2, 1) if decoder_width % h == 0)
    return MaskedAutoencoder(encoder, mask_ratio=mask_ratio, decoder_width=decoder_width,
                             decoder_depth=decoder_depth, decoder_heads=heads)
