"""`vlm-vit info NAME_OR_PATH`: size, cost and token counts of an encoder."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vlm_vit.cli.common import image_size, is_variant, reading_checkpoint
from vlm_vit.config import EncoderConfig, available_variants

COMMON_SIDES = (224, 336, 384, 448, 512)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "info", help="parameters, GFLOPs and token counts of a variant or checkpoint",
        description="Show the size and cost of a named variant or a checkpoint directory.")
    parser.add_argument("model", metavar="NAME_OR_PATH",
                        help=f"a variant name ({', '.join(available_variants())}), a "
                        "checkpoint of any supported format, or a model name (org/name, "
                        "hf-hub:org/name, open_clip's MODEL/TAG)")
    parser.add_argument("--image-size", type=int, nargs="+", action="append", default=None,
                        metavar="SIDE", help="a resolution to report: SIDE or HEIGHT WIDTH "
                        "(repeatable; default: native plus common sizes)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan = parser.add_argument_group("token and memory plan (vlm_vit.plan)")
    plan.add_argument("--plan", action="store_true",
                      help="per image size: the tokens an image becomes and the predicted peak "
                      "activation memory of a padded encode and of encode_budget (a "
                      "checkpoint's processor, if it has one, resizes the sizes first)")
    plan.add_argument("--budget", type=int, action="append", default=None, metavar="N",
                      help="with --plan: encode_budget buffers of N tokens (repeatable)")
    plan.add_argument("--batch", type=int, default=None, metavar="B",
                      help="with --plan: images of each size encoded together (default 1)")
    plan.add_argument("--dtype", choices=PLAN_DTYPES, default=None,
                      help="with --plan: the encoder's dtype (default float32)")
    parser.set_defaults(run=run)


PLAN_DTYPES = ("float32", "bfloat16", "float16")


def resolve_config(model: str) -> EncoderConfig:
    """The config of a variant name, a checkpoint or a model name (see `is_variant`); for a
    folder that holds none but has encoders inside (a run directory, a multimodal model),
    the error names them."""
    return resolve(model)[0]


def resolve(model: str) -> tuple[EncoderConfig, str | None]:
    """`resolve_config`, and the checkpoint format it was read as (None for a variant)."""
    if is_variant(model):
        return EncoderConfig.from_name(model), None
    from vlm_vit.io.loading import convert_checkpoint

    try:
        with reading_checkpoint(model):
            converted = convert_checkpoint(model)
            return converted.config, converted.format
    except (FileNotFoundError, ValueError) as error:
        hint = where_the_encoders_are(Path(model))
        if hint:
            raise type(error)(f"{error}; {hint}") from error
        raise


def where_the_encoders_are(directory: Path) -> str | None:
    """A hint naming the native encoders (and LoRA adapters) up to two levels inside
    `directory`, as a run directory (`encoder/`, `classifier/`) or a saved multimodal model
    (`tower/`) holds them; None when there are none or `directory` is no folder."""
    from vlm_vit.model import CONFIG_NAME, MODEL_TYPE

    if not directory.is_dir():
        return None
    encoders, adapters = [], []
    for inside in sorted([*directory.glob("*"), *directory.glob("*/*")]):
        if (inside / "adapter_config.json").is_file():
            adapters.append(inside)
        try:
            config = json.loads((inside / CONFIG_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and config.get("model_type") == MODEL_TYPE:
            encoders.append(inside)
    if encoders:
        shown = ", ".join(map(str, encoders[:4])) + (", ..." if len(encoders) > 4 else "")
        return f"the encoders inside it: {shown} (`vlm-vit info {encoders[0]}`)"
    if adapters:
        return (f"it holds the LoRA adapter {adapters[0]}; `vlm-vit merge {directory} --out DIR`"
                f" folds it into an encoder")
    return None


def _sizes(config: EncoderConfig, requested: list[list[int]] | None) -> list[tuple[int, int]]:
    if requested:
        return [image_size(size) for size in requested]
    common = [(s, s) for s in COMMON_SIDES if s % config.patch_size == 0]
    return sorted({config.image_size, *common})


# The ResNet stems the hybrid's stage counts name (BiT's R50 cut after its third stage, the
# paper's R50+ViT-B/16, section 3.1 and Table 5).
RESNET_NAMES = {(3, 4, 9): "R50"}


def mechanisms(config: EncoderConfig) -> list[str]:
    """What `config` adds to the paper's block, in words, e.g. ``["LayerScale",
    "4 registers"]``; empty for the paper's ViT. Read from the fields alone."""
    found = []
    if config.hybrid_layers is not None:
        layers = config.hybrid_layers
        resnet = RESNET_NAMES.get(layers, "ResNet")
        found.append(f"hybrid {resnet} ({','.join(map(str, layers))}) stem")
    if config.temporal_patch_size is not None:
        frames = config.temporal_patch_size
        found.append(f"Conv3d over {frames} frame{'s' if frames > 1 else ''}")
    if config.rope_theta is not None:
        reference = config.rope_reference_grid
        found.append(f"RoPE ({config.rope_frequencies}, θ={config.rope_theta:g}"
                     + (f", reference grid {reference[0]}x{reference[1]}" if reference else "")
                     + (", at patch centres" if config.rope_positions == "centered" else "")
                     + ")")
    if config.window_size is not None:
        full = config.full_attention_blocks
        found.append(f"{config.window_size}x{config.window_size} window attention"
                     + (f" (global in blocks {','.join(map(str, full))})" if full else ""))
    if config.layer_scale_init is not None:
        found.append("LayerScale")
    if config.num_register_tokens:
        count = config.num_register_tokens
        found.append(f"{count} register{'s' if count > 1 else ''}")
    if config.norm == "rmsnorm":
        found.append("RMSNorm")
    if config.mlp == "swiglu":
        found.append("SwiGLU" + (" with sub-LN" if config.mlp_norm else ""))
    if config.patch_norm:
        found.append("normed patch embeddings")
    if config.pos_embed == "none":
        found.append("no position table")
    elif config.pos_embed == "sincos":
        found.append("sin-cos positions per grid")
    elif config.pos_resize_mode == "bilinear_corners":
        found.append("position table resized with corners aligned")
    elif config.pos_resize_mode.endswith("_square_crop"):
        found.append("position table resized to a square, top-left kept")
    return found


def family(config: EncoderConfig) -> str:
    """The family whose mechanisms `config` has, in words ("DINOv2-style", "paper ViT"),
    judged from the fields (never a model name): the first rule that holds of the hybrid,
    a temporal patch embedding (with a table: Qwen3-VL), RoPE at patch centres (DINOv3), a
    normed patch embedding with SwiGLU (AIMv2), RoPE's frequency layout, LayerScale,
    pre-norm."""
    rules = [
        (config.hybrid_layers is not None, "hybrid ViT (paper 3.1)"),
        (config.temporal_patch_size is not None and config.pos_embed == "learned",
         "Qwen3-VL-style"),
        (config.temporal_patch_size is not None, "Qwen2-VL-style"),
        (config.rope_positions == "centered", "DINOv3-style"),
        (config.patch_norm and config.mlp == "swiglu", "AIMv2-style"),
        (config.rope_theta is not None and config.rope_frequencies == "alternating",
         "Pixtral-style"),
        (config.rope_theta is not None and config.pos_embed == "learned"
         and config.mlp == "swiglu", "EVA-02-style"),
        (config.rope_theta is not None, "RoPE ViT"),
        (config.pos_resize_mode.endswith("_square_crop"), "RADIO-style"),
        (config.layer_scale_init is not None, "DINOv2-style"),
        (config.pre_norm, "CLIP-style"),
    ]
    named = next((name for holds, name in rules if holds), None)
    if named is not None:
        return named
    return "ViT" if mechanisms(config) else "paper ViT"


def family_line(config: EncoderConfig) -> str:
    """`family` and `mechanisms` in one line: "DINOv2-style: LayerScale, 4 registers"."""
    found = mechanisms(config)
    return f"{family(config)}: {', '.join(found)}" if found else family(config)


def describe(config: EncoderConfig, sizes: list[tuple[int, int]]) -> dict:
    """Parameters, the family and its mechanisms (`family_line`) and, per resolution, the
    grid, token count and GFLOPs of one image."""
    import torch

    from vlm_vit.flops import count_macs
    from vlm_vit.model import VisionEncoder

    with torch.device("meta"):  # counts without allocating the weights
        parameters = sum(p.numel() for p in VisionEncoder(config).parameters())
    rows = []
    for height, width in sizes:
        macs = count_macs(config, (height, width))  # raises for a size off the patch grid
        grid = (height // config.patch_size, width // config.patch_size)
        rows.append({"image_size": [height, width], "grid": list(grid),
                     "tokens": grid[0] * grid[1] + config.num_prefix_tokens,
                     "patch_tokens": grid[0] * grid[1], "gflops": 2 * macs / 1e9})
    return {"config": config.to_dict(), "family": family(config),
            "mechanisms": mechanisms(config), "parameters": parameters, "resolutions": rows}


def _processor_of(model: str):
    """The processor saved beside a checkpoint folder's encoder, or None."""
    from vlm_vit.processor import PROCESSOR_CONFIG_NAME, ImageProcessor

    if not (Path(model) / PROCESSOR_CONFIG_NAME).is_file():
        return None
    return ImageProcessor.from_pretrained(model)


def plan_report(config: EncoderConfig, model: str, args: argparse.Namespace) -> dict:
    """`vlm_vit.plan.encode_plan` of the sizes and budgets asked, and the budgets for all
    the sizes together, as JSON-ready values."""
    import dataclasses

    import torch

    from vlm_vit.plan import budget_peak_bytes, encode_plan

    batch = 1 if args.batch is None else args.batch
    budgets = args.budget or []
    dtype = getattr(torch, args.dtype or "float32")
    processor = _processor_of(model)
    sizes = [image_size(size) for size in args.image_size] if args.image_size \
        else _sizes(config, None)
    rows = encode_plan(config, sizes, processor=processor, budgets=budgets, batch=batch,
                       dtype=dtype)
    together = []
    if len(rows) > 1:
        lengths = [row.tokens for row in rows for _ in range(batch)]
        encoded = [row.encoded_size for row in rows for _ in range(batch)]
        for plan in rows[0].budgets:
            buffers, peak = budget_peak_bytes(config, lengths, encoded, plan.capacity, dtype)
            predicted = plan.peak_bytes is not None
            together.append({"capacity": plan.capacity, "buffers": buffers,
                             "peak_bytes": peak if predicted else None})
    return {"batch": batch, "dtype": args.dtype or "float32",
            "processor": processor is not None,
            "rows": [dataclasses.asdict(row) for row in rows], "together": together}


def _bytes(count: int | None) -> str:
    if count is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def print_plan(plan: dict) -> None:
    """The plan as a table: one line per size, a column per budget (buffers x peak)."""
    rows = plan["rows"]
    first = rows[0]
    print(f"  plan: batch {plan['batch']}, {plan['dtype']}; peak = the float32 pixels given and"
          f" every tensor the encode allocates (vlm_vit.plan)")
    budgets = [budget["capacity"] for budget in first["budgets"]]
    head = f"  {'image':<12}{'encoded':<12}{'tokens':>8}{'padded peak':>14}"
    print(head + "".join(f"{f'budget {n}':>22}" for n in budgets))
    for row in rows:
        cells = [f"{row['image_size'][0]}x{row['image_size'][1]}",
                 f"{row['encoded_size'][0]}x{row['encoded_size'][1]}"]
        line = f"  {cells[0]:<12}{cells[1]:<12}{row['tokens']:>8}" \
               f"{_bytes(row['padded_peak_bytes']):>14}"
        for budget in row["budgets"]:
            line += f"{budget['buffers']:>8} x {_bytes(budget['peak_bytes']):>11}"
        print(line)
    if plan["together"]:
        tokens = sum(row["tokens"] for row in rows) * plan["batch"]
        line = f"  {'all sizes':<24}{tokens:>8}{'-':>14}"
        for budget in plan["together"]:
            line += f"{budget['buffers']:>8} x {_bytes(budget['peak_bytes']):>11}"
        print(line)
    if budgets:
        print("  (budget N: buffers of N tokens x the peak of encode_budget)")
    if first["unpredicted"]:
        print(f"  memory not predicted for {first['unpredicted']}")
    refused = first["budgets"][0]["refused"] if first["budgets"] else None
    if refused:
        print(f"  encode_budget refuses this encoder ({refused})")


def run(args: argparse.Namespace) -> int:
    if not args.plan and (args.budget or args.batch is not None or args.dtype):
        raise ValueError("--budget, --batch and --dtype go with --plan")
    if args.plan and args.batch is not None and args.batch < 1:
        raise ValueError(f"--batch must be at least 1, got {args.batch}")
    config, read_as = resolve(args.model)
    plan = plan_report(config, args.model, args) if args.plan else None
    report = describe(config, [(row["encoded_size"][0], row["encoded_size"][1])
                               for row in plan["rows"]] if plan
                      else _sizes(config, args.image_size))
    report["format"] = read_as
    if plan:
        report["plan"] = plan
    if args.json:
        print(json.dumps({"model": args.model, **report}, indent=2))
        return 0
    c = config
    print(f"{args.model}: {report['parameters']:,} parameters"
          + (f", read as {read_as}" if read_as else ""))
    print(f"  {family_line(c)}")
    print(f"  width {c.width}, depth {c.depth}, heads {c.heads}, mlp {c.mlp_width}, "
          f"patch {c.patch_size}, native {c.image_size[0]}x{c.image_size[1]}")
    print(f"  class token {'yes' if c.class_token else 'no'}, registers "
          f"{c.num_register_tokens}, pre-norm {'yes' if c.pre_norm else 'no'}, act {c.act}, "
          f"eps {c.norm_eps:g}, final norm {'yes' if c.final_norm else 'no'}")
    print(f"  {'resolution':<12}{'grid':<9}{'tokens':>8}{'GFLOPs':>10}   (GFLOPs = 2 x mult-adds)")
    for row in report["resolutions"]:
        size = "x".join(map(str, row["image_size"]))
        grid = "x".join(map(str, row["grid"]))
        print(f"  {size:<12}{grid:<9}{row['tokens']:>8}{row['gflops']:>10.1f}")
    if plan:
        print_plan(plan)
    return 0
