"""The encoder setup and the batch step shared by `vlm-vit encode` over images
(`vlm_vit.cli.encode`) and over tar shards (`vlm_vit.cli.encode_shards`)."""

from __future__ import annotations

import argparse

import torch

from vlm_vit.cli.common import image_size, is_variant, reading_checkpoint, variant_or_checkpoint
from vlm_vit.io.loading import load_with_processor
from vlm_vit.model import VisionEncoder
from vlm_vit.presets import ENCODE_DTYPES
from vlm_vit.processor import NORMALIZATION, ImageProcessor

# --dtype to the dtype of the pixels and tokens; int8 computes in float32 around its int8
# block Linears (`prepare_encoder` quantizes them).
DTYPES = dict(zip(ENCODE_DTYPES, (torch.float32, torch.bfloat16, torch.float16,
                                   torch.float32), strict=True))  # int8: quantized from float32


def _model_and_processor(args: argparse.Namespace) -> tuple[VisionEncoder, ImageProcessor]:
    """The encoder and the preprocessing its checkpoint records (ImageNet normalisation when
    it records none, or for a variant at random init), with --normalize and the size applied."""
    size = image_size(args.image_size)
    if is_variant(args.model):
        if not args.random_init:
            raise ValueError(f"{args.model} is a variant name, not a checkpoint; to encode with "
                             f"random weights, add --random-init (hf-hub:{args.model} means "
                             f"the Hub)")
        encoder = variant_or_checkpoint(args.model, size)
        processor = ImageProcessor.for_family("imagenet", size=encoder.config.image_size)
    else:
        with reading_checkpoint(args.model):
            encoder, processor = load_with_processor(
                args.model, **({"image_size": size} if size else {}))
    settings = processor.to_dict() | {"size": list(encoder.config.image_size)}
    if args.normalize:
        settings["mean"], settings["std"] = NORMALIZATION[args.normalize]
    return encoder, ImageProcessor.from_dict(settings)


def prepare_encoder(args: argparse.Namespace
             ) -> tuple[VisionEncoder, ImageProcessor, list[int] | None, list[str]]:
    """The encoder on its device and dtype, its processor, the --feature-layer indices (None for the
    final tokens) and the output tensor names; a bad layer fails before any image is read."""
    encoder, processor = _model_and_processor(args)
    if args.dtype == "int8":
        if args.device != "cpu":
            raise ValueError(f"--dtype int8 runs on the CPU only, not --device {args.device}")
        from vlm_vit.deploy.export import quantize_int8

        return quantize_int8(encoder.float().eval()), processor, *_layers(encoder, args)
    encoder = encoder.to(device=args.device, dtype=DTYPES[args.dtype]).eval()
    return encoder, processor, *_layers(encoder, args)


def _layers(encoder: VisionEncoder, args: argparse.Namespace
            ) -> tuple[list[int] | None, list[str]]:
    layers = args.feature_layers or None
    for layer in layers or []:
        encoder.layer_index(layer)
    names = [f"layer_{k}" for k in layers] if layers else ["tokens"]
    return layers, names


def encode_batch(args: argparse.Namespace, encoder: VisionEncoder, pixels: torch.Tensor,
             layers: list[int] | None, names: list[str]
             ) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
    """One batch `[B, 3, H, W]` through the encoder: name -> `[B, T, D]` on the CPU (the
    prefix dropped with --no-keep-prefix), and the patch grid."""
    out = encoder(pixels.to(device=args.device, dtype=DTYPES[args.dtype]),
                  feature_layers=layers)
    tensors = {}
    for name, tensor in zip(names, out.features if layers else [out.tokens], strict=True):
        if not args.keep_prefix:
            tensor = tensor[:, out.num_prefix_tokens:]
        tensors[name] = tensor.cpu()
    return tensors, out.grid
