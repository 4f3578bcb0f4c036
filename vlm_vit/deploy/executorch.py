"""ExecuTorch programs: an encoder or a tower as a `.pte` file whose `vision_encoder` method
takes pixels `[B, C, H, W]` to its output (a tower's: the projected tokens, already in the
decoder's embedding space), the linear algebra delegated to XNNPACK, for the runners of
ExecuTorch's multimodal pipeline on phones.

    from vlm_vit.deploy.executorch import export_executorch, executorch_runner

    report = export_executorch(tower, "tower.pte", image_size=(336, 336))
    tokens = executorch_runner("tower.pte")(pixels)      # ExecuTorch's own runtime

A program holds one size and one batch (1 by default), frozen at export: the position table
is then a constant. Checked against eager in ExecuTorch's runtime right after export, before
the file appears at its path (`staged_output`). Needs `pip install 'vlm-vit[executorch]'`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from vlm_vit.deploy.export import (
    ExportedForward,
    ExportReport,
    _quiet_tracing,
    _trace_failure,
    check_size,
    compare,
)
from vlm_vit.deploy.export_runtime import ExportError, check_output, staged_output

logger = logging.getLogger(__name__)

METHOD = "vision_encoder"  # the method name ExecuTorch's multimodal runner calls
MAX_BATCH = 64


def require_executorch() -> None:
    import importlib.util

    if importlib.util.find_spec("executorch") is None:
        raise ImportError("ExecuTorch export needs executorch: pip install "
                          "'vlm-vit[executorch]'")


def export_executorch(model: nn.Module, path: str | Path, *,
                      image_size: tuple[int, int] | None = None,
                      feature_layer: int | list[int] | None = None,
                      batch: int = 1) -> ExportReport:
    """Writes `model` as an ExecuTorch program with one method, `vision_encoder`, lowered to
    XNNPACK, and checks it in ExecuTorch's runtime against eager.

    Args:
        model: a float32 `VisionEncoder` or `VisionTower`.
        path: the `.pte` file to write.
        image_size: the (H, W) the program takes (default: the encoder's native size).
        feature_layer: for an encoder, the hidden state(s) to return instead of the tokens.
        batch: the images per call the program takes (1 to `MAX_BATCH`).

    Raises:
        ExportError: for a size off the patch grid, a batch out of range, a `path` that is a
            directory, or a model that cannot be traced or lowered.
    """
    require_executorch()
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    path = check_output(path)
    if not 1 <= batch <= MAX_BATCH:
        raise ExportError(f"batch must be 1 to {MAX_BATCH}, got {batch}")
    forward = ExportedForward(model, feature_layer).eval()
    encoder = forward.encoder
    size = check_size(encoder, image_size or encoder.config.image_size)
    generator = torch.Generator().manual_seed(0)
    example = torch.randn(batch, encoder.config.in_channels, *size, generator=generator)
    try:
        with torch.no_grad(), _quiet_tracing(), _frozen_position_table(encoder, size):
            program = torch.export.export(forward, (example,), strict=False)
            lowered = to_edge_transform_and_lower({METHOD: program},
                                                  partitioner=[XnnpackPartitioner()])
            buffer = lowered.to_executorch().buffer
    except Exception as error:
        raise _trace_failure(forward, error, "ExecuTorch") from error
    with staged_output(path) as staged:
        staged.write_bytes(buffer)
        checks = compare(executorch_runner(staged), forward, forward, [size], [batch],
                         encoder.config.in_channels, torch.float32)
    report = ExportReport(path=path, format="executorch", dtype="float32", dynamic=False,
                          checks=checks)
    logger.info("executorch at %s batch %d: max |difference| %.3g", size, batch,
                report.max_abs_difference)
    return report


@contextlib.contextmanager
def _frozen_position_table(encoder: nn.Module, size: tuple[int, int]) -> Iterator[None]:
    """Within the block the encoder's position table for `size` is a constant, computed here
    in eager: ExecuTorch has no kernel for the antialiased resize the traced table would need
    at another size than the native one."""
    if getattr(encoder, "pos_embed", None) is None:
        yield
        return
    patch = encoder.config.patch_size
    with torch.no_grad():
        table = encoder.position_table((size[0] // patch, size[1] // patch)).detach().clone()
    encoder.position_table = lambda grid: table  # an instance attribute over the method
    try:
        yield
    finally:
        del encoder.position_table


def executorch_runner(path: str | Path):
    """A `.pte` written by `export_executorch`, run by ExecuTorch's runtime, as a callable:
    pixels to the output. Pixels of another shape than the program's raise a one-line
    ValueError before it runs."""
    require_executorch()
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(Path(path))
    if METHOD not in program.method_names:
        raise ValueError(f"{path}: no {METHOD!r} method (it has {sorted(program.method_names)})")
    method = program.load_method(METHOD)
    expected = tuple(method.metadata.input_tensor_meta(0).sizes())

    def run(pixels: torch.Tensor) -> torch.Tensor:
        if tuple(pixels.shape) != expected:
            raise ValueError(f"{path} takes pixels of shape {expected} (frozen at export), "
                             f"got {tuple(pixels.shape)}")
        return method.execute([pixels.contiguous().float()])[0]

    return run
