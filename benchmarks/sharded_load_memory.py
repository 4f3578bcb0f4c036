"""Peak memory of loading a sharded checkpoint against the same weights in one file, ours and
transformers', each load in a fresh process.

    python benchmarks/sharded_load_memory.py                 # clip-vit-l/14, 200 MB shards
    python benchmarks/sharded_load_memory.py --variant clip-vit-b/16 --shard-size 50MB

Writes a random CLIP-shaped encoder as a Hugging Face `CLIPVisionModel` directory twice
(one `model.safetensors`; shards of `--shard-size` with their index), then, in a child
process per case, imports everything, notes the resident memory, loads, and reports the
peak resident memory above that baseline (`VmHWM - VmRSS`, Linux): `vlm_vit.load_encoder`
and `CLIPVisionModel.from_pretrained`, each on both directories. The weights' own size is
printed too, so "about the model plus one shard" can be read off.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from timing import write_json  # noqa: E402

MB = 1e6
CHILD = """
import sys, torch
def status(key):
    with open("/proc/self/status") as handle:
        return next(int(l.split()[1]) * 1024 for l in handle if l.startswith(key + ":"))
who, path = sys.argv[1], sys.argv[2]
import transformers, vlm_vit
from vlm_vit import load_encoder
from transformers import CLIPVisionModel
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as handle:  # reset VmHWM to the current RSS
    handle.write("5")
model = load_encoder(path) if who == "ours" else CLIPVisionModel.from_pretrained(path)
with torch.no_grad():  # read every weight once, as a first forward would
    for p in model.parameters():
        p.sum()
print(status("VmHWM") - before, sum(p.numel() * p.element_size() for p in model.parameters()))
"""


def peak(who: str, path: Path) -> tuple[float, float]:
    """(peak MB above the post-import baseline, the loaded weights' MB) in a fresh process."""
    result = subprocess.run([sys.executable, "-c", CHILD, who, str(path)], capture_output=True,
                            text=True, check=True)
    extra, weights = map(int, result.stdout.split()[-2:])
    return extra / MB, weights / MB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="clip-vit-l/14")
    parser.add_argument("--depth", type=int, help="fewer blocks than the variant (quick runs)")
    parser.add_argument("--shard-size", default="200MB")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if not Path("/proc/self/clear_refs").exists():
        sys.exit("needs Linux's /proc (VmHWM, clear_refs)")

    import torch

    from vlm_vit import EncoderConfig, VisionEncoder
    from vlm_vit.convert.hf_clip import save_hf_clip
    from vlm_vit.io.weights import parse_size

    config = EncoderConfig.from_name(args.variant, **({"depth": args.depth} if args.depth
                                                       else {}))
    torch.manual_seed(0)
    encoder = VisionEncoder(config)
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        single, sharded = Path(folder, "single"), Path(folder, "sharded")
        save_hf_clip(encoder, single)
        save_hf_clip(encoder, sharded, max_shard_size=args.shard_size)
        del encoder
        shards = len(list(sharded.glob("model-*-of-*.safetensors")))
        for who in ("ours", "transformers"):
            for layout, path in (("one file", single), ("sharded", sharded)):
                rows[f"{who}, {layout}"], weights = peak(who, path)
    print(f"{args.variant}: {weights:.0f} MB of weights; {shards} shards of at most "
          f"{parse_size(args.shard_size) / MB:.0f} MB")
    for name, extra in rows.items():
        print(f"  {name:<26} peak +{extra:7.0f} MB  ({extra / weights:.2f} x the weights)")
    ratio = rows["ours, sharded"] / rows["transformers, sharded"]
    print(f"  ours / transformers, sharded: {ratio:.3f}")
    write_json(args.json, {"variant": args.variant, "weights_mb": weights, "shards": shards,
                           "shard_size": args.shard_size, "peak_mb": rows,
                           "sharded_memory_ratio": ratio})


if __name__ == "__main__":
    main()
