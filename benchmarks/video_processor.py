"""A clip's preprocessing, ours (`vlm_vit_llm.VideoProcessor`) against transformers'
`Qwen3VLVideoProcessor` and `Qwen2VLVideoProcessor` on the same real frames (issue 44).

    python benchmarks/video_processor.py                       # 16 frames of 480 x 640
    python benchmarks/video_processor.py --frames 8 --side 240 320

Both get the frames as PIL images and return normalised pixels: ours `[T, 3, H, W]` (the
tower patchifies inside), transformers' its flattened patches (its `patchify` is a view and a
copy, inside its time). Each video processor keeps its class defaults but
`cap_pixels_per_frame=False` (transformers 5's default). The pixels are checked equal, then
the two alternate call by call after a warm-up (medians).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from timing import add_timing_arguments, alternate, flush_denormals, write_json  # noqa: E402

FAMILIES = {"qwen3_vl": ("Qwen3VLVideoProcessor", 16), "qwen2_vl": ("Qwen2VLVideoProcessor", 14)}


def real_frames(count: int, height: int, width: int):
    """`count` frames of scikit-image's astronaut, each shifted a few pixels (a pan)."""
    import numpy as np
    from PIL import Image
    from skimage import data

    photo = Image.fromarray(data.astronaut()).resize((width, height))
    array = np.asarray(photo)
    return [Image.fromarray(np.roll(array, 4 * step, axis=1)) for step in range(count)]


def unflattened(patches: torch.Tensor, grid: list[int], patch: int) -> torch.Tensor:
    """transformers' patches (temporal patches of 2, 2 x 2 merge) as frames `[T, 3, H, W]`."""
    steps, rows, cols = grid
    x = patches.view(steps, rows // 2, cols // 2, 2, 2, 3, 2, patch, patch)
    return x.permute(0, 6, 5, 1, 3, 7, 2, 4, 8).reshape(steps * 2, 3, rows * patch,
                                                         cols * patch)


def main() -> None:
    import transformers
    from vlm_vit_llm import VideoProcessor
    from vlm_vit_llm.hf_reading import video_processor_settings

    from vlm_vit import ImageProcessor

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=16, help="an even count")
    parser.add_argument("--side", type=int, nargs=2, default=[480, 640],
                        metavar=("HEIGHT", "WIDTH"))
    add_timing_arguments(parser)
    args = parser.parse_args()
    flush_denormals(args.keep_denormals)
    if args.frames < 2 or args.frames % 2:
        parser.error(f"--frames must be an even count of at least 2, got {args.frames}")
    if min(args.side) < 32:
        parser.error(f"--side must be at least 32 pixels each, got {args.side}")
    frames = real_frames(args.frames, *args.side)
    decoder = ImageProcessor()
    result = {"frames": args.frames, "side": args.side, "device": "cpu", "dtype": "float32"}
    notes = []
    for family, (name, patch) in FAMILIES.items():
        theirs = getattr(transformers, name)(cap_pixels_per_frame=False)
        with tempfile.TemporaryDirectory() as scratch:
            theirs.save_pretrained(scratch)
            settings, path = video_processor_settings(Path(scratch))
        ours = VideoProcessor.from_transformers(settings, family, multiple=2 * patch,
                                                temporal=2, source=path)

        def run_ours(ours=ours):
            return ours(frames, decoder)

        def run_theirs(theirs=theirs):
            return theirs(videos=[frames], do_sample_frames=False, return_tensors="pt")

        mine, encoded = run_ours(), run_theirs()
        grid = encoded["video_grid_thw"][0].tolist()
        expected = unflattened(encoded["pixel_values_videos"], grid, patch)
        difference = (mine - expected).abs().max().item()
        seconds = alternate({"vlm-vit": run_ours, "transformers": run_theirs}, args.repeats,
                            warmup=args.warmup)
        ratio = seconds["transformers"] / seconds["vlm-vit"]
        result[f"speed_ratio_{family}_vlm_vit_over_transformers"] = ratio
        result[f"{family}_max_abs_difference"] = difference
        result[f"{family}_seconds"] = seconds
        result[f"{family}_output_side"] = list(mine.shape[2:])
        notes.append(f"{family} to {mine.shape[2]} x {mine.shape[3]}, max diff {difference:.1e}")
        print(f"{name}: {args.frames} frames of {args.side[0]} x {args.side[1]} to "
              f"{mine.shape[2]} x {mine.shape[3]}, median of {args.repeats}; max diff "
              f"{difference:.1e}")
        for who, value in seconds.items():
            print(f"  {who:<13} {value:7.3f} s")
        print(f"  speed ratio vlm-vit / transformers: {ratio:.3f} (above 1: faster)")
    result["variant"] = f"{args.frames} frames of {args.side[0]} x {args.side[1]}"
    result["settings_note"] = "; ".join(notes)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
