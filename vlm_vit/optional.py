"""Optional dependencies, imported where used, with a one-line error naming the extra; and a
package that is installed but fails to import (a torchvision built for another torch) named
as such, with its version, torch's, and what to install."""

from __future__ import annotations

import importlib
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

# torchvision's release for torch 2.N is 0.(N + 15): 2.9 -> 0.24, 2.14 -> 0.29.
_TORCHVISION_MINOR_OFFSET = 15


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Imports `module`, or raises an ImportError that says which extra to install, or which
    installed package fails to import and why.

    Args:
        module: the import name, e.g. "transformers".
        extra: the vlm-vit extra that provides it, e.g. "hf".
        purpose: what needs it, for the message.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if not isinstance(error, ModuleNotFoundError) and \
                (broken := broken_import(error)) is not None:  # present, but fails to load
            raise ImportError(f"{purpose}: {broken}") from error
        raise ImportError(
            f"{purpose} needs {module.split('.')[0]}: pip install 'vlm-vit[{extra}]' "
            f"({error})"
        ) from error
    except Exception as error:  # the package is there but its import fails
        raise ImportError(f"{purpose}: {broken_import(error) or _generic(module, error)}"
                          ) from error


def broken_import(error: BaseException) -> str | None:
    """When `error` was raised while an installed package's module ran its import, one line
    naming that package, its version, torch's, the error, and what to install; else None.

    The package is the innermost one whose module-level code is on the traceback, so a
    broken torchvision imported by timm is named as torchvision.
    """
    package = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        name = _installed_package(frame.f_code.co_filename)
        if frame.f_code.co_name == "<module>" and name is not None:
            package = name
    if package is None:
        return None
    return _generic(package, error)


def _generic(module: str, error: BaseException) -> str:
    from importlib import metadata

    package = module.split(".")[0]
    try:
        version = metadata.version(package)
    except metadata.PackageNotFoundError:
        version = "(version unknown)"
    torch = sys.modules.get("torch")
    torch_version = getattr(torch, "__version__", "not imported").split("+")[0]
    reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
    advice = f"pip install --force-reinstall '{package}'"
    if package == "torchvision" and torch_version.startswith("2."):
        minor = int(torch_version.split(".")[1]) + _TORCHVISION_MINOR_OFFSET
        advice = (f"install the torchvision built for torch {torch_version}: pip install "
                  f"'torchvision==0.{minor}.*' (with the same --index-url as torch)")
    return (f"{package} {version} is installed but fails to import with torch "
            f"{torch_version} ({reason}); it was probably built for another torch or Python: "
            f"{advice}")


def _installed_package(filename: str) -> str | None:
    """The top-level package of a file under site-packages (or dist-packages), or None."""
    parts = Path(filename).parts
    for index, part in enumerate(parts[:-1]):
        if part in ("site-packages", "dist-packages") and index + 1 < len(parts) - 1:
            return parts[index + 1]
    return None


def lazy_submodules(package: str, names: tuple[str, ...]) -> Callable[[str], Any]:
    """A package's module `__getattr__` that imports its sub-module `name` on first use
    (`vlm_vit.io.files` as an attribute), so the package itself imports nothing."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return importlib.import_module(f"{package}.{name}")

    return __getattr__
