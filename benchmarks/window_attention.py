"""Encode speed of a Qwen2.5-VL-shaped vision tower (window attention) against transformers'
`Qwen2_5_VisionTransformerPretrainedModel` on the same weights, at native resolution.

    python benchmarks/window_attention.py                        # 448x672, width 320, depth 8
    python benchmarks/window_attention.py --hf-attention sdpa eager --repeats 20

The tower is Qwen2.5-VL's at a smaller width and depth (RMSNorm, SwiGLU, 2D RoPE, Conv3d
patches, 8-patch windows in every block but the last, which attends globally, the 2x2 RMSNorm
merger), built at random by transformers and read by our converter (`hf_qwen2_5_vl`). Both
sides encode one image and run the merger: transformers from Qwen's flattened patches and
`grid_thw` (its processor's output), ours from the `[1, 3, H, W]` pixels. The candidates
alternate call by call after a warm-up (`timing.alternate`); the figure that carries over
between machines is the ratio of the medians.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from timing import alternate, write_json


def qwen_patches(image: torch.Tensor, patch: int, frames: int, merge: int):
    """`[C, H, W]` as Qwen2.5-VL's processor flattens it: the frame repeated over the
    temporal patch, one row per tube in merge-window order; and grid_thw."""
    channels, height, width = image.shape
    rows, cols = height // patch, width // patch
    clip = image[:, None].expand(-1, frames, -1, -1)
    tubes = clip.reshape(channels, 1, frames, rows // merge, merge, patch, cols // merge, merge,
                         patch).permute(1, 3, 6, 4, 7, 0, 2, 5, 8)
    return tubes.reshape(rows * cols, -1).contiguous(), torch.tensor([[1, rows, cols]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=320)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--mlp-width", type=int, default=864)
    parser.add_argument("--height", type=int, default=448)
    parser.add_argument("--image-width", type=int, default=672)
    parser.add_argument("--patch-size", type=int, default=14)
    parser.add_argument("--window-pixels", type=int, default=112, help="Qwen's window_size")
    parser.add_argument("--hf-attention", nargs="+", default=["sdpa"],
                        choices=["sdpa", "eager"], help="transformers' attention paths to time")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    from vlm_vit import load_tower
    from vlm_vit.layers.window_segments import window_partition

    merge, frames = 2, 2
    hf_config = dict(depth=args.depth, hidden_size=args.width, intermediate_size=args.mlp_width,
                     num_heads=args.heads, out_hidden_size=args.width * 2,
                     patch_size=args.patch_size, temporal_patch_size=frames,
                     spatial_merge_size=merge, window_size=args.window_pixels,
                     fullatt_block_indexes=[args.depth - 1])
    torch.manual_seed(0)
    theirs = {}
    with tempfile.TemporaryDirectory() as folder:
        for attention in args.hf_attention:
            config = Qwen2_5_VLVisionConfig(**hf_config)
            config._attn_implementation = attention
            torch.manual_seed(0)  # the same weights for every path
            theirs[attention] = Qwen2_5_VisionTransformerPretrainedModel(config).eval()
        next(iter(theirs.values())).save_pretrained(folder)
        tower = load_tower(folder).eval()

    generator = torch.Generator().manual_seed(1)
    image = torch.randn(3, args.height, args.image_width, generator=generator)
    patches, grid_thw = qwen_patches(image, args.patch_size, frames, merge)
    pixels = image[None]

    def ours():
        out = tower.encoder(pixels)
        return out, tower.pooler(out.tokens, num_prefix_tokens=0, grid=out.grid)

    calls = {"vlm-vit": ours}
    for attention, model in theirs.items():
        calls[f"transformers {attention}"] = lambda model=model: model(patches, grid_thw=grid_thw)
    with torch.inference_mode():
        out, merged = ours()
        order = window_partition(out.grid, tower.encoder.config.window_size, merge).order
        difference = {}
        for attention, model in theirs.items():
            reference = model(patches, grid_thw=grid_thw)
            difference[attention] = max(
                (out.tokens[0, order] - reference.last_hidden_state).abs().max().item(),
                (merged[0] - reference.pooler_output).abs().max().item())
        seconds = alternate(calls, args.repeats, warmup=args.warmup)

    result = {
        "settings": {**vars(args), "tokens": int(out.tokens.shape[1]), "grid": list(out.grid),
                     "threads": torch.get_num_threads()},
        "seconds_per_image": seconds,
        "max_abs_difference": difference,
    }
    for attention in theirs:
        result[f"ratio_vlm_vit_over_transformers_{attention}"] = (
            seconds[f"transformers {attention}"] / seconds["vlm-vit"])
    for name, value in seconds.items():
        print(f"{name:>22}: {value * 1e3:8.1f} ms per image")
    for attention in theirs:
        print(f"speed vs transformers {attention}: "
              f"{result[f'ratio_vlm_vit_over_transformers_{attention}']:.2f}x "
              f"(max |difference| {difference[attention]:.1e})")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
