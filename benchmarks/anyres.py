"""AnyRes (LLaVA-NeXT) tiled encoding of photo-shaped images: our `VisionTower` with a
`Tiling` against transformers' `LlavaNextModel.get_image_features`, same weights and pixels.

    python benchmarks/anyres.py                          # CLIP-L/14-336 shape, 4 of 24 blocks
    python benchmarks/anyres.py --depth 24 --repeats 3   # the whole encoder (slow on a CPU)

The workload is `SIZES`: photo shapes (4:3 and 3:4 up to 1256 px, 6:5, 3:2 and 2:3) with
random pixels, tiled on LLaVA-v1.6's pinpoints (336 x 672, 672 x 336, 672 x 672, 1008 x 336,
336 x 1008) into a base view and 2-4 tiles of 336 each. The pixels are our processor's
(`ImageProcessor.tile`), checked against transformers' `LlavaNextImageProcessorPil` (the
largest difference is reported). Both sides get the same pixels: ours each image's views,
transformers' the padded `[images, most views, 3, 336, 336]` batch its processor returns.

The model is a random `LlavaNextForConditionalGeneration` (CLIP-L/14-336's vision sizes at
`--depth` blocks, `mlp2x_gelu` into `--llm-width`, a 1-layer Llama that is never run), every
weight moved off its initial value; our tower reads its vision tower through `load_tower`
and takes its projector and `image_newline`. One call encodes, projects and packs every image
(base view, tiles stitched and unpadded, a newline after each row): ours `tower(views,
image_sizes=...)`, theirs `get_image_features(...).pooler_output` (which calls
`pack_image_features`). The packed features are compared before timing.

Our tower projects only the tokens unpadding keeps (a token-wise projector commutes with the
crop); transformers projects every view's tokens, then unpads. LLaVA reads layer -2: our
encoder stops after block L-1, transformers runs all L and keeps one hidden state. At
`--depth 4` that alone saves a quarter of the blocks (1/24 of the released model), so
`ratio_per_block_run` is reported beside the headline: the speed ratio times our blocks over
theirs (it leaves the projector out, so it only roughly takes that saving out). The
candidates alternate call by call after a warm-up (`timing.alternate`); peak memory is
measured per candidate in a fresh process (`--child`), once the model is built.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from timing import alternate, peak_memory_in_child, peak_memory_mib, write_json  # noqa: E402

# (height, width) in pixels; the first N (`--images`) are a mix of orientations.
SIZES = [(950, 1256), (1256, 950), (700, 840), (640, 427), (427, 640), (1024, 768)]
PINPOINT_TILES = [(1, 2), (2, 1), (2, 2), (3, 1), (1, 3)]  # LLaVA-v1.6's, in tiles of 336
CANDIDATES = ("vlm-vit", "transformers")
TOLERANCE = 1e-4


def photos(count: int, shrink: int) -> list:
    """The first `count` of `SIZES`, sides divided by `shrink`, as random RGB images."""
    from PIL import Image

    images = []
    for height, width in SIZES[:count]:
        height, width = max(1, height // shrink), max(1, width // shrink)
        pixels = np.random.default_rng(height * 7919 + width).integers(0, 256, (height, width, 3))
        images.append(Image.fromarray(pixels.astype(np.uint8)))
    return images


def build(args):
    """transformers' LLaVA-NeXT at random (every weight moved off its init) and our tower on
    its vision weights, projector and `image_newline`."""
    import transformers

    from vlm_vit import VisionTower, load_tower
    from vlm_vit.processor import Tiling

    pinpoints = [[rows * args.tile_size, cols * args.tile_size] for rows, cols in PINPOINT_TILES]
    config = transformers.LlavaNextConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=args.width, num_hidden_layers=args.depth, num_attention_heads=args.heads,
            intermediate_size=args.mlp_width, image_size=args.tile_size,
            patch_size=args.patch_size, hidden_act="quick_gelu"),
        text_config=transformers.LlamaConfig(  # never run: only its width matters here
            hidden_size=args.llm_width, num_hidden_layers=1, num_attention_heads=1,
            num_key_value_heads=1, intermediate_size=64, vocab_size=100),
        image_grid_pinpoints=pinpoints, vision_feature_layer=-2,
        vision_feature_select_strategy="default", projector_hidden_act="gelu")
    config.vision_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    theirs = transformers.LlavaNextForConditionalGeneration(config)
    with torch.no_grad():
        for parameter in theirs.parameters():  # unit norms and zero biases hide swaps
            parameter.add_(torch.randn_like(parameter) * 0.05)
    theirs.eval()
    tiling = Tiling(pinpoints=pinpoints, tile_size=args.tile_size)
    with tempfile.TemporaryDirectory() as folder:
        theirs.model.vision_tower.save_pretrained(folder)
        loaded = load_tower(folder, "mlp2x_gelu", out_dim=args.llm_width, feature_layer=-2)
    tower = VisionTower(loaded.encoder, loaded.pooler, feature_layer=-2, tiling=tiling).eval()
    projector = theirs.model.multi_modal_projector
    tower.pooler.load_state_dict({"0.weight": projector.linear_1.weight,
                                  "0.bias": projector.linear_1.bias,
                                  "2.weight": projector.linear_2.weight,
                                  "2.bias": projector.linear_2.bias})
    with torch.no_grad():
        tower.image_newline.copy_(theirs.model.image_newline)
    return theirs, tower, tiling


def padded_batch(views: list[torch.Tensor]) -> torch.Tensor:
    """`[images, most views, 3, t, t]`, zeros after each image's views (their processor's)."""
    most = max(len(v) for v in views)
    return torch.stack([torch.cat([v, v.new_zeros(most - len(v), *v.shape[1:])])
                        for v in views])


def pixel_difference(tiling, images, views, sizes) -> float:
    """The largest difference between our views and `LlavaNextImageProcessorPil`'s batch."""
    import transformers

    tile = tiling.tile_size
    theirs = transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
        image_grid_pinpoints=[list(p) for p in tiling.pinpoints])
    out = theirs(images, return_tensors="pt")
    if out.image_sizes.tolist() != [list(size) for size in sizes]:
        raise RuntimeError(f"image sizes differ: {out.image_sizes.tolist()} against {sizes}")
    reference = out.pixel_values
    ours = padded_batch(views)
    if reference.shape != ours.shape:
        raise RuntimeError(f"their processor gives {list(reference.shape)}, ours "
                           f"{list(ours.shape)}")
    return (reference - ours).abs().max().item()


def candidate_calls(theirs, tower, views, sizes) -> dict:
    batch, image_sizes = padded_batch(views), torch.tensor(sizes)
    return {
        "vlm-vit": lambda: tower(views, image_sizes=sizes),
        "transformers": lambda: theirs.model.get_image_features(
            pixel_values=batch, image_sizes=image_sizes).pooler_output,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4, help="blocks (CLIP-L/14-336 has 24)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--mlp-width", type=int, default=4096)
    parser.add_argument("--patch-size", type=int, default=14)
    parser.add_argument("--tile-size", type=int, default=336,
                        help="the tile side; the pinpoints scale with it")
    parser.add_argument("--llm-width", type=int, default=4096, help="the projector's output")
    parser.add_argument("--images", type=int, default=len(SIZES),
                        help=f"the first N of the {len(SIZES)} sizes")
    parser.add_argument("--shrink", type=int, default=1,
                        help="divide every image side by this (toy runs)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1,
                        help="rounds before timing, besides the checking pass")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--child", choices=CANDIDATES, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if not 1 <= args.images <= len(SIZES) or args.shrink < 1:
        parser.error(f"--images must lie in [1, {len(SIZES)}] and --shrink be at least 1, got "
                     f"{args.images} and {args.shrink}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from vlm_vit.processor import NORMALIZATION, ImageProcessor

    theirs, tower, tiling = build(args)
    mean, std = NORMALIZATION["clip"]
    images = photos(args.images, args.shrink)
    views, sizes = ImageProcessor(size=args.tile_size, mean=mean, std=std,
                                  tiling=tiling).tile(images)

    with torch.inference_mode():
        calls = candidate_calls(theirs, tower, views, sizes)
        if args.child:
            print(peak_memory_mib(calls[args.child], "cpu"))
            return
        ours, reference = calls["vlm-vit"](), calls["transformers"]()
        if [len(t) for t in ours] != [len(t) for t in reference]:
            raise RuntimeError(f"token counts differ: {[len(t) for t in ours]} against "
                               f"{[len(t) for t in reference]}")
        difference = max((a - b).abs().max().item() for a, b in zip(ours, reference,
                                                                    strict=True))
        if difference > TOLERANCE:
            raise RuntimeError(f"packed features differ by {difference:.2e} > {TOLERANCE}")
        medians = alternate(calls, args.repeats, args.warmup)
    pixels = pixel_difference(tiling, images, views, sizes)

    child_arguments = [f"--{key.replace('_', '-')}={getattr(args, key)}" for key in (
        "width", "depth", "heads", "mlp_width", "patch_size", "tile_size", "llm_width",
        "images", "shrink")]
    if args.threads:
        child_arguments.append(f"--threads={args.threads}")
    memory = {} if args.no_memory else {
        name: peak_memory_in_child(__file__, ["--child", name, *child_arguments])
        for name in CANDIDATES}

    blocks = {"vlm-vit": tower.blocks_used, "transformers": args.depth}
    rates = {name: len(images) / seconds for name, seconds in medians.items()}
    ratio = rates["vlm-vit"] / rates["transformers"]
    shape = "clip-vit-l/14-336" if (args.width, args.tile_size, args.patch_size) == (
        1024, 336, 14) else f"clip {args.width}/{args.patch_size}-{args.tile_size}"
    depth = f"depth {args.depth}" + (" of 24" if shape == "clip-vit-l/14-336" else "")
    result = {
        "variant": shape,
        "settings_note": f"{depth}, {len(images)} images ({sum(len(v) for v in views)} views)",
        "device": "cpu", "dtype": "float32",
        "settings": {**vars(args), "threads": torch.get_num_threads()},
        "sizes": [list(size) for size in sizes], "views": [len(v) for v in views],
        "tokens": [len(t) for t in ours], "blocks_run": blocks,
        "seconds": medians, "images_per_second": rates,
        "peak_memory_mib": memory,
        "max_abs_difference": difference, "max_abs_pixel_difference": pixels,
        "ratio_vlm_vit_over_transformers": ratio,
        "ratio_per_block_run": ratio * blocks["vlm-vit"] / blocks["transformers"],
    }
    if memory:
        result["memory_ratio_vlm_vit_over_transformers"] = (memory["vlm-vit"]
                                                            / memory["transformers"])

    print(f"AnyRes {shape}, depth {args.depth}, {len(images)} images in "
          f"{sum(result['views'])} views of {args.tile_size} px, {sum(result['tokens'])} "
          f"tokens of width {args.llm_width}, cpu float32, {result['settings']['threads']} "
          f"threads, median of {args.repeats}")
    for name in CANDIDATES:
        extra = f", peak {memory[name]:7.0f} MiB" if memory else ""
        print(f"  {name:<13} {rates[name]:7.3f} images/s ({blocks[name]} blocks){extra}")
    print(f"  speed vs transformers {ratio:.3f}x ({result['ratio_per_block_run']:.3f}x per "
          f"block run), max |difference| {difference:.1e}, pixels {pixels:.1e}")
    if memory:
        print(f"  peak memory vs transformers "
              f"{result['memory_ratio_vlm_vit_over_transformers']:.3f}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
