"""A LoRA fine-tuning step against a full fine-tuning step, same encoder and batch.

    python benchmarks/lora_step_vs_full.py                       # vit-b/16 at 224, batch 8, CPU
    python benchmarks/lora_step_vs_full.py --device cuda --dtype bfloat16 --batch-size 64

Image classification (a zero-initialised head on the class token), AdamW over the trainable
parameters only: every parameter for the full fine-tune; LoRA (r=16, attn_qv) and the head
for LoRA. Step times alternate in one process; peak memory is measured per mode in a child.
"""

from __future__ import annotations

import argparse

import torch
from timing import (
    add_model_arguments,
    alternate,
    autocast,
    config_from_args,
    flush_denormals,
    peak_memory_in_child,
    peak_memory_mib,
    synchronized,
    write_json,
)

from vlm_vit import VisionEncoder
from vlm_vit.adapt.finetune import ImageClassifier


def build(mode: str, args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    model = ImageClassifier(VisionEncoder(config_from_args(args)), 100)
    if mode == "lora":
        from vlm_vit.adapt.lora import apply_lora

        model = apply_lora(model, r=16, alpha=32, targets=args.targets, train_modules=("head",))
    return model.to(args.device)


def step_function(model: torch.nn.Module, args: argparse.Namespace):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    pixels = torch.randn(args.batch_size, 3, *config_from_args(args).image_size,
                         device=args.device)
    labels = torch.randint(0, 100, (args.batch_size,), device=args.device)

    def step() -> None:
        with autocast(args.device, getattr(torch, args.dtype)):
            loss = model(pixels, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return synchronized(step, args.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "vit-b/16", image_size=224)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--keep-denormals", action="store_true",
                        help="do not flush denormal floats to zero (see timing.flush_denormals)")
    parser.add_argument("--targets", default="attn_qv")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--json")
    args = parser.parse_args()
    flush_denormals(args.keep_denormals)
    if args.child:
        step = step_function(build(args.child, args), args)
        print(peak_memory_mib(lambda: (step(), step()), args.device))
        return
    steps = {mode: step_function(build(mode, args), args) for mode in ("lora", "full")}
    medians = alternate(steps, args.repeats)
    memory = {} if args.no_memory else {mode: peak_memory_in_child(__file__, [
        "--child", mode, "--variant", args.variant, "--image-size", str(args.image_size),
        "--depth", str(args.depth or 0), "--batch-size", str(args.batch_size),
        "--targets", args.targets, "--device", args.device, "--dtype", args.dtype])
        for mode in steps}
    result = {"variant": args.variant, "image_size": args.image_size,
              "depth": config_from_args(args).depth, "batch_size": args.batch_size,
              "device": args.device, "dtype": args.dtype,
              "targets": args.targets, "step_seconds": medians, "peak_memory_mib": memory,
              "time_ratio_lora_over_full": medians["lora"] / medians["full"]}
    if memory:
        result["memory_ratio_lora_over_full"] = memory["lora"] / memory["full"]
    print(f"fine-tuning step, {args.variant} at {args.image_size}, batch {args.batch_size}, "
          f"{args.device} {args.dtype}")
    for mode in steps:
        extra = f", peak memory {memory[mode]:8.0f} MiB" if memory else ""
        print(f"  {mode:<5} {medians[mode]:7.3f} s/step{extra}")
    extra = f", memory {result['memory_ratio_lora_over_full']:.3f}" if memory else ""
    print(f"  LoRA / full: time {result['time_ratio_lora_over_full']:.3f}{extra}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
