"""LLaVA's image features (layer -2, class token dropped) against Hugging Face, same weights.

    python benchmarks/llava_features_vs_hf.py              # clip-vit-l/14-336 shape, batch 2
    python benchmarks/llava_features_vs_hf.py --device cuda --dtype bfloat16 --batch-size 32

Hugging Face computes and keeps every layer (`output_hidden_states=True`) and reads
`hidden_states[-2]`; `feature_layers=[-2]` stops after block L-1 and keeps nothing else. The
weights are a random `CLIPVisionModel` loaded through `load_encoder`; outputs are compared.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from timing import (  # noqa: E402
    add_model_arguments,
    alternate,
    autocast,
    config_from_args,
    synchronized,
    write_json,
)

from vlm_vit import load_encoder  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "clip-vit-l/14-336")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    from transformers import CLIPVisionConfig, CLIPVisionModel

    c = config_from_args(args)
    torch.manual_seed(0)
    theirs = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=c.width, intermediate_size=c.mlp_width, num_hidden_layers=c.depth,
        num_attention_heads=c.heads, image_size=c.image_size[0], patch_size=c.patch_size,
        hidden_act=c.act, layer_norm_eps=c.norm_eps)).eval()
    with tempfile.TemporaryDirectory() as directory:
        theirs.save_pretrained(directory)
        ours = load_encoder(directory).eval()
    theirs.to(args.device)
    ours.to(args.device)
    pixels = torch.randn(args.batch_size, 3, *c.image_size, device=args.device)

    def hugging_face() -> torch.Tensor:
        return theirs(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][:, 1:]

    def vlm_vit() -> torch.Tensor:
        out = ours(pixels, feature_layers=[-2])
        return out.features[0][:, out.num_prefix_tokens:]

    with torch.inference_mode(), autocast(args.device, getattr(torch, args.dtype)):
        difference = (vlm_vit().float() - hugging_face().float()).abs().max().item()
        medians = alternate({"vlm-vit": synchronized(vlm_vit, args.device),
                             "transformers": synchronized(hugging_face, args.device)},
                            args.repeats)
    rates = {name: args.batch_size / seconds for name, seconds in medians.items()}
    result = {"variant": args.variant, "image_size": list(c.image_size), "depth": c.depth,
              "batch_size": args.batch_size, "device": args.device, "dtype": args.dtype,
              "images_per_second": rates,
              "ratio_vlm_vit_over_transformers": rates["vlm-vit"] / rates["transformers"],
              "max_abs_difference": difference}
    print(f"LLaVA features (layer -2, no class token), {args.variant} at {c.image_size[0]}, "
          f"batch {args.batch_size}, {args.device} {args.dtype}")
    for name, rate in rates.items():
        print(f"  {name:<13} {rate:7.2f} images/s")
    print(f"  ratio vlm-vit / transformers: {result['ratio_vlm_vit_over_transformers']:.3f} "
          f"(max |difference| {difference:.2e})")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
