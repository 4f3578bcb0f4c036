"""CPU inference after export: eager float32, ONNX Runtime float32, bf16 and int8, each
against timm's eager in the same dtype on identical weights.

    python benchmarks/export_cpu.py --variant vit-b/16 --batch-size 1
    python benchmarks/export_cpu.py --variant clip-vit-l/14-336 --batch-size 8 --repeats 3

Candidates alternate call by call after a warm-up (`timing.alternate`); the figures that
carry over between machines are the ratios of medians. bf16 runs under CPU autocast (fast
only where the CPU has AVX512-BF16 or AMX; the CPU is named in the output). int8 is the block
Linears quantized dynamically (PyTorch's for both libraries; ONNX Runtime's for the ONNX
file). Accuracy is the mean token cosine to float32 on scikit-image's photos (random weights:
the weights are not downloaded).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from anchors import build_anchor
from timing import alternate, config_from_args, cpu_name, write_json

from vlm_vit import VisionEncoder
from vlm_vit.deploy.export import (
    export_onnx,
    onnx_session,
    quantize_int8,
    quantize_onnx_int8,
    token_cosine,
)


def photos(size: tuple[int, int]) -> torch.Tensor:
    from PIL import Image
    from skimage import data

    from vlm_vit import ImageProcessor

    processor = ImageProcessor.for_family("imagenet", size=size)
    return processor([Image.fromarray(getattr(data, name)())
                      for name in ("astronaut", "coffee", "chelsea", "rocket")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="vit-b/16")
    parser.add_argument("--image-size", type=int)
    parser.add_argument("--depth", type=int)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = config_from_args(args)
    ours = VisionEncoder(config).eval()
    timm_model, timm_call = build_anchor("timm", ours)
    timm_model.eval()
    ours_int8 = quantize_int8(ours)
    timm_int8 = quantize_int8(timm_model)
    pixels = torch.randn(args.batch_size, 3, *config.image_size)
    with tempfile.TemporaryDirectory() as scratch:
        onnx_path = export_onnx(ours, os.path.join(scratch, "e.onnx"), dynamic=True)
        quantize_onnx_int8(onnx_path, os.path.join(scratch, "q.onnx"))
        ort_fp32 = onnx_session(onnx_path)
        ort_int8 = onnx_session(os.path.join(scratch, "q.onnx"))

        def bf16(call):
            def run():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return call(pixels)
            return run

        calls = {
            "ours float32": lambda: ours(pixels),
            "timm float32": lambda: timm_call(pixels),
            "onnxruntime float32": lambda: ort_fp32(pixels),
            "ours bf16": bf16(ours),
            "timm bf16": bf16(timm_call),
            "ours int8": lambda: ours_int8(pixels),
            "timm int8": lambda: timm_int8.forward_features(pixels),
            "onnxruntime int8": lambda: ort_int8(pixels),
        }
        with torch.inference_mode():
            medians = alternate(calls, args.repeats, args.warmup)
            real = photos(config.image_size)
            exact = ours(real).tokens
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast = ours(real).tokens
            cosine = {"bf16 autocast": token_cosine(autocast, exact),
                      "int8 (PyTorch)": token_cosine(ours_int8(real).tokens, exact),
                      "int8 (ONNX Runtime)": token_cosine(ort_int8(real), exact),
                      "onnxruntime float32": token_cosine(ort_fp32(real), exact)}
            ort_difference = (ort_fp32(real) - exact).abs().max().item()
    rates = {name: args.batch_size / seconds for name, seconds in medians.items()}
    result = {
        "variant": args.variant, "image_size": list(config.image_size),
        "depth": config.depth, "batch_size": args.batch_size, "device": "cpu",
        "cpu": cpu_name(), "threads": torch.get_num_threads(), "repeats": args.repeats,
        "images_per_second": rates, "token_cosine_on_photos": cosine,
        "onnxruntime_max_abs_difference": ort_difference,
        "ratio_onnxruntime_over_ours_float32": rates["onnxruntime float32"]
        / rates["ours float32"],
        "ratio_ours_over_timm_float32": rates["ours float32"] / rates["timm float32"],
        "ratio_ours_over_timm_bf16": rates["ours bf16"] / rates["timm bf16"],
        "ratio_ours_over_timm_int8": rates["ours int8"] / rates["timm int8"],
        "ratio_onnxruntime_int8_over_ours_float32": rates["onnxruntime int8"]
        / rates["ours float32"],
    }
    print(f"{args.variant} at {config.image_size[0]}, batch {args.batch_size}, "
          f"{result['cpu']}, {result['threads']} threads, median of {args.repeats}")
    for name, rate in rates.items():
        print(f"  {name:<22}{rate:9.3f} images/s")
    for name, value in result.items():
        if name.startswith("ratio_"):
            print(f"  {name:<44}{value:7.3f}")
    for name, value in cosine.items():
        print(f"  token cosine to float32, {name:<22}{value:.6f}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
