"""What surrounds an exported graph (`vlm_vit.deploy.export`): its files written atomically, the
patch-grid check inside the graph and before it is run, the ONNX dims' names, and the
runners of an ONNX file and a `.pt2` program.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

PATCH_SIZE_KEY = "vlm_vit.patch_size"  # ONNX metadata, and a .pt2 extra file, read by runners
# The names of the ONNX input's and output's dims, in place of torch.export's symbols
# (`s30*s68 + 1`); None keeps a dim's own (static) size.
INPUT_DIMS = ("batch", None, "height", "width")
OUTPUT_DIMS = ("batch", "tokens")


class ExportError(ValueError):
    """A model or option that cannot be exported, said in one line."""


def add_patch_grid_check(model, patch: int) -> None:
    """Puts a patch-grid check at the head of an ONNX model (`onnx_ir.Model`): its first
    input `[B, C, H, W]` passes through a view of its patches, `(B, C, H/P, P, W/P, P)`, and
    back, a reshape that fails at run time for a side off the grid. ONNX keeps none of the
    program's input dims (`P * rows`), so without it the strided convolution would drop an
    image's last pixels without a word (36 x 44 at patch 8: 21 tokens). The view copies
    nothing and the numbers are those of the graph without it."""
    import numpy as np
    import onnx_ir as ir

    graph = model.graph
    pixels = graph.inputs[0]
    uses = list(pixels.uses())

    def step(op_type: str, inputs: list, **attributes) -> ir.Value:
        node = ir.node(op_type, inputs, attributes, name=f"patch_grid_check/{len(nodes)}")
        node.outputs[0].name = node.name
        nodes.append(node)
        return node.outputs[0]

    def constant(values: list[int]) -> ir.Value:
        return step("Constant", [], value=ir.tensor(np.array(values, dtype=np.int64)))

    nodes: list = []
    grid = step("Div", [step("Shape", [pixels], start=2, end=4), constant([patch, patch])])
    parts = step("Concat", [step("Shape", [pixels], start=0, end=2), grid, constant([patch])],
                 axis=0)  # [B, C, H/P, W/P, P]
    target = step("Gather", [parts, constant([0, 1, 2, 4, 3, 4])], axis=0)
    patches = step("Reshape", [pixels, target])  # (B, C, H/P, P, W/P, P)
    checked = step("Reshape", [patches, step("Shape", [pixels])])
    for node, index in uses:
        node.replace_input_with(index, checked)
    graph.insert_before(graph.node(0), nodes)


def check_pixels(pixel_values: torch.Tensor, patch: int) -> None:
    """A one-line ValueError where `pixel_values` `[..., H, W]` is not on the patch grid:
    what the runners check before an exported program runs."""
    height, width = pixel_values.shape[-2:]
    if height % patch or width % patch or height <= 0 or width <= 0:
        raise ValueError(f"image size {height}x{width} is not a positive multiple of the "
                         f"patch size {patch}")


def check_output(path: str | Path) -> Path:
    """`path` as a Path, or an ExportError where it is a folder (an export writes a file)."""
    path = Path(path)
    if path.is_dir():
        raise ExportError(f"the output {path} is a directory; give the file to write, such "
                          f"as {path / 'encoder.onnx'}")
    return path


def name_dims(model) -> None:
    """Names the symbolic dims of an ONNX model's (`onnx_ir.Model`) first input and output
    (`INPUT_DIMS`, `OUTPUT_DIMS`) in place of torch.export's symbols, and every other value's
    dims that carry the same symbol, so the graph's shapes stay consistent."""
    import onnx_ir as ir

    graph = model.graph
    names: dict[str, str] = {}
    for value, labels in ((graph.inputs[0], INPUT_DIMS), (graph.outputs[0], OUTPUT_DIMS)):
        for dim, label in zip(value.shape or (), labels, strict=False):
            if label is not None and isinstance(dim, ir.SymbolicDim) and dim.value:
                names.setdefault(dim.value, label)
    values = [*graph.inputs, *(out for node in graph.all_nodes() for out in node.outputs)]
    for value in values:
        if value.shape is not None and any(isinstance(dim, ir.SymbolicDim)
                                           and dim.value in names for dim in value.shape):
            value.shape = ir.Shape([ir.SymbolicDim(names[dim.value])
                                    if isinstance(dim, ir.SymbolicDim) and dim.value in names
                                    else dim for dim in value.shape])


def onnx_session(path: str | Path):
    """An ONNX Runtime session on the CPU provider, as a callable: pixels to the output.

    Pixels off the patch grid (the patch size read from the file's `PATCH_SIZE_KEY`) raise
    a one-line ValueError before the session runs.
    """
    require_onnx("onnxruntime")
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    patch = session.get_modelmeta().custom_metadata_map.get(PATCH_SIZE_KEY)

    def run(pixels: torch.Tensor) -> torch.Tensor:
        if patch is not None:
            check_pixels(pixels, int(patch))
        return torch.from_numpy(session.run(None, {name: pixels.float().numpy()})[0])

    return run


def load_program(path: str | Path):
    """A `.pt2` written by `export_model`, as a callable: pixels to the output; pixels off
    the patch grid raise a one-line ValueError before the program runs."""
    extra_files = {PATCH_SIZE_KEY: ""}
    module = torch.export.load(path, extra_files=extra_files).module()
    patch = int(extra_files[PATCH_SIZE_KEY] or 0)

    def run(pixels: torch.Tensor) -> torch.Tensor:
        if patch:
            check_pixels(pixels, patch)
        return module(pixels)

    return run


@contextlib.contextmanager
def staged_output(path: str | Path) -> Iterator[Path]:
    """A path of the same name in a private folder beside `path`, to write `path` (and an
    ONNX file's `PATH.data`) there; on success each moves onto its final name, the `.data`
    first, then the file that names it (so an ONNX file's reference to its weights holds);
    on failure `path` is left as it was. The folder and anything else in it go either way.

    Raises:
        ExportError: where `path` is a directory.
    """
    path = check_output(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield folder / path.name
        for name in (path.name + ".data", path.name):
            staged = folder / name
            if staged.is_file():
                with open(staged, "rb") as file:
                    os.fsync(file.fileno())
                os.replace(staged, path.parent / name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def require_onnx(*modules: str) -> None:
    import importlib.util

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"ONNX export needs {', '.join(missing)}: pip install "
                          f"'vlm-vit[export]'")
