"""`vlm-vit convert SRC DST --to FORMAT`: between native, Hugging Face CLIP, DINOv2, Pixtral,
Qwen2-VL and Qwen2.5-VL, timm (ViT and Eva), open_clip."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from vlm_vit.cli.common import check_output_apart, image_size, reading_checkpoint
from vlm_vit.config import ACTIVATIONS

# transformers reads shards; timm and open_clip read one weight file
SHARDABLE = ("native", "hf_clip", "hf_dinov2", "hf_pixtral", "hf_qwen2_vl", "hf_qwen2_5_vl")
# What a native save writes besides the weight files its manifest lists: over an earlier
# vlm-vit model these, and that model's listed weights, are all it replaces (config.json,
# manifest.json, the shards' index and the processor's config).
NATIVE_METADATA = ("config.json", "manifest.json", "model.safetensors.index.json",
                   "processor_config.json")


def writable_formats() -> list[str]:
    """Formats that can be written: native and those whose converter has `write`."""
    from vlm_vit.convert import FORMATS

    return ["native", *(n for n in FORMATS.names() if hasattr(FORMATS.get(n), "write"))]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert a checkpoint to another family's format",
        description="Read any supported checkpoint and write it in another format, which "
        "loads in that family's own library.")
    parser.add_argument("source", metavar="SRC", help="a checkpoint path or model name "
                        "(org/name, hf-hub:org/name, open_clip's MODEL/TAG)")
    parser.add_argument("destination", metavar="DST", type=Path,
                        help="a directory (native, timm, the Hugging Face formats; open_clip: "
                        "one its factory loads) or, for open_clip, a .safetensors state dict; an "
                        "existing folder must hold a model, and only that model's files are "
                        "replaced")
    parser.add_argument("--to", required=True, metavar="FORMAT",
                        help="native, hf-clip, hf-dinov2, hf-pixtral, hf-qwen2-vl, "
                        "hf-qwen2-5-vl, hf-qwen3-vl, hf-glm4v, hf-aimv2, hf-dinov3, hf-internvl, "
                        "timm, timm-eva, timm-aimv2, timm-dinov3, timm-pe or open_clip (dashes or "
                        "underscores)")
    parser.add_argument("--from", dest="source_format", metavar="FORMAT",
                        help="read SRC as this format instead of detecting it")
    parser.add_argument("--heads", type=int, metavar="N",
                        help="attention heads of a bare state dict (a weight file with no "
                        "config: no tensor shape records them; vlm_vit/convert/bare.py)")
    parser.add_argument("--act", choices=ACTIVATIONS,
                        help="the MLP activation of a bare open_clip / OpenAI file (quick_gelu "
                        "for OpenAI's weights, gelu for LAION's)")
    parser.add_argument("--image-size", type=int, nargs="+", metavar="SIDE",
                        help="resize the position table to SIDE or HEIGHT WIDTH on the way")
    parser.add_argument("--crop-rounding", choices=("floor", "round"), default=None,
                        help="set the recorded processor's centre-crop rounding on the way "
                        "(hf-clip needs floor, transformers' own; the source's crops may then "
                        "differ from the original by one pixel)")
    parser.add_argument("--max-shard-size", metavar="SIZE", default=None,
                        help="write larger weights as shards and an index, as transformers "
                        "does (native and the Hugging Face formats; default 5GB)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vlm_vit.convert import FORMATS
    from vlm_vit.io.files import atomic_directory
    from vlm_vit.io.loading import build_native_pooler, convert_checkpoint
    from vlm_vit.io.weights import parse_size
    from vlm_vit.model import VisionEncoder

    target = args.to.replace("-", "_")
    if target not in writable_formats():
        raise ValueError(f"cannot write format {args.to!r}; writable: "
                         f"{', '.join(writable_formats())}")
    check_output_apart(args.destination, args.source, [], flag="DST", replaced=True)
    if target == "native" and args.destination.is_file():
        raise NotADirectoryError(f"DST {args.destination} is a file; native writes a folder")
    replaces = previous_model_files(args.destination)
    shards = {}
    if args.max_shard_size is not None:
        if target not in SHARDABLE:
            raise ValueError(f"--max-shard-size: {target} is read from one weight file; "
                             f"shards are written for {', '.join(SHARDABLE)} only")
        shards = {"max_shard_size": parse_size(args.max_shard_size)}
    size = image_size(args.image_size)
    overrides = {"image_size": size} if size else {}
    with reading_checkpoint(args.source):
        given = {name: value for name, value in (("heads", args.heads), ("act", args.act))
                 if value is not None}
        converted = convert_checkpoint(args.source, args.source_format, given=given)
        encoder = VisionEncoder.from_state_dict(converted.state, converted.config,
                                                source=args.source, **overrides)
    pooler = (build_native_pooler(converted.pooler, args.source)
              if converted.pooler is not None else None)
    processor = converted.processor
    if args.crop_rounding is not None and processor is not None:
        processor = dataclasses.replace(processor, crop_rounding=args.crop_rounding)
    if target == "native":
        with atomic_directory(args.destination, replaces=replaces) as temp:  # all at once
            encoder.save_pretrained(temp, **shards)
            if processor is not None:
                processor.save_pretrained(temp)
    else:
        FORMATS.get(target).write(encoder, args.destination, pooler=pooler, processor=processor,
                                  **shards)
    print(f"wrote {args.destination} ({target}, {sum(p.numel() for p in encoder.parameters()):,}"
          f" parameters)")
    return 0


def previous_model_files(destination: Path) -> tuple[str, ...]:
    """What of an existing DST a native save replaces: the files its manifest lists and the
    native metadata for a vlm-vit model; every `.json` and `.safetensors` for a model folder
    another library wrote (a `config.json`, no manifest). The rest is carried over.

    Raises:
        ValueError: for a DST that holds files but no model (the user's own folder).
    """
    import glob

    from vlm_vit.io.files import MODEL_FILES
    from vlm_vit.io.integrity import MANIFEST_NAME, read_manifest
    from vlm_vit.model import CONFIG_NAME

    if not destination.is_dir() or not any(destination.iterdir()):
        return MODEL_FILES  # nothing to keep (a file DST is open_clip's, or refused)
    listed = read_manifest(destination)
    if listed is not None:
        return (*NATIVE_METADATA, *(glob.escape(name.split("/")[0]) for name in listed))
    if (destination / CONFIG_NAME).is_file():
        return MODEL_FILES
    raise ValueError(f"DST {destination} holds files but no model (no {MANIFEST_NAME} or "
                     f"{CONFIG_NAME}), and converting into it would replace its .json and "
                     f".safetensors files; write to a new or empty folder")
