"""Encode speed of DINOv2-L/14 (LayerScale) against transformers' `Dinov2Model` and timm's
`VisionTransformer` (its DINOv2 models' class) on the same weights.

    python benchmarks/dinov2_encode.py                    # DINOv2-L/14 at 224, batch 2
    python benchmarks/dinov2_encode.py --registers 4      # DINOv2 with registers

transformers builds the model at random (its `Dinov2Config`, ViT-L/14 sizes, LayerScale 1e-5
as in DINOv2's release) at the benchmark's size, so no side resizes its position table; our
converter reads the saved directory (`hf_dinov2`), and timm's twin gets our weights through
our timm writer (`to_timm_state_dict`). Every library returns all tokens after the final
norm (transformers: `last_hidden_state`; timm: `forward_features`). The candidates alternate
call by call after a warm-up (`timing.alternate`); the figures that carry over between
machines are the ratios of the medians.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from timing import alternate, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--patch-size", type=int, default=14)
    parser.add_argument("--registers", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    import transformers

    from vlm_vit import load_encoder
    from vlm_vit.convert.timm import build_timm_model, to_timm_state_dict

    settings = dict(hidden_size=args.width, num_hidden_layers=args.depth,
                    num_attention_heads=args.heads, image_size=args.image_size,
                    patch_size=args.patch_size, layerscale_value=1e-5)
    if args.registers:
        config = transformers.Dinov2WithRegistersConfig(num_register_tokens=args.registers,
                                                         **settings)
        model_class = transformers.Dinov2WithRegistersModel
    else:
        config, model_class = transformers.Dinov2Config(**settings), transformers.Dinov2Model
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    theirs = model_class(config).eval()
    with tempfile.TemporaryDirectory() as folder:
        theirs.save_pretrained(folder)
        ours = load_encoder(folder).eval()
    twin = build_timm_model(ours.config)
    twin.load_state_dict(to_timm_state_dict(ours.state_dict(), ours.config), strict=True)
    twin.eval()

    pixels = torch.randn(args.batch_size, 3, args.image_size, args.image_size,
                         generator=torch.Generator().manual_seed(1))
    calls = {"vlm-vit": lambda: ours(pixels).tokens,
             "transformers": lambda: theirs(pixel_values=pixels).last_hidden_state,
             "timm": lambda: twin.forward_features(pixels)}
    with torch.inference_mode():
        reference = calls["vlm-vit"]()
        difference = {name: (call() - reference).abs().max().item()
                      for name, call in calls.items() if name != "vlm-vit"}
        seconds = alternate(calls, args.repeats, warmup=args.warmup)

    result = {
        "variant": f"dinov2-l/14{'-reg' + str(args.registers) if args.registers else ''}"
        if (args.width, args.depth) == (1024, 24) else f"dinov2 {args.width}x{args.depth}",
        "batch_size": args.batch_size, "device": "cpu", "dtype": "float32",
        "settings": {**vars(args), "tokens": int(reference.shape[1]),
                     "threads": torch.get_num_threads()},
        "seconds_per_batch": seconds,
        "max_abs_difference": difference,
        "ratio_vlm_vit_over_transformers": seconds["transformers"] / seconds["vlm-vit"],
        "ratio_vlm_vit_over_timm": seconds["timm"] / seconds["vlm-vit"],
    }
    for name, value in seconds.items():
        print(f"{name:>14}: {value * 1e3:9.1f} ms per batch of {args.batch_size}")
    print(f"speed vs transformers {result['ratio_vlm_vit_over_transformers']:.3f}x, vs timm "
          f"{result['ratio_vlm_vit_over_timm']:.3f}x (max |difference| "
          f"{max(difference.values()):.1e})")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
