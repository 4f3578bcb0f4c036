"""File I/O and integrity: atomic writes and directories, bounded JSON and weight-file readers
(`files`, `tensor_files`), sha256 manifests and sidecars (`integrity`), weight shards
(`weights`), the native directory (`native`), Hub names and the offline cache (`hub`), loading
any checkpoint (`loading`) and model cards (`card`).

Its modules load on first use (`vlm_vit.io.files` as an attribute imports it), as the
top-level package's names do; nothing is imported here.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = ('files', 'tensor_files', 'integrity', 'weights', 'native', 'hub', 'loading', 'card')


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'vlm_vit.io' has no attribute {name!r}")
    return importlib.import_module(f"vlm_vit.io.{name}")
