"""Deprecated: moved to the `vlm_vit.eval` package; this name goes in the next release.

Every public name of `vlm_vit.eval` reads from here with a DeprecationWarning that points at
the importing line.
"""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    from vlm_vit import eval as _eval

    if name.startswith("__") or name not in _eval.__all__:
        raise AttributeError(f"module 'vlm_vit.evaluate' has no attribute {name!r}")
    warnings.warn(f"vlm_vit.evaluate moved to vlm_vit.eval; import {name} from there "
                  f"(vlm_vit.evaluate goes in the next release)", DeprecationWarning,
                  stacklevel=2)
    return getattr(_eval, name)


def __dir__() -> list[str]:
    from vlm_vit import eval as _eval

    return list(_eval.__all__)
