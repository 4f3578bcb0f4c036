"""Qwen3-VL's vision tower, ours against transformers' `Qwen3VLVisionModel` on the same
weights and pixels: the merger's tokens and the DeepStack taps of a batch of images at
native resolution, in one packed call each (issue 45).

    python benchmarks/qwen3_vl_tower.py                      # Qwen3-VL-8B's tower, 27 blocks
    python benchmarks/qwen3_vl_tower.py --depth 6 --sides 448 448 320 640

transformers' model is built at random initialisation (perturbed), saved by
`save_pretrained`, and read by `load_tower` and `deepstack_taps` (a `TappedTower`): the path
a user takes. transformers gets the patches as its processor flattens them (one row per
Conv3d tube, in merge-window order, the image repeated over the temporal patch; not timed);
ours gets the `[C, H, W]` images and patchifies them inside. The outputs are checked equal,
then the two alternate call by call after a warm-up (medians).
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from timing import alternate, flush_denormals, write_json  # noqa: E402

# Qwen3-VL-8B's vision config (its config.json), the size the benchmark defaults to
QWEN3_VL_8B = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                   out_hidden_size=4096, patch_size=16, temporal_patch_size=2,
                   spatial_merge_size=2, num_position_embeddings=2304,
                   deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh")


def flattened(image: torch.Tensor, patch: int, temporal: int, merge: int):
    """An image `[C, H, W]` as Qwen's processor flattens it, repeated over the temporal
    patch: one row per tube `(C, T, P, P)` in merge-window order; and its grid_thw."""
    channels, height, width = image.shape
    rows, cols = height // patch, width // patch
    clip = image[:, None].expand(-1, temporal, -1, -1)
    tubes = clip.reshape(channels, 1, temporal, rows // merge, merge, patch, cols // merge,
                         merge, patch)
    tubes = tubes.permute(1, 3, 6, 4, 7, 0, 2, 5, 8)
    return (tubes.reshape(rows * cols, channels * temporal * patch * patch),
            torch.tensor([[1, rows, cols]]))


def main() -> None:
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from vlm_vit import load_tower
    from vlm_vit.convert.hf_qwen3_vl import deepstack_taps
    from vlm_vit.io.loading import read_checkpoint
    from vlm_vit.taps import TappedTower

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=None, help="default: Qwen3-VL-8B's 27")
    parser.add_argument("--width", type=int, default=None, help="default: 1152 (16 heads)")
    parser.add_argument("--sides", type=int, nargs="+", default=[448, 448, 320, 640],
                        metavar="SIDE", help="image sides (pairs: height width), multiples "
                        "of the patch times the merge (32 for Qwen3-VL)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--attention", default="sdpa", help="transformers' attn_implementation")
    parser.add_argument("--keep-denormals", action="store_true",
                        help="do not flush denormal floats to zero (see timing.flush_denormals)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    flush_denormals(args.keep_denormals)
    if len(args.sides) % 2:
        parser.error("--sides takes pairs: height width")
    window = QWEN3_VL_8B["patch_size"] * QWEN3_VL_8B["spatial_merge_size"]
    if any(side <= 0 or side % window for side in args.sides):
        parser.error(f"--sides must be positive multiples of {window} (the patch times the "
                     f"merge), got {args.sides}")

    settings = dict(QWEN3_VL_8B)
    if args.depth:
        settings["depth"] = args.depth
        settings["deepstack_visual_indexes"] = [
            index for index in settings["deepstack_visual_indexes"] if index < args.depth] or [0]
    if args.width:
        settings.update(hidden_size=args.width, num_heads=max(1, args.width // 72),
                        intermediate_size=args.width * 4, out_hidden_size=args.width * 2)
    torch.manual_seed(0)
    model = Qwen3VLVisionModel(Qwen3VLVisionConfig(**settings)).eval()
    with torch.no_grad():  # the inits' ones and zeros would hide a misplaced tensor
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    model.config._attn_implementation = args.attention
    with tempfile.TemporaryDirectory() as scratch:
        model.save_pretrained(scratch)
        ours = TappedTower(load_tower(scratch).eval(), deepstack_taps(read_checkpoint(scratch)))
    sizes = list(zip(args.sides[::2], args.sides[1::2], strict=True))
    generator = torch.Generator().manual_seed(1)
    images = [torch.randn(3, height, width, generator=generator) for height, width in sizes]
    patch, temporal, merge = (settings[key] for key in ("patch_size", "temporal_patch_size",
                                                         "spatial_merge_size"))
    parts = [flattened(image, patch, temporal, merge) for image in images]
    patches, grid_thw = torch.cat([p for p, _ in parts]), torch.cat([g for _, g in parts])

    def run_ours():
        with torch.inference_mode():
            return ours(images)

    def run_theirs():
        with torch.inference_mode():
            return model(patches, grid_thw=grid_thw)

    mine, theirs = run_ours(), run_theirs()
    difference = max(
        (torch.cat(mine.tokens) - theirs.pooler_output).abs().max().item(),
        *((torch.cat(mine.taps[name]) - expected).abs().max().item()
          for name, expected in zip(ours.taps, theirs.deepstack_features, strict=True)))
    seconds = alternate({"vlm-vit": run_ours, "transformers": run_theirs}, args.repeats,
                        warmup=args.warmup)
    result = {
        "depth": settings["depth"], "width": settings["hidden_size"], "sizes": sizes,
        "tokens": int(patches.shape[0]), "attention": args.attention,
        "max_abs_difference": difference, "seconds": seconds,
        "speed_ratio_vlm_vit_over_transformers": seconds["transformers"] / seconds["vlm-vit"],
        "variant": f"depth {settings['depth']} x width {settings['hidden_size']}",
        "settings_note": f"{len(images)} images, {patches.shape[0]} patches, transformers "
                         f"{args.attention}, max diff {difference:.1e}",
        "device": "cpu", "dtype": "float32",
    }
    print(f"Qwen3-VL tower, depth {settings['depth']}, width {settings['hidden_size']}, "
          f"{len(images)} images ({patches.shape[0]} patches), transformers {args.attention}, "
          f"median of {args.repeats}; max diff {difference:.1e}")
    for name, value in seconds.items():
        print(f"  {name:<13} {value:7.3f} s")
    print(f"  speed ratio vlm-vit / transformers: "
          f"{result['speed_ratio_vlm_vit_over_transformers']:.3f} (above 1: faster)")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
