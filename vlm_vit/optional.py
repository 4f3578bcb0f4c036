"""Optional dependencies, imported where used, with a one-line error naming the extra."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Imports `module`, or raises an ImportError that says which extra to install.

    Args:
        module: the import name, e.g. "transformers".
        extra: the vlm-vit extra that provides it, e.g. "hf".
        purpose: what needs it, for the message.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{purpose} needs {module.split('.')[0]}: pip install 'vlm-vit[{extra}]' "
            f"({error})"
        ) from error
