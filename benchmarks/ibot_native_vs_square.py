"""One DINOv2 training step (`--objective ibot`) on native-resolution crops, packed, against
the same crops zero-padded to squares.

    python benchmarks/ibot_native_vs_square.py            # vit-s/16, batch 8, 196 + 8 x 36 tokens
    python benchmarks/ibot_native_vs_square.py --batch-size 2 --repeats 3

The crops are `MultiCrop(global_tokens=..., local_tokens=...)`'s of scikit-image's photos
(image i: `PHOTOS[i % 7]`, seed i): each crop box resized to its own aspect ratio within the
token budget (DINOv2's 224 and 96 pixels at patch 16 are 196 and 36 tokens).

- native: `MaskedSelfDistillation(packed=True)`: every view of the batch in one packed call
  per network, each on its own grid;
- padded: every view zero-padded (bottom and right, after normalisation) to the square whose
  side is its longer one, the squares batched per size (`packed=False`): what a pipeline of
  square crops computes for the same content. The padding patches are encoded like any other
  (no attention mask), as square crops would be.

Both run the same objective settings (DINOv2's: Sinkhorn-Knopp centering, K prototypes, the
same weights from seed 0) on the same masks: the block masks are drawn once on each native
global crop's grid (`batch_block_masks`, seed 0) and the padded crop gets the same mask in the
top-left corner of its square grid, so the same content patches are masked and predicted.
The losses still differ (the padded crops see padding tokens, and their position tables are
resized to the square grid), so they are reported, not compared.

A step is forward (teacher and student), loss, backward, AdamW and the EMA update, as
`ibot_step_vs_lightly.py`'s. The first step of each is a warm-up; then they alternate
(`timing.alternate`) and the figures are ratios of medians. Tokens processed: the sum over the
views of prefix plus patches (the teacher encodes the global crops a second time; that count
is `tokens_encoded_per_step`).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from ibot_step_vs_lightly import fixed_masks, ours_step, photo_views, use_masks
from timing import (
    add_model_arguments,
    alternate,
    config_from_args,
    cpu_name,
    flush_denormals,
    write_json,
)

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.data.multicrop import MultiCrop, ViewBatch
from vlm_vit.pretrain.ibot import MaskedSelfDistillation

CANDIDATES = ("native", "padded")


def padded_to_squares(views: ViewBatch) -> ViewBatch:
    """Each view zero-padded at the bottom and right to a square of its longer side."""
    def square(view: torch.Tensor) -> torch.Tensor:
        side = max(view.shape[-2:])
        return F.pad(view, (0, side - view.shape[-1], 0, side - view.shape[-2]))

    return ViewBatch([[square(view) for view in column] for column in views.global_views],
                     [[square(view) for view in column] for column in views.local_views])


def masks_in_squares(masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each `[rows, cols]` mask in the top-left corner of its square grid, False elsewhere."""
    squares = []
    for mask in masks:
        side = max(mask.shape)
        square = mask.new_zeros(side, side)
        square[:mask.shape[0], :mask.shape[1]] = mask
        squares.append(square)
    return squares


def flat(views: ViewBatch) -> list[torch.Tensor]:
    """Every view of the batch: the global crops view-major, then the local crops."""
    return [view for column in [*views.global_views, *views.local_views] for view in column]


def tokens(views: list[torch.Tensor], config: EncoderConfig) -> int:
    """The sum over `views` of prefix plus patches."""
    patch = config.patch_size
    return sum(config.num_prefix_tokens + (view.shape[-2] // patch) * (view.shape[-1] // patch)
               for view in views)


def build(config: EncoderConfig, packed: bool, args: argparse.Namespace
          ) -> MaskedSelfDistillation:
    torch.manual_seed(0)  # the same weights for both
    return MaskedSelfDistillation(
        VisionEncoder(config), prototypes=args.prototypes, head_hidden=args.head_hidden,
        head_bottleneck=args.head_bottleneck, packed=packed, steps=args.schedule_steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "vit-s/16", image_size=224)
    parser.add_argument("--batch-size", type=int, default=8, help="images per step")
    parser.add_argument("--global-tokens", type=int, default=196,
                        help="patches per global crop at most (224 px at patch 16)")
    parser.add_argument("--local-tokens", type=int, default=36,
                        help="patches per local crop at most (96 px at patch 16)")
    parser.add_argument("--local-crops", type=int, default=8)
    parser.add_argument("--prototypes", type=int, default=65536, help="the head's K")
    parser.add_argument("--head-hidden", type=int, default=2048)
    parser.add_argument("--head-bottleneck", type=int, default=256)
    parser.add_argument("--schedule-steps", type=int, default=1000,
                        help="the run length the schedules assume")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=0,
                        help="rounds before timing, besides the first step of each")
    parser.add_argument("--keep-denormals", action="store_true",
                        help="do not flush denormal floats to zero (see timing.flush_denormals)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    flush_denormals(args.keep_denormals)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = config_from_args(args)
    patch = config.patch_size

    multicrop = MultiCrop(patch_size=patch, global_tokens=args.global_tokens,
                          local_tokens=args.local_tokens, local_crops=args.local_crops)
    views = {"native": photo_views(multicrop, args.batch_size)}
    views["padded"] = padded_to_squares(views["native"])
    global_grids = [(view.shape[-2] // patch, view.shape[-1] // patch)
                    for column in views["native"].global_views for view in column]
    masks = {"native": fixed_masks(global_grids)}
    masks["padded"] = masks_in_squares(masks["native"])
    steps = {}
    for name in CANDIDATES:
        objective = build(config, name == "native", args)
        use_masks(objective, [mask.to(args.device) for mask in masks[name]])
        steps[name] = ours_step(objective.to(args.device), views[name].to(args.device), args)

    first = {name: step() for name, step in steps.items()}  # a warm-up, reported
    medians = alternate(steps, args.repeats, args.warmup)

    processed = {name: tokens(flat(views[name]), config) for name in CANDIDATES}
    encoded = {name: processed[name] + tokens(flat(ViewBatch(views[name].global_views, [])),
                                              config) for name in CANDIDATES}
    result: dict[str, Any] = {
        "variant": args.variant, "depth": config.depth, "batch_size": args.batch_size,
        "settings_note": f"{args.global_tokens} + {args.local_crops} x {args.local_tokens} "
                         f"tokens, K {args.prototypes}",
        "device": args.device, "dtype": args.dtype,
        "cpu": cpu_name(), "threads": torch.get_num_threads(), "repeats": args.repeats,
        "global_tokens": args.global_tokens, "local_tokens": args.local_tokens,
        "local_crops": args.local_crops, "prototypes": args.prototypes,
        "centering": "sinkhorn_knopp",
        "view_sizes": [list(view.shape[-2:]) for view in flat(views["native"])],
        "padded_sides": [view.shape[-1] for view in flat(views["padded"])],
        "masked_patches": sum(int(mask.sum()) for mask in masks["native"]),
        "tokens_processed": processed, "tokens_encoded_per_step": encoded,
        "token_ratio_native_over_padded": processed["native"] / processed["padded"],
        "step_seconds": medians,
        "time_ratio_native_over_padded": medians["native"] / medians["padded"],
        "speed_ratio_native_over_padded": medians["padded"] / medians["native"],
        "first_step_losses": first,
        "notes": "The same masks for both: drawn on each native global crop's grid, placed in "
                 "the top-left corner of the padded crop's square grid (the same content "
                 "patches). The losses differ: the padded crops' padding patches take part in "
                 "attention and their position tables are resized to the square grid.",
    }
    print(f"ibot step, native packed vs padded to squares, {args.variant} (depth "
          f"{config.depth}), batch {args.batch_size} x ({result['settings_note']}), "
          f"{args.device} {args.dtype}, {result['cpu']}, {result['threads']} threads, "
          f"median of {args.repeats}")
    for name in CANDIDATES:
        print(f"  {name:<7} {medians[name]:7.3f} s/step, {processed[name]:6d} tokens in "
              f"views, first loss {first[name]['loss']:.4f}")
    print(f"  token ratio native / padded: {result['token_ratio_native_over_padded']:.3f}, "
          f"speed ratio: {result['speed_ratio_native_over_padded']:.3f}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
