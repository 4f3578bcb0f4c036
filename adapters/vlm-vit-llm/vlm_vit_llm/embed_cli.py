"""`vlm-vit embed` and `vlm-vit llm embed`: images' post-projector tokens in vLLM's
precomputed-input layout (`vlm_vit_llm.embeddings`), one command under both names."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlm_vit_llm.model_args import existing, load_multimodal


def add_embed_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds `embed` to `subparsers`: the top-level entry point, and `llm`'s subcommand."""
    embed = subparsers.add_parser("embed", help="images' projected tokens in vLLM's "
                                  "precomputed-input layout, to one safetensors file")
    embed.add_argument("model", type=Path, metavar="MODEL_DIR_OR_NAME")
    embed.add_argument("images", type=Path, nargs="*", metavar="IMAGE")
    embed.add_argument("--video", type=Path, nargs="+", action="append", default=[],
                       metavar="FRAME", help="a clip's frames in time order, for a tower with "
                       "temporal patches (Qwen-VL); repeat for several clips, which follow "
                       "the images in the file")
    embed.add_argument("--fps", type=float, metavar="RATE", help="the clips' frame rate "
                       "(Qwen2.5-VL's positions and Qwen3-VL's timestamps follow it; "
                       "default: transformers' 24)")
    embed.add_argument("--sample", action="store_true", help="take each clip as a whole "
                       "video and keep the frames the model's video processor samples "
                       "(Qwen3-VL: 2 a second)")
    embed.add_argument("--out", required=True, type=Path, metavar="FILE")
    embed.add_argument("--cache", type=Path, metavar="DIR", help="reuse and store each "
                       "image's tokens here (vlm_vit.io.encode_cache: never stale; clips are "
                       "not cached)")
    embed.set_defaults(run=run_embed)


def run_embed(args: argparse.Namespace) -> int:
    from vlm_vit_llm import Video
    from vlm_vit_llm.embeddings import write_embeddings

    if not args.images and not args.video:
        raise ValueError("give IMAGE files or --video FRAME ...: nothing to embed")
    if args.fps is not None and not (args.fps > 0 and args.video):
        raise ValueError(f"--fps {args.fps:g}: a positive frame rate, for --video clips")
    images = [existing(path, "IMAGE") for path in args.images]  # before the model loads
    clips = [Video([existing(path, "--video FRAME") for path in frames], args.fps)
             for frames in args.video]
    mm = load_multimodal(args.model, "MODEL").eval()
    if args.sample:
        if mm.video_processor is None or not clips:
            raise ValueError("--sample samples --video clips by the model's video processor; "
                             + ("give --video" if not clips else "this model has none"))
        clips = [mm.video_processor.sample(clip) for clip in clips]
    print(write_embeddings(mm, [*images, *clips], args.out, args.cache))
    return 0
