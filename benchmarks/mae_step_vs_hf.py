"""One MAE pretraining step against Hugging Face's `ViTMAEForPreTraining`, same sizes.

    python benchmarks/mae_step_vs_hf.py                    # vit-b/16 at 224, batch 8, CPU
    python benchmarks/mae_step_vs_hf.py --device cuda --dtype bfloat16 --batch-size 64
    python benchmarks/mae_step_vs_hf.py --compile   # also ours under torch.compile

A step is forward, backward and an AdamW update, with the same mask ratio (0.75), decoder
(512 wide, 8 blocks, 16 heads) and norm_pix_loss. The two alternate in one process after a
warm-up; medians are reported with their ratio. With `--compile`, a third candidate is
ours compiled in place as `TrainConfig(compile=True)` does (`module.compile()`), against the
same transformers step run eagerly; its compilation happens in the warm-up, untimed. Peak
memory is measured per library in a child process (the CUDA allocator's peak on a GPU; on a
CPU the growth of the resident set's high-water mark, reset through /proc/self/clear_refs, so
Linux only).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from timing import (  # noqa: E402
    add_model_arguments,
    alternate,
    autocast,
    config_from_args,
    flush_denormals,
    peak_memory_in_child,
    peak_memory_mib,
    write_json,
)

from vlm_vit import EncoderConfig, VisionEncoder  # noqa: E402
from vlm_vit.pretrain.mae import MaskedAutoencoder  # noqa: E402


def build(library: str, c: EncoderConfig):
    torch.manual_seed(0)
    if library == "vlm-vit":
        return MaskedAutoencoder(VisionEncoder(c), mask_ratio=0.75)
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    return ViTMAEForPreTraining(ViTMAEConfig(
        hidden_size=c.width, num_hidden_layers=c.depth, num_attention_heads=c.heads,
        intermediate_size=c.mlp_width, image_size=c.image_size[0], patch_size=c.patch_size,
        decoder_hidden_size=512, decoder_num_hidden_layers=8, decoder_num_attention_heads=16,
        decoder_intermediate_size=2048, mask_ratio=0.75, norm_pix_loss=True,
        layer_norm_eps=c.norm_eps))


def step_function(library: str, model, pixels: torch.Tensor, dtype: torch.dtype):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    device_type = pixels.device.type

    def step() -> float:
        with autocast(device_type, dtype):
            out = model(pixels) if library == "vlm-vit" else model(pixel_values=pixels)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        if device_type == "cuda":
            torch.cuda.synchronize()
        return out.loss.item()

    return step


def peak_memory(args: argparse.Namespace, library: str) -> float:
    """Peak memory in MiB of two steps, measured in a fresh child process."""
    return peak_memory_in_child(__file__, [
        "--child", library, "--variant", args.variant, "--image-size", str(args.image_size),
        "--depth", str(args.depth or 0), "--batch-size", str(args.batch_size),
        "--device", args.device, "--dtype", args.dtype])


def child(args: argparse.Namespace, dtype: torch.dtype) -> None:
    model = build(args.child, args.config).to(args.device)
    pixels = torch.randn(args.batch_size, 3, *args.config.image_size, device=args.device)
    step = step_function(args.child, model, pixels, dtype)
    print(peak_memory_mib(lambda: (step(), step()), args.device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "vit-b/16", image_size=224)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--keep-denormals", action="store_true",
                        help="do not flush denormal floats to zero (see timing.flush_denormals)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--compile", action="store_true",
                        help="also time ours under torch.compile (TrainConfig.compile)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    flush_denormals(args.keep_denormals)
    dtype = getattr(torch, args.dtype)
    args.config = config_from_args(args)
    if args.child:
        child(args, dtype)
        return

    pixels = torch.randn(args.batch_size, 3, *args.config.image_size, device=args.device)
    steps = {name: step_function(name, build(name, args.config).to(args.device), pixels, dtype)
             for name in ("vlm-vit", "transformers")}
    if args.compile:
        compiled = build("vlm-vit", args.config).to(args.device)
        compiled.compile()  # in place, as the trainer does
        steps["vlm-vit compiled"] = step_function("vlm-vit", compiled, pixels, dtype)
    medians = alternate(steps, args.repeats, warmup=2 if args.compile else 1)
    result = {"variant": args.variant, "image_size": args.image_size, "depth": args.config.depth,
              "batch_size": args.batch_size, "device": args.device, "dtype": args.dtype,
              "step_seconds": medians,
              "time_ratio_vlm_vit_over_transformers": medians["vlm-vit"] / medians["transformers"],
              "speed_ratio_vlm_vit_over_transformers":
                  medians["transformers"] / medians["vlm-vit"]}
    if args.compile:
        result["speed_ratio_vlm_vit_compiled_over_transformers"] = \
            medians["transformers"] / medians["vlm-vit compiled"]
    if not args.no_memory:
        result["peak_memory_mib"] = {name: peak_memory(args, name)
                                     for name in ("vlm-vit", "transformers")}
    print(f"MAE step, {args.variant} at {args.image_size}, batch {args.batch_size}, "
          f"{args.device} {args.dtype}, median of {args.repeats}")
    for name, seconds in medians.items():
        memory = result.get("peak_memory_mib", {}).get(name)
        extra = f", peak memory {memory:8.0f} MiB" if memory is not None else ""
        print(f"  {name:<13} {seconds:7.3f} s/step{extra}")
    print(f"  time ratio vlm-vit / transformers: "
          f"{result['time_ratio_vlm_vit_over_transformers']:.3f} (below 1: faster)")
    if args.compile:
        print(f"  speed ratio vlm-vit compiled / transformers eager: "
              f"{result['speed_ratio_vlm_vit_compiled_over_transformers']:.3f}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
