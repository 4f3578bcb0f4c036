"""Packed encoding of differently sized images against padding with a mask, timm's NaFlexVit
and one image at a time, on identical weights and pixels.

    python benchmarks/packed_vs_padded.py --out packed.json          # vit-b/16, 64 photos, CPU
    python benchmarks/packed_vs_padded.py --variant vit-s/16 --images 16 --repeats 3

The workload is `SIZES`: 64 photo shapes (4:3 and 3:4, 16:9, 3:2, 1:1, a few 2:1 panoramas;
long side up to 448 px) with random pixels (seed 0), on randomly initialised weights, float32,
CPU, one process. One call of each candidate encodes the whole workload:

- packed: `encoder(images)`, all images as one pack (`vlm_vit.packing`, issue 15);
- one at a time: `encoder(image[None])` per image;
- padded: every image zero-padded to the largest height and width, one `[B, 3, H, W]` batch,
  padding keys masked out in SDPA; built here from the encoder's own modules (`padded_tokens`);
- naflexvit: timm's `NaFlexVit` on the same weights (`build_naflexvit`), fed by timm's own
  `Patchify` and `NaFlexCollator` (each image's patches, padded to the longest sequence), its
  attention mask made inside `forward_features` from `patch_valid`.

Before timing, each candidate's tokens (every token after the final norm, padding dropped) are
checked against one image at a time: within 1e-4, or the script stops. That pass is also the
warm-up. The candidates then alternate; the figures are ratios of medians. Peak memory is
measured per candidate in a fresh process (`--child`), once the model is built.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from timing import alternate, peak_memory_in_child, peak_memory_mib, write_json

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.flops import count_macs
from vlm_vit.layers import add_residual

# (height, width) in pixels: 16 x 4:3, 16 x 3:4, 13 x 16:9, 8 x 3:2, 8 x 1:1, 3 x 2:1, in an
# interleaved order, so the first N (`--images`) are a mix too.
SIZES = [
    (336, 448), (448, 336), (256, 448), (288, 432), (448, 448), (240, 320), (384, 288), (192, 384),
    (288, 384), (320, 240), (224, 400), (256, 384), (384, 384), (192, 256), (448, 336), (176, 320),
    (336, 448), (384, 288), (240, 432), (192, 288), (320, 320), (240, 320), (256, 192), (144, 256),
    (288, 384), (448, 336), (208, 368), (224, 336), (256, 256), (336, 448), (320, 240), (224, 448),
    (192, 256), (384, 288), (256, 448), (288, 432), (224, 224), (240, 320), (448, 336), (176, 320),
    (288, 384), (256, 192), (224, 400), (160, 240), (448, 448), (336, 448), (320, 240), (144, 256),
    (192, 256), (384, 288), (240, 432), (256, 384), (320, 320), (288, 384), (448, 336), (208, 368),
    (240, 320), (256, 192), (256, 448), (192, 288), (384, 384), (336, 448), (320, 240), (160, 320),
]
CANDIDATES = ("packed", "one at a time", "padded", "naflexvit")
TOLERANCE = 1e-4


def workload(count: int, shrink: int, patch_size: int) -> list[torch.Tensor]:
    """The first `count` of `SIZES`, each side divided by `shrink` (rounded to a multiple of
    the patch size, at least one patch), as random `[3, H, W]` images (seed 0)."""
    def side(pixels: int) -> int:
        return max(patch_size, round(pixels / shrink / patch_size) * patch_size)

    generator = torch.Generator().manual_seed(0)
    return [torch.randn(3, side(h), side(w), generator=generator) for h, w in SIZES[:count]]


# -- ours, padded to the largest image with a key-padding mask ------------------------------

def padded_tokens(encoder: VisionEncoder, images: list[torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Encodes `images` as one zero-padded batch, attention kept off the padding keys.

    Each image sits in the top-left corner of a `[3, H_max, W_max]` canvas; its own position
    table (the resize of E_pos for its grid, as `encoder(image[None])` uses) is added on its
    own grid's patches, so its valid tokens are exactly its own encoding. The padding patches
    are computed too (their queries attend to the valid keys; nobody attends to them).

    Returns:
        Tokens `[B, prefix + R * C, D]` after the final norm on the padded (R, C) grid, and
        `valid` `[B, R * C]` marking each image's own patches (row-major, like its grid).
    """
    config = encoder.config
    batch, width = len(images), config.width
    height_max = max(image.shape[1] for image in images)
    width_max = max(image.shape[2] for image in images)
    canvas = images[0].new_zeros(batch, images[0].shape[0], height_max, width_max)
    for index, image in enumerate(images):
        canvas[index, :, :image.shape[1], :image.shape[2]] = image
    x, (rows, cols) = encoder.patch_embed(canvas)  # (B, R * C, D)
    x = x.reshape(batch, rows, cols, width)
    valid = torch.zeros(batch, rows, cols, dtype=torch.bool)
    cls_entries = int(encoder.cls_token is not None)
    for index, image in enumerate(images):
        grid = encoder.patch_embed.grid(image.shape[1], image.shape[2])
        table = encoder.position_table(grid)[0, cls_entries:].reshape(*grid, width)
        x[index, :grid[0], :grid[1]] += table
        valid[index, :grid[0], :grid[1]] = True
    x, valid = x.reshape(batch, rows * cols, width), valid.reshape(batch, rows * cols)
    prefix = []  # as prepare_tokens: class token with its position entry, registers without
    if encoder.cls_token is not None:
        prefix.append(encoder.cls_token + encoder.pos_embed[:, :1])
    if encoder.reg_token is not None:
        prefix.append(encoder.reg_token)
    if prefix:
        x = torch.cat([*(p.expand(batch, -1, -1) for p in prefix), x], dim=1)
    keys = torch.cat([valid.new_ones(batch, config.num_prefix_tokens), valid], dim=1)
    key_mask = keys[:, None, None, :]  # (B, 1, 1, T): True = attend, broadcast over heads, queries
    if encoder.norm_pre is not None:
        x = encoder.norm_pre(x)
    tokens = x.shape[1]
    for block in encoder.blocks:
        attention = block.attn
        # (B, T, 3, heads, head_dim) -> (3, B, heads, T, head_dim), as the encoder's Attention
        qkv = attention.qkv(block.norm1(x)).reshape(batch, tokens, 3, attention.heads,
                                                    attention.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        x = add_residual(x, attention.proj(out.transpose(1, 2).reshape(batch, tokens, width)))
        x = add_residual(x, block.mlp(block.norm2(x)))
    if encoder.norm is not None:
        x = encoder.norm(x)
    return x, valid


def padded_per_image(tokens: torch.Tensor, valid: torch.Tensor, prefix: int
                     ) -> list[torch.Tensor]:
    """Each image's own tokens `[prefix + N_i, D]` out of a padded batch."""
    return [torch.cat([tokens[i, :prefix], tokens[i, prefix:][valid[i]]])
            for i in range(tokens.shape[0])]


# -- timm's NaFlexVit on our weights --------------------------------------------------------

def build_naflexvit(encoder: VisionEncoder) -> torch.nn.Module:
    """timm's `NaFlexVit` holding `encoder`'s weights, through timm's own `checkpoint_filter_fn`.

    That function takes timm `VisionTransformer` names, which ours are: it permutes the patch
    conv `[D, C, P, P]` into its Linear's `[D, P * P * C]` (its patches flatten channels last),
    reshapes E_pos to a `[1, rows, cols, D]` grid and folds the class token's position entry
    into `cls_token` (NaFlexVit gives prefix tokens no position). Its per-image resize of the
    grid is `F.interpolate(bicubic, align_corners=False, antialias=True)`, ours' method; the
    configuration below passes ours explicitly.

    Raises:
        ValueError: for an encoder NaFlexVit's standard block cannot express.
    """
    from timm.models.naflexvit import NaFlexVit, NaFlexVitCfg, checkpoint_filter_fn

    config = encoder.config
    unsupported = [name for name, ok in (("pre_norm", not config.pre_norm),
                                         ("act", config.act == "gelu"),
                                         ("norm_eps", config.norm_eps == 1e-6),
                                         ("patch_bias", config.patch_bias)) if not ok]
    if unsupported:
        raise ValueError(f"NaFlexVit's standard ViT cannot express {config}: {unsupported}")
    cfg = NaFlexVitCfg(
        patch_size=config.patch_size, embed_dim=config.width, depth=config.depth,
        num_heads=config.heads, mlp_ratio=config.mlp_width / config.width,
        qkv_bias=config.qkv_bias, class_token=config.class_token,
        reg_tokens=config.num_register_tokens, pos_embed="learned",
        pos_embed_grid_size=config.grid, pos_embed_interp_mode=config.pos_resize_mode,
        pos_embed_antialias=config.pos_resize_antialias, embed_proj_type="linear",
        final_norm=config.final_norm, fc_norm=False,
        global_pool="token" if config.class_token else "avg")
    model = NaFlexVit(cfg, in_chans=config.in_channels, num_classes=0)
    # clone: checkpoint_filter_fn adds into state_dict["cls_token"] in place
    state = checkpoint_filter_fn({k: v.clone() for k, v in encoder.state_dict().items()}, model)
    model.load_state_dict(state, strict=True)
    return model.eval()


def naflexvit_inputs(images: list[torch.Tensor], patch_size: int) -> dict[str, torch.Tensor]:
    """timm's NaFlex input pipeline: `Patchify` per image, `NaFlexCollator` to the longest.

    Returns:
        `patches` `[B, N_max, P * P * C]`, `patch_coord` `[B, N_max, 2]` (row, col) and
        `patch_valid` `[B, N_max]`.
    """
    from timm.data.naflex_dataset import NaFlexCollator
    from timm.data.naflex_transforms import Patchify

    patchify = Patchify(patch_size)
    samples = [(patchify(image), 0) for image in images]
    longest = max(sample["patches"].shape[0] for sample, _ in samples)
    batch, _ = NaFlexCollator(max_seq_len=longest)(samples)  # default would cut at 576
    return {name: batch[name] for name in ("patches", "patch_coord", "patch_valid")}


def naflexvit_tokens(model: torch.nn.Module, images: list[torch.Tensor], patch_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """NaFlexVit's tokens after the final norm `[B, prefix + N_max, D]` and `patch_valid`."""
    inputs = naflexvit_inputs(images, patch_size)
    out = model.forward_features(**inputs)
    return out["patches"], inputs["patch_valid"]


# -- the figures ----------------------------------------------------------------------------

def padding_waste(config: EncoderConfig, images: list[torch.Tensor],
                  padded_size: tuple[int, int]) -> float:
    """The share of multiply-adds spent on padding when every image costs `padded_size`.

    Per block, a sequence of T tokens costs T (4 D^2 + 2 D M) in its Linears and 2 T^2 D in
    attention (q k^T and the weighted sum of v), plus N C P^2 D for the patch embedding
    (`vlm_vit.flops.count_macs`); so waste = 1 - sum_i macs(T_i) / (B * macs(T_padded)).
    """
    useful = sum(count_macs(config, tuple(image.shape[1:])) for image in images)
    return 1 - useful / (len(images) * count_macs(config, padded_size))


def max_difference(tokens: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(tokens, reference, strict=True))


def build(args: argparse.Namespace) -> tuple[EncoderConfig, VisionEncoder, list[torch.Tensor]]:
    torch.manual_seed(0)
    overrides = {"depth": args.depth} if args.depth else {}
    config = EncoderConfig.from_name(args.variant, **overrides)
    encoder = VisionEncoder(config).eval()
    return config, encoder, workload(args.images, args.shrink, config.patch_size)


def candidate_calls(names: list[str], encoder: VisionEncoder,
                    naflexvit: torch.nn.Module | None, images: list[torch.Tensor]
                    ) -> dict[str, Callable[[], object]]:
    """One call per candidate in `names`, each encoding the whole workload."""
    patch_size = encoder.config.patch_size
    calls: dict[str, Callable[[], object]] = {}
    if "packed" in names:
        calls["packed"] = lambda: encoder(images)
    if "one at a time" in names:
        calls["one at a time"] = lambda: [encoder(image[None]) for image in images]
    if "padded" in names:
        calls["padded"] = lambda: padded_tokens(encoder, images)
    if "naflexvit" in names:
        calls["naflexvit"] = lambda: naflexvit_tokens(naflexvit, images, patch_size)
    return calls


def check_candidates(encoder: VisionEncoder, naflexvit: torch.nn.Module,
                     calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Every candidate's per-image tokens against `encoder(image[None])`, max |difference|.

    Also NaFlexVit alone on two images at the encoder's native size, where no position
    resize is involved. Beyond `TOLERANCE` there (or for packed or padded) the script stops:
    the candidates would not be the same model.
    """
    prefix = encoder.num_prefix_tokens
    reference = [out.tokens[0] for out in calls["one at a time"]()]
    difference = {}
    if "packed" in calls:
        packed = calls["packed"]()
        expected = [tokens.shape[0] for tokens in reference]
        if list(packed.lengths) != expected:
            raise RuntimeError(f"packed lengths {packed.lengths} != per-image {expected}")
        difference["packed"] = max_difference([out.tokens[0] for out in packed.split()],
                                               reference)
    difference["padded"] = max_difference(padded_per_image(*calls["padded"](), prefix),
                                          reference)
    tokens, valid = calls["naflexvit"]()
    difference["naflexvit"] = max_difference(padded_per_image(tokens, valid, prefix), reference)
    native = list(torch.randn(2, 3, *encoder.config.image_size,
                              generator=torch.Generator().manual_seed(1)))
    tokens, valid = naflexvit_tokens(naflexvit, native, encoder.config.patch_size)
    difference["naflexvit_native"] = max_difference(
        padded_per_image(tokens, valid, prefix), [encoder(image[None]).tokens[0]
                                                  for image in native])
    for name in ("padded", "naflexvit_native", "packed"):
        if difference.get(name, 0.0) > TOLERANCE:
            raise RuntimeError(f"{name} differs from one image at a time by "
                               f"{difference[name]:.2e} > {TOLERANCE}: not the same encoding")
    return difference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="vit-b/16")
    parser.add_argument("--depth", type=int, help="fewer blocks than the variant (quick runs)")
    parser.add_argument("--images", type=int, default=len(SIZES),
                        help=f"the first N of the {len(SIZES)} sizes (quick runs)")
    parser.add_argument("--shrink", type=int, default=1,
                        help="divide every side by this (toy runs)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=0,
                        help="rounds before timing, besides the checking pass (which warms up)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--child", choices=CANDIDATES, help=argparse.SUPPRESS)
    parser.add_argument("--json", "--out", dest="json", help="also write the results here")
    args = parser.parse_args()
    if not 1 <= args.images <= len(SIZES) or args.shrink < 1:
        parser.error(f"--images must lie in [1, {len(SIZES)}] and --shrink be at least 1, got "
                     f"{args.images} and {args.shrink}")
    if args.threads:
        torch.set_num_threads(args.threads)
    names = list(CANDIDATES)
    config, encoder, images = build(args)

    with torch.inference_mode():
        if args.child:
            naflexvit = build_naflexvit(encoder) if args.child == "naflexvit" else None
            call = candidate_calls([args.child], encoder, naflexvit, images)[args.child]
            print(peak_memory_mib(call, "cpu"))
            return
        naflexvit = build_naflexvit(encoder)
        calls = candidate_calls(names, encoder, naflexvit, images)
        difference = check_candidates(encoder, naflexvit, calls)
        medians = alternate(calls, args.repeats, args.warmup)
        inputs = [time.perf_counter()]
        for _ in range(3):  # the share of NaFlexVit's time that is its patchify and collate
            naflexvit_inputs(images, config.patch_size)
            inputs.append(time.perf_counter())
        input_seconds = statistics.median(b - a for a, b in itertools.pairwise(inputs))

    child_arguments = ["--variant", args.variant, "--depth", str(args.depth or 0), "--images",
                       str(args.images), "--shrink", str(args.shrink)]
    if args.threads:
        child_arguments += ["--threads", str(args.threads)]
    memory = {} if args.no_memory else {
        name: peak_memory_in_child(__file__, ["--child", name, *child_arguments])
        for name in names}

    p = config.patch_size
    lengths = [config.num_prefix_tokens + (h // p) * (w // p) for _, h, w in
               (image.shape for image in images)]
    height_max = max(image.shape[1] for image in images)
    width_max = max(image.shape[2] for image in images)
    longest = max(lengths) - config.num_prefix_tokens  # NaFlexVit pads to the longest sequence
    # A 1 x N grid costs what any N-patch image costs (count_macs sees only the counts).
    padded_sizes = {"padded": (height_max, width_max), "naflexvit": (p, p * longest)}
    processed = {"packed": sum(lengths), "one at a time": sum(lengths),
                 "padded": len(images) * (config.num_prefix_tokens
                                          + (height_max // p) * (width_max // p)),
                 "naflexvit": len(images) * max(lengths)}
    rates = {name: len(images) / seconds for name, seconds in medians.items()}
    result = {
        "variant": args.variant, "depth": config.depth, "batch_size": len(images),
        "device": "cpu", "dtype": "float32", "threads": torch.get_num_threads(),
        "repeats": args.repeats, "sizes": [list(image.shape[1:]) for image in images],
        "packs": 1,
        "tokens": sum(lengths), "tokens_processed": {n: processed[n] for n in names},
        "padded_grid": [height_max // p, width_max // p], "naflexvit_sequence": max(lengths),
        "seconds": medians, "images_per_second": rates,
        "tokens_per_second": {name: sum(lengths) / seconds for name, seconds in medians.items()},
        "peak_memory_mib": memory,
        "padding_waste_share": {name: padding_waste(config, images, size)
                                for name, size in padded_sizes.items()},
        "max_abs_difference": difference,
        "naflexvit_input_seconds": input_seconds,
    }
    for other, key in (("naflexvit", "naflexvit"), ("one at a time", "one_at_a_time"),
                       ("padded", "padded")):
        result[f"ratio_packed_over_{key}"] = rates["packed"] / rates[other]
        if memory:
            result[f"memory_ratio_packed_over_{key}"] = memory["packed"] / memory[other]

    print(f"{args.variant} (depth {config.depth}), {len(images)} images, {sum(lengths)} tokens, "
          f"cpu float32, {result['threads']} threads, median of {args.repeats}")
    for name in names:
        waste = result["padding_waste_share"].get(name)
        extra = f", {waste:.0%} of MACs on padding" if waste is not None else ""
        extra += f", peak {memory[name]:7.0f} MiB" if memory else ""
        extra += f", max |difference| {difference[name]:.1e}" if name in difference else ""
        print(f"  {name:<14} {rates[name]:7.2f} images/s {result['tokens_per_second'][name]:9.0f} "
              f"tokens/s{extra}")
    print(f"  naflexvit at the native {config.image_size[0]}x{config.image_size[1]}: max "
          f"|difference| {difference['naflexvit_native']:.1e}; its patchify + collate "
          f"{input_seconds * 1e3:.0f} ms a call")
    for key in [k for k in result if k.startswith(("ratio_", "memory_ratio_"))]:
        print(f"  {key}: {result[key]:.3f}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
