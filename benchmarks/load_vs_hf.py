"""Checkpoint load time against Hugging Face on the same file, in one process.

    python benchmarks/load_vs_hf.py                       # clip-vit-l/14 sized, random weights
    python benchmarks/load_vs_hf.py --variant clip-vit-b/16

Writes a random `CLIPVisionModel` with transformers (safetensors), then alternates
`vlm_vit.load_encoder(dir)` and `CLIPVisionModel.from_pretrained(dir)`, after a warm-up
(so both read from the page cache), and reports the medians and their ratio.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from timing import alternate, write_json  # noqa: E402

from vlm_vit import EncoderConfig, load_encoder  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="clip-vit-l/14")
    parser.add_argument("--depth", type=int, help="fewer blocks than the variant (quick runs)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    from transformers import CLIPVisionConfig, CLIPVisionModel

    c = EncoderConfig.from_name(args.variant, **({"depth": args.depth} if args.depth else {}))
    hf_config = CLIPVisionConfig(
        hidden_size=c.width, intermediate_size=c.mlp_width, num_hidden_layers=c.depth,
        num_attention_heads=c.heads, image_size=c.image_size[0], patch_size=c.patch_size,
        hidden_act=c.act, layer_norm_eps=c.norm_eps)
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        CLIPVisionModel(hf_config).save_pretrained(directory)
        size_mb = os.path.getsize(os.path.join(directory, "model.safetensors")) / 2**20
        calls = {"vlm-vit": lambda: load_encoder(directory),
                 "transformers": lambda: CLIPVisionModel.from_pretrained(directory)}
        medians = alternate(calls, args.repeats)  # warm-up: page cache, imports
    result = {"variant": args.variant, "file_mb": round(size_mb, 1), "seconds": medians,
              "ratio_vlm_vit_over_transformers": medians["vlm-vit"] / medians["transformers"]}
    print(f"{args.variant} ({size_mb:.0f} MB safetensors), median of {args.repeats}")
    for name, seconds in medians.items():
        print(f"  {name:<13} {seconds:7.3f} s")
    print(f"  time ratio vlm-vit / transformers: {result['ratio_vlm_vit_over_transformers']:.3f}"
          " (below 1: faster)")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
