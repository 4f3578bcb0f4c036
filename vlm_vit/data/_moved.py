"""Old import paths kept for one release: a module-level `__getattr__` that finds a name in
its new home and warns (DeprecationWarning) naming it."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any


def moved_names(old: str, homes: Sequence[str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `old`, whose names now live in `homes` (searched in order,
    so list the module that defines a name before those that import it)."""

    def __getattr__(name: str) -> Any:
        if not name.startswith("__"):
            for home in homes:
                module = importlib.import_module(home)
                if name in vars(module):
                    warnings.warn(f"{old}.{name} moved to {home}.{name}; the old path goes "
                                  "in the next release", DeprecationWarning, stacklevel=2)
                    return vars(module)[name]
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
