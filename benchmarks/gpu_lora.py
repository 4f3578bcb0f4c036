"""QLoRA and LoRA on a GPU: a `vit-l/14`-sized encoder, peak memory against a bf16 full fine-tune.

    python benchmarks/gpu_lora.py --batch-size 32        # one call, a few minutes

For each mode (full bf16, LoRA bf16, QLoRA 4-bit NF4) it runs a few classification steps,
checks the 4-bit layers are in place for QLoRA, reports step time and peak GPU memory, and
for QLoRA the merge error. Exits with status 2 when no GPU is present.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from timing import write_json

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.adapt.finetune import ImageClassifier


def run(mode: str, args: argparse.Namespace) -> dict:
    from vlm_vit.adapt.lora import apply_lora, describe_trainable, merge_lora

    torch.manual_seed(0)
    model = ImageClassifier(VisionEncoder(EncoderConfig.from_name(args.variant)), 1000)
    if mode == "full":
        model = model.to("cuda", torch.bfloat16)
    else:
        model = model.to("cuda")
        model = apply_lora(model, r=16, alpha=32, targets="attn_qv", train_modules=("head",),
                           quantize=mode == "qlora")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    pixels = torch.randn(args.batch_size, 3, 224, 224, device="cuda")
    labels = torch.randint(0, 1000, (args.batch_size,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(pixels.to(torch.bfloat16) if mode == "full" else pixels,
                         labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    result = {"mode": mode, "step_seconds": statistics.median(times[2:]),
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
              "trainable": describe_trainable(model), "final_loss": loss.item()}
    if mode == "qlora":
        import bitsandbytes as bnb

        result["4bit_layers"] = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
        _, result["merge_error"] = merge_lora(model, report=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="vit-l/14")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    results = [run(mode, args) for mode in ("full", "lora", "qlora")]
    print(f"{args.variant} at 224, batch {args.batch_size}, {torch.cuda.get_device_name()}")
    for r in results:
        extra = (f", {r['4bit_layers']} 4-bit layers, merge error {r['merge_error']:.2e}"
                 if r["mode"] == "qlora" else "")
        print(f"  {r['mode']:<6} {r['step_seconds'] * 1000:7.1f} ms/step, peak "
              f"{r['peak_memory_gib']:5.1f} GiB, {r['trainable']}{extra}")
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
