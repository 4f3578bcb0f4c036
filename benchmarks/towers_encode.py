"""Encode time of the towers 2026 models start from, against timm's own build of each on the
same weights and pixels: DINOv3-L, AIMv2-L and InternViT-300M (issue 45).

    python benchmarks/towers_encode.py                       # all three at their sizes
    python benchmarks/towers_encode.py --towers dinov3-l --depth 4 --image-size 224

Each tower is built by timm at random initialisation, saved in timm's hub layout (weights and
`config.json`) and loaded by `vlm_vit.load_encoder`, the path a user takes. Both encode every
token after the final norm (timm's `forward_features`); the outputs are checked equal, then
the two alternate call by call after a warm-up (medians). `--depth` and `--width` shrink
both sides alike (the ratio is a per-block figure).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from timing import add_timing_arguments, alternate, flush_denormals, write_json  # noqa: E402

# name -> timm architecture (its full size), the image side it was released at
TOWERS = {
    "dinov3-l": ("vit_large_patch16_dinov3", 224),
    "aimv2-l": ("aimv2_large_patch14_224", 224),
    "internvit-300m": ("vit_intern300m_patch14_448", 448),
}


def build(name: str, args: argparse.Namespace, folder: Path):
    """(timm's model, ours loaded from what timm saved, the image side)."""
    import timm
    from timm.models import _hub as timm_hub

    from vlm_vit import load_encoder

    architecture, side = TOWERS[name]
    side = args.image_size or side
    model_args = {"img_size": side}
    if args.depth:
        model_args["depth"] = args.depth
    if args.width:
        model_args.update(embed_dim=args.width, num_heads=max(1, args.width // 64))
    torch.manual_seed(0)
    model = timm.create_model(architecture, pretrained=False, **model_args).eval()
    with torch.no_grad():  # timm's zero or one inits would hide a misplaced tensor
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    timm_hub.save_for_hf(model, str(folder), model_args=model_args, safe_serialization=True)
    return model, load_encoder(folder).eval(), side


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--towers", nargs="+", choices=TOWERS, default=list(TOWERS))
    parser.add_argument("--image-size", type=int, default=None, help="default: each tower's")
    parser.add_argument("--depth", type=int, default=None, help="default: each tower's")
    parser.add_argument("--width", type=int, default=None, help="default: each tower's")
    parser.add_argument("--batch-size", type=int, default=2)
    add_timing_arguments(parser)
    args = parser.parse_args()
    flush_denormals(args.keep_denormals)

    result: dict = {"towers": {}, "batch_size": args.batch_size, "repeats": args.repeats}
    for name in args.towers:
        with tempfile.TemporaryDirectory() as scratch:
            timm_model, ours, side = build(name, args, Path(scratch))
        pixels = torch.randn(args.batch_size, 3, side, side,
                             generator=torch.Generator().manual_seed(1))

        def run_ours(encoder=ours, x=pixels):
            with torch.inference_mode():
                return encoder(x).tokens

        def run_timm(model=timm_model, x=pixels):
            with torch.inference_mode():
                return model.forward_features(x)

        difference = (run_ours() - run_timm()).abs().max().item()
        seconds = alternate({"vlm-vit": run_ours, "timm": run_timm}, args.repeats,
                            warmup=args.warmup)
        result["towers"][name] = {
            "architecture": TOWERS[name][0], "image_size": side,
            "depth": ours.config.depth, "width": ours.config.width,
            "max_abs_difference": difference, "seconds": seconds,
            "speed_ratio_vlm_vit_over_timm": seconds["timm"] / seconds["vlm-vit"]}
        result[f"ratio_{name.replace('-', '_')}_vlm_vit_over_timm"] = \
            seconds["timm"] / seconds["vlm-vit"]
        print(f"{name} ({TOWERS[name][0]}, depth {ours.config.depth}, width "
              f"{ours.config.width}, {side}x{side}, batch {args.batch_size}): vlm-vit "
              f"{seconds['vlm-vit']:.3f} s, timm {seconds['timm']:.3f} s, speed ratio "
              f"{seconds['timm'] / seconds['vlm-vit']:.3f} (max diff {difference:.1e})",
              flush=True)
        del timm_model, ours
    write_json(args.json, result)


if __name__ == "__main__":
    main()
