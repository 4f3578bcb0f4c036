"""Deployment: `torch.export` and ONNX programs with a dynamic size, int8, and their checks
(`export`); the runners and output staging (`export_runtime`).

Its modules load on first use (`vlm_vit.deploy.export` as an attribute imports it), as the
top-level package's names do; nothing is imported here.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = ('export', 'export_runtime')


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'vlm_vit.deploy' has no attribute {name!r}")
    return importlib.import_module(f"vlm_vit.deploy.{name}")
