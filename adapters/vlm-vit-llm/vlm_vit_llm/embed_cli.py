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
    embed.add_argument("images", type=Path, nargs="+", metavar="IMAGE")
    embed.add_argument("--out", required=True, type=Path, metavar="FILE")
    embed.add_argument("--cache", type=Path, metavar="DIR", help="reuse and store each "
                       "image's tokens here (vlm_vit.io.encode_cache: never stale)")
    embed.set_defaults(run=run_embed)


def run_embed(args: argparse.Namespace) -> int:
    from vlm_vit_llm.embeddings import write_embeddings

    images = [existing(path, "IMAGE") for path in args.images]  # before the model loads
    print(write_embeddings(load_multimodal(args.model, "MODEL").eval(), images, args.out,
                           args.cache))
    return 0
