"""`vlm-vit export`: an encoder or a tower to an ONNX file, a `torch.export` program or an
ExecuTorch program, checked against eager right after export (`vlm_vit.deploy.export`,
`vlm_vit.deploy.executorch`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vlm_vit.cli.common import image_size, is_variant, reading_checkpoint, variant_or_checkpoint
from vlm_vit.commands import dtype_name


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="export an encoder or tower to ONNX or a torch.export program",
        description="Export an encoder (every token after the final norm, or --feature-layer's "
        "raw tokens) or a tower (encoder plus its pooler/projector) to an ONNX file (opset 20, "
        "checked in ONNX Runtime's CPU provider) or a torch.export program (.pt2). With "
        "--dynamic the batch, height and width are dynamic (any multiple of the patch size); "
        "else they are frozen at --image-size (default: the model's). The program is compared "
        "with eager at the export size and, when dynamic, at two sizes never seen at export; "
        "the maximum difference is printed.")
    parser.add_argument("model", metavar="MODEL", help="a checkpoint or saved tower, a model "
                        "name, or a variant name together with --random-init")
    parser.add_argument("--format", choices=["onnx", "torch-export", "executorch"],
                        required=True, help="executorch: a .pte whose vision_encoder method "
                        "(XNNPACK) takes one image at --image-size, checked in ExecuTorch's "
                        "runtime (pip install 'vlm-vit[executorch]')")
    parser.add_argument("--out", required=True, type=Path, help="the file to write (written "
                        "beside it under a temporary name, renamed into place when complete)")
    parser.add_argument("--dynamic", action="store_true",
                        help="dynamic batch, height and width")
    parser.add_argument("--image-size", type=int, nargs="+", metavar="SIDE",
                        help="export at SIDE or HEIGHT WIDTH (frozen there without --dynamic)")
    parser.add_argument("--max-side", type=int, default=4096,
                        help="with --dynamic: the largest height or width accepted (at "
                        "least the export size and 3 patches)")
    parser.add_argument("--feature-layer", type=int, action="append", dest="feature_layers",
                        metavar="K", help="an encoder's hidden-state index to return instead "
                        "of the final tokens (repeatable: concatenated; -2 for LLaVA)")
    parser.add_argument("--pooler", help="export a tower with this registered pooler (fresh "
                        "weights) in place of a checkpoint's own")
    parser.add_argument("--out-dim", type=int, help="the --pooler's output width")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "int8"], default="float32",
                        type=dtype_name,
                        help="also spelled fp32, bf16; bfloat16: bf16 weights (torch-export); "
                        "int8: ONNX Runtime's "
                        "dynamic quantization of the block Linears (onnx)")
    parser.add_argument("--random-init", action="store_true",
                        help="allow a variant name: export random weights (for testing)")
    parser.add_argument("--budget", type=int, metavar="N", help="with --format onnx: a "
                        "fixed-capacity packed program over buffers of exactly N tokens "
                        "(vlm_vit.budget.encode_budget), whose patches, positions, RoPE "
                        "angles and segments are inputs (described beside it in OUT + .json), "
                        "checked in ONNX Runtime against eager on three packings")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(run=run)


def _load(args: argparse.Namespace):
    """The model to export: an encoder, or a tower (a saved tower, or --pooler)."""
    from vlm_vit.io.loading import load_tower
    from vlm_vit.poolers import build_pooler
    from vlm_vit.tower import VisionTower

    if is_variant(args.model):
        if not args.random_init:
            raise ValueError(f"{args.model} is a variant name, not a checkpoint; to export "
                             f"random weights, add --random-init")
        encoder = variant_or_checkpoint(args.model, None)
        if args.pooler is None:
            return encoder
        pooler = build_pooler(args.pooler, in_dim=encoder.config.width, out_dim=args.out_dim)
        keep_prefix = getattr(pooler, "requires_class_token", False)
        return VisionTower(encoder, pooler, keep_prefix=keep_prefix)
    from vlm_vit.adapt.finetune import CLASSIFIER_CONFIG_NAME, HEAD_WEIGHTS_NAME

    if (Path(args.model) / CLASSIFIER_CONFIG_NAME).is_file():
        print(f"{args.model} is a classifier: exporting its encoder's "
              f"{'pooled output' if args.pooler else 'tokens'}, not its class scores "
              f"(the head in {HEAD_WEIGHTS_NAME} is left out)",
              file=sys.stderr if args.json else sys.stdout)
    with reading_checkpoint(args.model):
        from vlm_vit.io.files import read_json
        from vlm_vit.model import CONFIG_NAME

        config = Path(args.model) / CONFIG_NAME
        saved_tower = config.is_file() and "tower" in read_json(config)
        if args.pooler is not None or saved_tower:
            return load_tower(args.model, args.pooler, out_dim=args.out_dim)
        return variant_or_checkpoint(args.model, None)


def _executorch(args: argparse.Namespace, model, size, feature_layer):
    """An ExecuTorch program (`vlm_vit.deploy.executorch`): float32, one frozen size."""
    from vlm_vit.deploy.executorch import export_executorch
    from vlm_vit.deploy.export_runtime import ExportError

    if args.dynamic or args.dtype != "float32":
        raise ExportError("--format executorch writes a float32 program frozen at one size: "
                          "drop --dynamic and --dtype (give --image-size)")
    return export_executorch(model, args.out, image_size=size, feature_layer=feature_layer)


def _budget(args: argparse.Namespace) -> int:
    """`--budget N`: the fixed-capacity packed program (`vlm_vit.deploy.budget_export`)."""
    from vlm_vit.deploy.budget_export import check_budget, export_budget_onnx
    from vlm_vit.deploy.export_runtime import ExportError

    given = [flag for flag, value in (("--dynamic", args.dynamic),
                                      ("--image-size", args.image_size),
                                      ("--feature-layer", args.feature_layers),
                                      ("--pooler", args.pooler),
                                      ("--dtype", args.dtype != "float32")) if value]
    if args.format != "onnx":
        raise ExportError(f"--budget writes an ONNX program: use --format onnx, not "
                          f"{args.format}")
    if given:
        raise ExportError(f"--budget writes one float32 program of an encoder's final tokens "
                          f"for buffers of N tokens: drop {', '.join(given)}")
    model = _load(args).float().eval()
    if hasattr(model, "encoder"):
        raise ExportError(f"--budget exports an encoder's tokens; {args.model} is a tower "
                          "(export its encoder's checkpoint)")
    report = export_budget_onnx(model, args.out, tokens=check_budget(model, args.budget))
    if args.json:
        print(json.dumps({"path": str(report.path), "metadata": str(report.sidecar),
                          "tokens": report.tokens, "checks": report.checks}, indent=2))
        return 0
    print(f"wrote {report.path} (onnx, float32, buffers of {report.tokens} tokens; inputs "
          f"described in {report.sidecar})")
    for check in report.checks:
        sizes = ", ".join(f"{height}x{width}" for height, width in check["sizes"])
        print(f"  {sizes}: max |difference| vs eager encode_budget "
              f"{check['max_abs_difference']:.3g}")
    print(f"maximum difference: {report.max_abs_difference:.3g}")
    return 0


def run(args: argparse.Namespace) -> int:
    from vlm_vit.deploy.export import check_max_side, check_output, check_size, export_model

    check_output(args.out)
    if args.budget is not None:
        return _budget(args)
    size = image_size(args.image_size)
    model = _load(args).float().eval()
    encoder = getattr(model, "encoder", model)
    if size is not None:
        check_size(encoder, size)
    if args.dynamic:
        check_max_side(encoder, size or encoder.config.image_size, args.max_side, "--max-side")
    layers = args.feature_layers
    feature_layer = layers[0] if layers and len(layers) == 1 else layers
    if args.format == "executorch":
        report = _executorch(args, model, size, feature_layer)
    else:
        report = export_model(model, args.out, format=args.format, dtype=args.dtype,
                              image_size=size, dynamic=args.dynamic,
                              feature_layer=feature_layer, max_side=args.max_side)
    if args.json:
        print(json.dumps({"path": str(report.path), "format": report.format,
                          "dtype": report.dtype, "dynamic": report.dynamic,
                          "checks": report.checks}, indent=2))
        return 0
    against = "eager float32" if args.dtype != "bfloat16" else "eager bfloat16"
    print(f"wrote {report.path} ({args.format}, {args.dtype}, "
          f"{'dynamic batch, height and width' if args.dynamic else 'frozen size'})")
    for check in report.checks:
        height, width = check["size"]
        print(f"  {height}x{width} batch {check['batch']}: max |difference| vs {against} "
              f"{check['max_abs_difference']:.3g}, token cosine vs float32 "
              f"{check['cosine']:.6f}")
    print(f"maximum difference: {report.max_abs_difference:.3g}")
    return 0
