"""`vlm-vit encode`: images or folders to a safetensors file of tokens."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from vlm_vit.cli.common import image_size, is_variant, not_a_variant_either, variant_or_checkpoint
from vlm_vit.files import IMAGE_SUFFIXES, image_files, write_safetensors
from vlm_vit.loading import load_with_processor
from vlm_vit.model import VisionEncoder
from vlm_vit.processor import NORMALIZATION, ImageProcessor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "encode", help="encode images to a safetensors file of tokens",
        description="Encode images (files or folders, searched recursively) and write their "
        "tokens to a safetensors file: `tokens` [images, tokens, width] after the final norm, "
        "or one `layer_K` tensor per --layer (raw block outputs, as hidden_states[K]).")
    parser.add_argument("model", metavar="MODEL", help="a checkpoint, a model name (org/name, "
                        "hf-hub:org/name, open_clip's MODEL/TAG), or a variant name together "
                        "with --random-init")
    parser.add_argument("inputs", nargs="+", metavar="IMAGE_OR_DIR")
    parser.add_argument("-o", "--out", required=True, type=Path, help="output .safetensors")
    parser.add_argument("--layer", type=int, action="append", dest="layers", metavar="K",
                        help="hidden-state index to write (repeatable; -2 for LLaVA)")
    parser.add_argument("--drop-prefix", action="store_true",
                        help="drop the class and register tokens, keep the patch tokens")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, nargs="+", metavar="SIDE",
                        help="encode at SIDE or HEIGHT WIDTH (position table resized)")
    parser.add_argument("--normalize", choices=sorted(NORMALIZATION),
                        help="mean/std preset (default: the checkpoint's processor settings)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--random-init", action="store_true",
                        help="allow a variant name: encode with random weights (for testing)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def find_images(inputs: list[str]) -> list[Path]:
    """Files as given, and every image file under each folder, sorted; errors name the path."""
    found: list[Path] = []
    for item in map(Path, inputs):
        if item.is_dir():
            files = image_files(item)
            if not files:
                raise ValueError(f"folder {item} holds no image files "
                                 f"({', '.join(sorted(IMAGE_SUFFIXES))})")
            found.extend(files)
        elif item.is_file():
            found.append(item)
        else:
            raise FileNotFoundError(f"{item} does not exist")
    return found


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
        with not_a_variant_either(args.model):
            encoder, processor = load_with_processor(
                args.model, **({"image_size": size} if size else {}))
    settings = processor.to_dict() | {"size": list(encoder.config.image_size)}
    if args.normalize:
        settings["mean"], settings["std"] = NORMALIZATION[args.normalize]
    return encoder, ImageProcessor.from_dict(settings)


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.out.suffix != ".safetensors":
        raise ValueError(f"--out must end in .safetensors, got {args.out}")
    files = find_images(args.inputs)
    encoder, processor = _model_and_processor(args)
    encoder = encoder.to(device=args.device, dtype=DTYPES[args.dtype]).eval()
    layers = args.layers or None
    for layer in layers or []:
        encoder.layer_index(layer)  # a bad layer fails before any image is read
    names = [f"layer_{k}" for k in layers] if layers else ["tokens"]
    collected: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    grid = None
    batches = range(0, len(files), args.batch_size)
    with torch.inference_mode():
        for start in tqdm(batches, desc="encoding", unit="batch", disable=args.quiet):
            batch = files[start:start + args.batch_size]
            pixels = processor(batch).to(device=args.device, dtype=DTYPES[args.dtype])
            out = encoder(pixels, feature_layers=layers)
            grid = out.grid
            for name, tensor in zip(names, out.features if layers else [out.tokens]):
                if args.drop_prefix:
                    tensor = tensor[:, out.num_prefix_tokens:]
                collected[name].append(tensor.cpu())
    tensors = {name: torch.cat(parts) for name, parts in collected.items()}
    metadata = {
        "files": json.dumps([str(f) for f in files]), "grid": json.dumps(list(grid)),
        "num_prefix_tokens": str(0 if args.drop_prefix else encoder.num_prefix_tokens),
        "model": str(args.model),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, args.out, metadata=metadata)
    shapes = ", ".join(f"{n} {list(t.shape)}" for n, t in tensors.items())
    print(f"wrote {len(files)} images to {args.out}: {shapes}")
    return 0
