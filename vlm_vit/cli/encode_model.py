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
    elif has_taps(args.model):
        from vlm_vit.io.loading import load_processor
        from vlm_vit.taps import TappedTower

        with reading_checkpoint(args.model):
            args.taps = TappedTower.from_pretrained(
                args.model, **({"image_size": size} if size else {}))
        encoder = args.taps.tower.encoder
        processor = args.taps.tower.processor or load_processor(args.model)
    else:
        with reading_checkpoint(args.model):
            encoder, processor = load_with_processor(
                args.model, **({"image_size": size} if size else {}))
    settings = processor.to_dict() | {"size": list(encoder.config.image_size)}
    if args.normalize:
        settings["mean"], settings["std"] = NORMALIZATION[args.normalize]
    return encoder, ImageProcessor.from_dict(settings)


def has_taps(model: str) -> bool:
    """Whether `model` is a folder a `TappedTower` was saved to (it holds `taps.json`)."""
    from pathlib import Path

    from vlm_vit.taps import TAPS_CONFIG_NAME

    return Path(model).is_dir() and (Path(model) / TAPS_CONFIG_NAME).is_file()


def prepare_encoder(args: argparse.Namespace
             ) -> tuple[VisionEncoder, ImageProcessor, list[int] | None, list[str]]:
    """The encoder on its device and dtype, its processor, the --layer indices (None for the
    final tokens) and the output tensor names (`tap_NAME` after them for each tap of a saved
    `TappedTower`, which is `args.taps`, else None); a bad layer fails before any image is
    read."""
    args.taps = None
    encoder, processor = _model_and_processor(args)
    if args.dtype == "int8":
        if args.device != "cpu":
            raise ValueError(f"--dtype int8 runs on the CPU only, not --device {args.device}")
        from vlm_vit.deploy.export import quantize_int8

        encoder = quantize_int8(encoder.float().eval())
        if args.taps is not None:
            args.taps.taps.float().eval()
        return encoder, processor, *_layers(encoder, args)
    encoder = encoder.to(device=args.device, dtype=DTYPES[args.dtype]).eval()
    if args.taps is not None:
        args.taps.taps.to(device=args.device, dtype=DTYPES[args.dtype]).eval()
    return encoder, processor, *_layers(encoder, args)


def _layers(encoder: VisionEncoder, args: argparse.Namespace
            ) -> tuple[list[int] | None, list[str]]:
    layers = args.feature_layers or None
    for layer in layers or []:
        encoder.layer_index(layer)
    names = [f"layer_{k}" for k in layers] if layers else ["tokens"]
    taps = [f"tap_{name}" for name in args.taps.layers] if args.taps is not None else []
    return layers, names + taps


def encode_batch(args: argparse.Namespace, encoder: VisionEncoder, pixels: torch.Tensor,
             layers: list[int] | None, names: list[str]
             ) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
    """One batch `[B, 3, H, W]` through the encoder: name -> `[B, T, D]` on the CPU (the
    prefix dropped with --no-keep-prefix), each tap of `args.taps` through its pooler (from
    the same run), and the patch grid."""
    taps = args.taps
    asked = layers if taps is None else taps.run_layers(layers)
    out = encoder(pixels.to(device=args.device, dtype=DTYPES[args.dtype]),
                  feature_layers=asked)
    kept = len(layers) if layers else 1
    tensors = {}
    for name, tensor in zip(names[:kept], out.features if layers else [out.tokens],
                            strict=False):
        if not args.keep_prefix:
            tensor = tensor[:, out.num_prefix_tokens:]
        tensors[name] = tensor.cpu()
    for index, (name, tap) in enumerate(zip(names[kept:], taps.layers if taps else [],
                                            strict=True)):
        tensors[name] = taps.pool_batch(tap, out.features[kept + index], out).cpu()
    return tensors, out.grid
