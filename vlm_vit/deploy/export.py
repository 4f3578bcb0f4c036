"""Deployable graphs: `torch.export` programs and ONNX files of an encoder or a tower, with a
dynamic batch, height and width, checked against eager right after export; int8 and bf16
for CPU inference.

The encoder is traced as it is (`vlm_vit/model.py`): under export the position table is
resized inside the graph from the symbolic grid (`VisionEncoder.position_table`), so one
program serves every size on the patch grid. Measured with torch 2.14 and ONNX Runtime 1.32
(docs/export.md): `torch.export` keeps `aten._upsample_bicubic2d_aa` and matches eager
exactly; the ONNX exporter writes it as opset-20 `Resize` (cubic, `cubic_coeff_a=-0.5`,
`exclude_outside=1`, `antialias=1`), which ONNX Runtime's CPU provider computes within 2e-6
of PyTorch. Runtimes without `Resize` antialiasing need `--image-size` (a frozen size, whose
table is a constant).

Every file is written in a private folder beside its destination and renamed onto it once
complete (`staged_output`): an export that fails or is killed leaves an earlier file as it
was, and nothing else in the destination's folder is touched. A dynamic program refuses an
image off the patch grid (a `.pt2` by its input dims, an ONNX file by a check in its graph,
`add_patch_grid_check`), and so do the runners here (`onnx_session`, `load_program`), before
running, in one line naming the size and the patch.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from vlm_vit.deploy.export_runtime import (
    PATCH_SIZE_KEY,
    ExportError,
    add_patch_grid_check,
    check_output,
    load_program,
    name_dims,
    onnx_session,
    require_onnx,
    staged_output,
)
from vlm_vit.model import VisionEncoder
from vlm_vit.presets import parse_dtype

logger = logging.getLogger(__name__)

FORMATS = ("onnx", "torch-export")
# Each export dtype and the dtype its eager reference runs in (int8: float32 intermediate).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.float32}
ONNX_OPSET = 20  # Resize's antialias attribute needs opset 18 or later
PROTOBUF_LIMIT = 2 * 1024**3  # one .onnx file holds at most 2 GB; larger weights go beside it
MIN_GRID_SIDE = 2  # torch.export specialises sizes 0 and 1: a grid side of 1 is not traced
MAX_BATCH = 4096


class ExportedForward(nn.Module):
    """What an exported graph computes: pixels `[B, C, H, W]` to one tensor.

    An encoder gives every token after the final norm `[B, T, D]`, or with `feature_layer`
    the raw tokens of that hidden state (several: concatenated on the channel axis, as a
    tower does); a tower gives its pooler's output.
    """

    def __init__(self, model: nn.Module, feature_layer: int | list[int] | None = None) -> None:
        super().__init__()
        self.model = model
        self.is_tower = not isinstance(model, VisionEncoder)
        if self.is_tower and feature_layer is not None:
            raise ExportError("a tower reads its own feature layer; --feature-layer is for an "
                              "encoder")
        layers = [feature_layer] if isinstance(feature_layer, int) else feature_layer
        for layer in layers or []:
            model.layer_index(layer)  # a bad index fails here, naming the valid range
        self.layers = list(layers) if layers else None

    @property
    def encoder(self) -> VisionEncoder:
        return self.model.encoder if self.is_tower else self.model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if self.is_tower:
            return self.model(pixel_values)
        out = self.model(pixel_values, feature_layers=self.layers)
        return out.tokens if self.layers is None else torch.cat(out.features, dim=-1)


@dataclass
class ExportReport:
    """What `export_model` wrote and how it compares with eager.

    Attributes:
        path: the file written.
        format: "onnx" or "torch-export".
        dtype: "float32", "bfloat16" or "int8".
        dynamic: whether batch, height and width are dynamic.
        checks: one entry per size checked: `size` (H, W), `batch`, `max_abs_difference`
            against eager in the same dtype (float32 for int8), and `cosine` (the mean
            cosine similarity of the output tokens to eager float32).
    """

    path: Path
    format: str
    dtype: str
    dynamic: bool
    checks: list[dict] = field(default_factory=list)

    @property
    def max_abs_difference(self) -> float:
        return max(check["max_abs_difference"] for check in self.checks)


def check_size(encoder: VisionEncoder, size: tuple[int, int]) -> tuple[int, int]:
    """`size` if both sides are multiples of the patch size with a grid of at least
    `MIN_GRID_SIDE` patches a side, else an ExportError naming it."""
    patch = encoder.config.patch_size
    height, width = size
    if height % patch or width % patch or min(height, width) < MIN_GRID_SIDE * patch:
        raise ExportError(f"image size {height}x{width} is not on the patch grid: each side "
                          f"must be a multiple of the patch size {patch}, at least "
                          f"{MIN_GRID_SIDE * patch}")
    return height, width


def check_max_side(encoder: VisionEncoder, size: tuple[int, int], max_side: int,
                   name: str = "max_side") -> int:
    """`max_side` if a dynamic program can take it: at least the export size's longer side
    and `MIN_GRID_SIDE + 1` patches (torch.export needs a grid side's range to hold two
    values), else an ExportError naming `name`, the value and the smallest allowed."""
    patch = encoder.config.patch_size
    smallest = max((MIN_GRID_SIDE + 1) * patch, *size)
    if max_side < smallest:
        raise ExportError(f"{name} {max_side} is too small: with patch size {patch} and "
                          f"export size {size[0]}x{size[1]} the smallest allowed is {smallest}")
    return max_side


def dynamic_shapes(encoder: VisionEncoder, max_side: int) -> dict:
    """`torch.export` dims for `pixel_values`: any batch, and any height and width that are
    multiples of the patch size, from `MIN_GRID_SIDE` patches to `max_side` pixels."""
    from torch.export import Dim

    patch = encoder.config.patch_size
    rows = Dim("rows", min=MIN_GRID_SIDE, max=max(MIN_GRID_SIDE, max_side // patch))
    cols = Dim("cols", min=MIN_GRID_SIDE, max=max(MIN_GRID_SIDE, max_side // patch))
    batch = Dim("batch", min=1, max=MAX_BATCH)
    return {"pixel_values": {0: batch, 2: patch * rows, 3: patch * cols}}


def check_sizes(encoder: VisionEncoder, size: tuple[int, int],
                max_side: int | None = None) -> list[tuple[int, int]]:
    """The export size and two others never seen at export, both non-square: one larger
    (the table enlarged; at most `max_side`) and one smaller in height (the table shrunk,
    where antialiasing acts)."""
    patch = encoder.config.patch_size
    height, width = size
    largest = (max_side or 10**9) // patch * patch
    larger = (min(largest, height + 2 * patch), min(largest, width + 4 * patch))
    smaller = (max(MIN_GRID_SIDE * patch, (height // 2) // patch * patch), width)
    if smaller == size:
        smaller = (height, width + patch)
    return [size, larger, smaller]


def _trace_failure(forward: ExportedForward, error: Exception, what: str) -> ExportError:
    first = " ".join(str(error).split("\n", 1)[0].split()) or type(error).__name__
    if forward.is_tower:
        spec = getattr(forward.model.pooler, "pooler_spec", None) or {}
        name = spec.get("name", type(forward.model.pooler).__name__)
        return ExportError(f"the tower's pooler {name!r} cannot be traced by {what} "
                           f"({type(error).__name__}: {first})")
    return ExportError(f"the encoder cannot be traced by {what} ({type(error).__name__}: "
                       f"{first})")


@contextlib.contextmanager
def _quiet_tracing() -> Iterator[None]:
    """Holds back the tracer's own warnings and the graph it writes to stderr when a trace
    fails (the failure becomes one ExportError that carries its message); the stderr text
    goes to this module's log at DEBUG."""
    names = ("torch.fx.experimental.symbolic_shapes", "torch.export", "torch._export",
             "torch.onnx", "torch._dynamo")
    loggers = [logging.getLogger(name) for name in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)
        if held.getvalue().strip():
            logger.debug("the tracer wrote: %s", held.getvalue())


def _example(encoder: VisionEncoder, size: tuple[int, int], batch: int,
             dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch, encoder.config.in_channels, *size, generator=generator).to(dtype)


def _traceable(model: nn.Module, feature_layer, image_size, dynamic: bool, max_side: int):
    """What both exports trace: the forward wrapper, an example batch of 2 at the export
    size (checked against the patch grid) in the weights' dtype, and the dynamic shapes."""
    forward = ExportedForward(model, feature_layer).eval()
    encoder = forward.encoder
    size = check_size(encoder, image_size or encoder.config.image_size)
    example = _example(encoder, size, 2, encoder.patch_embed.proj.weight.dtype)
    if not dynamic:
        return forward, example, None
    check_max_side(encoder, size, max_side)
    return forward, example, dynamic_shapes(encoder, max_side)


def export_program(model: nn.Module, *, image_size: tuple[int, int] | None = None,
                   dynamic: bool = True, feature_layer: int | list[int] | None = None,
                   max_side: int = 4096) -> torch.export.ExportedProgram:
    """Traces an encoder or a tower with `torch.export`.

    Args:
        model: a `VisionEncoder` or a `VisionTower`, in the dtype to export.
        image_size: (H, W) traced (default: the encoder's native size).
        dynamic: batch, height and width dynamic (else frozen at batch 2 and `image_size`).
        feature_layer: for an encoder, the hidden state(s) to return instead of the tokens.
        max_side: the largest height or width the program accepts when dynamic.

    Returns:
        The program; `program.module()(pixels)` runs it.

    Raises:
        ExportError: for a size off the patch grid, or a model that cannot be traced
            (naming a tower's pooler).
    """
    forward, example, shapes = _traceable(model, feature_layer, image_size, dynamic, max_side)
    try:
        with torch.no_grad(), _quiet_tracing():
            return torch.export.export(forward, (example,), dynamic_shapes=shapes, strict=False)
    except Exception as error:
        raise _trace_failure(forward, error, "torch.export") from error


def export_onnx(model: nn.Module, path: str | Path, *, image_size: tuple[int, int] | None = None,
                dynamic: bool = True, feature_layer: int | list[int] | None = None,
                max_side: int = 4096, opset: int = ONNX_OPSET) -> Path:
    """Writes an ONNX file through `torch.onnx.export(..., dynamo=True)`: input
    `pixel_values`, output `tokens` (arguments as in `export_program`).

    Weights over 2 GB (protobuf's limit) go to `PATH.data` beside the file, which must then
    travel with it. The dims are named `batch`, `height`, `width` and `tokens`; the patch
    size is in the metadata (`PATCH_SIZE_KEY`) for `onnx_session`. Written atomically
    (`staged_output`).

    Raises:
        ExportError: as `export_program`, or for a `path` that is a directory.
        ImportError: without `onnx` and `onnxscript` (`pip install 'vlm-vit[export]'`).
    """
    with staged_output(path) as staged:
        _write_onnx(model, staged, image_size=image_size, dynamic=dynamic,
                    feature_layer=feature_layer, max_side=max_side, opset=opset)
    return Path(path)


def _write_onnx(model: nn.Module, path: Path, *, image_size, dynamic: bool, feature_layer,
                max_side: int, opset: int = ONNX_OPSET) -> None:
    """`export_onnx` without the staging: writes `path` (and `PATH.data`) directly."""
    require_onnx("onnx", "onnxscript")
    forward, example, shapes = _traceable(model, feature_layer, image_size, dynamic, max_side)
    try:
        with torch.no_grad(), _quiet_tracing():
            program = torch.onnx.export(forward, (example,), dynamo=True, dynamic_shapes=shapes,
                                        input_names=["pixel_values"], output_names=["tokens"],
                                        opset_version=opset, verbose=False)
    except Exception as error:
        raise _trace_failure(forward, error, "torch.onnx.export") from error
    name_dims(program.model)
    if dynamic:
        add_patch_grid_check(program.model, forward.encoder.config.patch_size)
    program.model.metadata_props[PATCH_SIZE_KEY] = str(forward.encoder.config.patch_size)
    size_bytes = sum(p.numel() * p.element_size() for p in forward.parameters())
    program.save(path, external_data=size_bytes > PROTOBUF_LIMIT)


def quantize_onnx_int8(source: str | Path, destination: str | Path) -> Path:
    """ONNX Runtime's dynamic quantization of the block Linears: int8 weights (per output
    channel), activations quantized per call; the patch embedding, norms and any pooler stay
    float32. `destination` is written atomically (`staged_output`), its weights beside it in
    `DESTINATION.data` where the source's are.

    Raises:
        ImportError: without `onnxruntime`.
    """
    with staged_output(destination) as staged:
        _quantize_onnx_int8(Path(source), staged)
    return Path(destination)


def _quantize_onnx_int8(source: Path, destination: Path) -> None:
    require_onnx("onnx", "onnxruntime")
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    graph = onnx.load(str(source), load_external_data=False).graph
    block_matmuls = [node.name for node in graph.node
                     if node.op_type in ("MatMul", "Gemm") and _in_blocks(node)]
    external = source.with_name(source.name + ".data").exists()  # its weights as they came
    quantize_dynamic(str(source), str(destination), weight_type=QuantType.QInt8,
                     per_channel=True, op_types_to_quantize=["MatMul", "Gemm"],
                     nodes_to_quantize=block_matmuls, use_external_data_format=external)
    logger.info("quantized %d block Linears of %s to int8", len(block_matmuls), source)


def _in_blocks(node) -> bool:
    """Whether an ONNX node comes from one of the encoder's blocks (the exporter records
    the module path in `pkg.torch.onnx.name_scopes`)."""
    scopes = {prop.key: prop.value for prop in node.metadata_props}.get(
        "pkg.torch.onnx.name_scopes", "")
    return "blocks." in scopes or "blocks." in node.name


def quantize_int8(model: nn.Module) -> nn.Module:
    """A copy of a float32 encoder or tower whose block Linears are int8 (PyTorch's dynamic
    quantization: int8 weights per tensor, activations quantized per call; the x86 backend),
    for CPU inference. The patch embedding, tables, norms and any pooler stay float32."""
    from torch.ao.quantization import quantize_dynamic

    names = {name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and ".blocks." in f".{name}"}
    return quantize_dynamic(model, names, dtype=torch.qint8, inplace=False)


def compare(run, eager: nn.Module, reference: nn.Module, sizes: list[tuple[int, int]],
            batches: list[int], in_channels: int, dtype: torch.dtype) -> list[dict]:
    """Runs `run` and eager on the same random pixels at each size.

    Returns:
        Per size: `size`, `batch`, `max_abs_difference` (against `eager`) and `cosine` (the
        mean cosine similarity of the output tokens to `reference`, eager float32).
    """
    checks = []
    for index, (size, batch) in enumerate(zip(sizes, batches, strict=True)):
        generator = torch.Generator().manual_seed(1 + index)
        pixels = torch.randn(batch, in_channels, *size, generator=generator)
        with torch.no_grad():
            got = run(pixels.to(dtype)).float()
            expected = eager(pixels.to(dtype)).float()
            exact = reference(pixels).float()
        checks.append({"size": list(size), "batch": batch,
                       "max_abs_difference": (got - expected).abs().max().item(),
                       "cosine": token_cosine(got, exact)})
    return checks


def token_cosine(tokens: torch.Tensor, reference: torch.Tensor) -> float:
    """The mean cosine similarity of `tokens` to `reference`, token by token (last axis)."""
    return torch.nn.functional.cosine_similarity(tokens.float(), reference.float(),
                                                 dim=-1).mean().item()


def export_model(model: nn.Module, path: str | Path, *, format: str = "onnx",
                 dtype: str | torch.dtype = "float32", image_size: tuple[int, int] | None = None,
                 dynamic: bool = True, feature_layer: int | list[int] | None = None,
                 max_side: int = 4096) -> ExportReport:
    """Exports and checks: the program against eager at the export size and, when dynamic,
    two sizes never seen at export (`check_sizes`), with other batch sizes. The file (and an
    ONNX file's `.data`) appears at `path` only once written and checked (`staged_output`);
    int8's float32 intermediate lives in the same private folder and goes with it.

    Args:
        model: a float32 `VisionEncoder` or `VisionTower` (cast here for `dtype`).
        path: the file to write (`.onnx`, or `.pt2` for torch-export).
        format: "onnx" (checked in ONNX Runtime's CPU provider) or "torch-export".
        dtype: a `torch.dtype` or its usual string (`vlm_vit.presets.parse_dtype`):
            float32; bfloat16 (bf16 weights; torch-export only); int8 (ONNX Runtime's
            dynamic quantization of the block Linears; onnx only).
        image_size, dynamic, feature_layer, max_side: as in `export_program`.

    Returns:
        An `ExportReport` with the differences measured.

    Raises:
        ExportError: for a format or dtype that does not go together, a size off the patch
            grid, a `max_side` below the export size, a `path` that is a directory, or a
            model that cannot be traced.
    """
    if format not in FORMATS:
        raise ExportError(f"unknown export format {format!r} (known: {', '.join(FORMATS)})")
    try:
        dtype = str(parse_dtype(dtype, tuple(DTYPES))).removeprefix("torch.")
    except ValueError as error:
        raise ExportError(str(error)) from None
    if format == "onnx" and dtype == "bfloat16":
        raise ExportError("bfloat16 ONNX does not run in ONNX Runtime's CPU provider; export "
                          "float32 (or int8), or bfloat16 with --format torch-export")
    if format == "torch-export" and dtype == "int8":
        raise ExportError("int8 export is ONNX Runtime's dynamic quantization: use --format "
                          "onnx (eager int8: vlm-vit encode --dtype int8)")
    path = check_output(path)
    reference = ExportedForward(model, feature_layer).eval()  # float32, left as it is
    eager = ExportedForward(_bfloat16_copy(model) if dtype == "bfloat16" else model,
                            feature_layer).eval()
    encoder = eager.encoder
    size = check_size(encoder, image_size or encoder.config.image_size)
    if dynamic:
        check_max_side(encoder, size, max_side)
    options = dict(image_size=size, dynamic=dynamic, feature_layer=feature_layer,
                   max_side=max_side)
    sizes = check_sizes(encoder, size, max_side) if dynamic else [size]
    batches = [2, 1, 3] if dynamic else [2]
    with staged_output(path) as staged:
        if format == "torch-export":
            program = export_program(eager.model, **options)
            torch.export.save(program, staged, extra_files={
                PATCH_SIZE_KEY: str(encoder.config.patch_size)})
            run = load_program(staged)
        else:
            if dtype == "int8":
                intermediate = staged.with_name("float32." + staged.name)
                _write_onnx(model, intermediate, **options)
                _quantize_onnx_int8(intermediate, staged)
            else:
                _write_onnx(model, staged, **options)
            run = onnx_session(staged)
        checks = compare(run, eager, reference, sizes, batches, encoder.config.in_channels,
                         DTYPES[dtype])
    report = ExportReport(path=path, format=format, dtype=dtype, dynamic=dynamic, checks=checks)
    for check in checks:
        logger.info("%s %s at %s batch %d: max |difference| %.3g, cosine %.6f", format, dtype,
                    check["size"], check["batch"], check["max_abs_difference"],
                    check["cosine"])
    return report


def _bfloat16_copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model).to(torch.bfloat16)
