"""What the step benchmarks against lightly share: scikit-image's photos (ibot's too), the
arguments, the models on one set of weights, our step, and the comparison itself (the first
step checked, the candidates alternated, peak memory in a fresh process per library, the
figures printed and written)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from timing import (
    alternate,
    autocast,
    config_from_args,
    cpu_name,
    flush_denormals,
    peak_memory_in_child,
    peak_memory_mib,
    synchronized,
    write_json,
)

LIBRARIES = ("vlm-vit", "lightly")
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field",
          "immunohistochemistry", "retina")
# Relative agreement of the first step's loss: the same weights in two libraries differ only
# in the order of float32 sums.
LOSS_TOLERANCE = 1e-4


def side_of(config) -> int:
    size = config.image_size
    return size if isinstance(size, int) else size[0]


def photos(count: int, side: int) -> torch.Tensor:
    """`count` of scikit-image's photos (image i: `PHOTOS[i % 7]`), `[count, 3, side, side]`,
    normalised to about zero mean."""
    from skimage import data

    images = []
    for index in range(count):
        pixels = torch.as_tensor(getattr(data, PHOTOS[index % len(PHOTOS)])())
        pixels = pixels[..., None].expand(-1, -1, 3) if pixels.ndim == 2 else pixels[..., :3]
        image = pixels.permute(2, 0, 1)[None].float() / 255.0
        images.append(F.interpolate(image, size=(side, side), mode="bilinear",
                                    antialias=True)[0])
    return (torch.stack(images) - 0.5) / 0.25


def add_comparison_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=8, help="images per step")
    parser.add_argument("--schedule-steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1,
                        help="rounds before timing, besides the checked first step")
    parser.add_argument("--keep-denormals", action="store_true",
                        help="do not flush denormal floats to zero (see timing.flush_denormals)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--child", choices=LIBRARIES, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results to this file")


def compare(args: argparse.Namespace, script: str, name: str, settings_note: str,
            steps_for: Callable[[tuple[str, ...], argparse.Namespace],
                                dict[str, Callable[[], float]]],
            child_arguments: list[str]) -> None:
    """Runs the comparison of `script` (see the module docstring), or, as a `--child`, one
    library's peak memory."""
    args.depth = args.depth or None  # the children pass 0 for the variant's depth
    flush_denormals(args.keep_denormals)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        step = steps_for((args.child,), args)[args.child]
        print(peak_memory_mib(lambda: (step(), step()), args.device))
        return
    steps = steps_for(LIBRARIES, args)
    first = {library: step() for library, step in steps.items()}  # the check, a warm-up
    difference = abs(first["vlm-vit"] - first["lightly"]) / max(abs(first["lightly"]), 1e-12)
    if difference > LOSS_TOLERANCE:
        raise RuntimeError(f"first-step losses differ by {difference:.2e} (relative) > "
                           f"{LOSS_TOLERANCE}: {first}")
    medians = alternate(steps, args.repeats, args.warmup)
    memory = {} if args.no_memory else {
        library: peak_memory_in_child(script, ["--child", library, *child_arguments])
        for library in LIBRARIES}
    config = config_from_args(args)
    result: dict[str, Any] = {
        "variant": args.variant, "depth": config.depth, "batch_size": args.batch_size,
        "settings_note": settings_note, "device": args.device, "dtype": args.dtype,
        "cpu": cpu_name(), "threads": torch.get_num_threads(), "repeats": args.repeats,
        "first_step_losses": first, "loss_relative_difference": difference,
        "loss_tolerance": LOSS_TOLERANCE, "step_seconds": medians,
        "speed_ratio_vlm_vit_over_lightly": medians["lightly"] / medians["vlm-vit"],
        "peak_memory_mib": memory,
    }
    if memory:
        result["memory_ratio_vlm_vit_over_lightly"] = memory["vlm-vit"] / memory["lightly"]
    print(f"{name}, {args.variant} (depth {config.depth}), batch {args.batch_size} "
          f"({settings_note}), {args.device} {args.dtype}, {result['cpu']}, "
          f"{result['threads']} threads, median of {args.repeats}")
    print(f"  first step: loss {first['vlm-vit']:.6f} (ours) vs {first['lightly']:.6f} "
          f"(lightly), relative difference {difference:.1e}")
    for library in LIBRARIES:
        extra = f", peak memory {memory[library]:8.0f} MiB" if memory else ""
        print(f"  {library:<8} {medians[library]:7.3f} s/step{extra}")
    print(f"  speed ratio vlm-vit / lightly: {result['speed_ratio_vlm_vit_over_lightly']:.3f}"
          + (f", memory ratio {result['memory_ratio_vlm_vit_over_lightly']:.3f}"
             if memory else ""))
    write_json(args.json, result)


def model_arguments(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """The child's arguments: the model's, then `--name value` for each of `names`."""
    arguments = ["--variant", args.variant, "--image-size", str(args.image_size),
                 "--depth", str(args.depth or 0), "--device", args.device,
                 "--dtype", args.dtype]
    for name in ("batch_size", "schedule_steps", *names):
        arguments += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return arguments


def timm_and_ours(config) -> tuple[torch.nn.Module, torch.nn.Module]:
    """lightly's `MaskedVisionTransformerTIMM` around a timm `VisionTransformer` of `config`
    (seed 0), and our `VisionEncoder` holding its weights, read through our timm converter
    after the wrapper has re-initialised them."""
    import os
    import tempfile

    from lightly.models.modules import MaskedVisionTransformerTIMM

    from vlm_vit import load_encoder
    from vlm_vit.convert.timm import build_timm_model
    from vlm_vit.io.files import write_safetensors

    torch.manual_seed(0)
    vit = build_timm_model(config)
    backbone = MaskedVisionTransformerTIMM(vit=vit, pos_embed_initialization="skip")
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "timm.safetensors")
        write_safetensors({k: v.contiguous() for k, v in vit.state_dict().items()}, path)
        return backbone, load_encoder(path, heads=config.heads)


def ours_step(objective: torch.nn.Module, images: torch.Tensor, masks: list[Any],
              args: argparse.Namespace, **adamw: float) -> Callable[[], float]:
    """A step of ours as the trainer takes it, on fixed masks: forward, backward, AdamW
    (`adamw`'s options), `after_optimizer_step`."""
    objective.train()
    optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad],
                                  **adamw)
    dtype, done = getattr(torch, args.dtype), [0]

    def step() -> float:
        with autocast(args.device, dtype):
            out = objective(images, masks=masks)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        objective.after_optimizer_step(done[0], args.schedule_steps)
        done[0] += 1
        return float(out.loss.detach())

    return synchronized(step, args.device)
