"""A LLaVA stage-1 step (projector only) with the frozen tower's features read from the
feature cache (`vlm_vit.io.feature_cache`, `llm train --cache`) against the same step
computing them from the pixels.

    python benchmarks/stage1_cache_step.py                  # clip-vit-b/16 + a 4-layer Llama

Both arms are the same model, batch and optimizer; the cached arm's entries were written by
one earlier call (so every timed step hits: key hashing, reading and stacking the entries
included). They alternate in one process after a warm-up (medians). The losses are checked
equal. Needs the plugin: `pip install -e adapters/vlm-vit-llm`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from llava_step_vs_hf import CAPTION, tokenizer_in  # noqa: E402
from timing import alternate, flush_denormals, write_json  # noqa: E402

from vlm_vit import EncoderConfig, VisionEncoder, VisionTower, build_pooler  # noqa: E402


def build(args: argparse.Namespace, folder: Path):
    """A stage-1 `MultimodalLM` (the projector trains, the rest is frozen)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from vlm_vit_llm import MultimodalLM

    torch.manual_seed(0)
    overrides = {"image_size": args.image_size} if args.image_size else {}
    if args.depth:
        overrides["depth"] = args.depth
    encoder = VisionEncoder(EncoderConfig.from_name(args.variant, **overrides)).eval()
    width = args.llm_width
    tower = VisionTower(encoder, build_pooler("mlp2x_gelu", in_dim=encoder.config.width,
                                              out_dim=width), feature_layer=-2)
    llm = LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=width, intermediate_size=width * 11 // 4,
        num_hidden_layers=args.llm_layers, num_attention_heads=max(1, width // 64),
        num_key_value_heads=max(1, width // 64), max_position_embeddings=2048)).eval()
    return MultimodalLM(tower, llm, tokenizer_in(folder)).train_projector_only()


def main() -> None:
    from vlm_vit.io.encode_cache import EncodeCache
    from vlm_vit.io.feature_cache import cache_tower_features

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="clip-vit-b/16")
    parser.add_argument("--image-size", type=int, default=None, help="default: the variant's")
    parser.add_argument("--depth", type=int, default=None, help="default: the variant's")
    parser.add_argument("--llm-width", type=int, default=512)
    parser.add_argument("--llm-layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keep-denormals", action="store_true",
                        help="do not flush denormal floats to zero (see timing.flush_denormals)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    flush_denormals(args.keep_denormals)

    with tempfile.TemporaryDirectory() as scratch:
        mm = build(args, Path(scratch))
        size = mm.tower.encoder.config.image_size
        pixels = torch.randn(args.batch_size, 3, *size, generator=torch.Generator().manual_seed(1))
        prompts, images = ["<image>\n"] * args.batch_size, [[p] for p in pixels]
        targets = [CAPTION] * args.batch_size
        optimizer = torch.optim.AdamW([p for p in mm.parameters() if p.requires_grad], lr=0.0)
        cache = EncodeCache(Path(scratch) / "cache")
        cache_tower_features(mm.tower, cache)  # hashes the weights once
        reader = mm.tower.feature_cache

        def step(cached: bool):
            def go():
                mm.tower.feature_cache = reader if cached else None
                loss = mm(prompts, images, targets).loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()  # lr 0: both arms see the same weights every time
                return loss.item()
            return go

        steps = {"from pixels": step(False), "from the cache": step(True)}
        losses = {name: run() for name, run in steps.items()}  # fills the cache
        seconds = alternate(steps, args.repeats)
        entry_bytes = sum(size for _, size, _ in cache.entries()) / args.batch_size
    result = {
        "variant": args.variant, "llm_width": args.llm_width, "llm_layers": args.llm_layers,
        "batch_size": args.batch_size, "depth": mm.tower.encoder.config.depth,
        "image_tokens": mm.tower.num_image_tokens(), "step_seconds": seconds,
        "loss_difference": abs(losses["from pixels"] - losses["from the cache"]),
        "entry_kib": entry_bytes / 1024,
        "speed_ratio_cache_over_pixels": seconds["from pixels"] / seconds["from the cache"],
    }
    print(f"stage-1 step, {args.variant} (depth {result['depth']}) + Llama "
          f"{args.llm_layers}x{args.llm_width}, batch {args.batch_size}, cpu float32, median of "
          f"{args.repeats}; loss difference {result['loss_difference']:.1e}, "
          f"{result['entry_kib']:.0f} KiB an entry")
    for name, value in seconds.items():
        print(f"  {name:<15} {value:7.3f} s")
    print(f"  speed ratio, cache over pixels: {result['speed_ratio_cache_over_pixels']:.2f}x")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
