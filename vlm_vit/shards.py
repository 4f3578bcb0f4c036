"""Deprecated: renamed `vlm_vit.weights` (weight sharding); this name goes in the next release.

Every name of `vlm_vit.weights` reads from here with a DeprecationWarning that points at the
importing line.
"""

from __future__ import annotations

import warnings
from typing import Any

import vlm_vit.weights as _weights


def __getattr__(name: str) -> Any:
    value = getattr(_weights, name)  # an unknown name raises AttributeError, as before
    warnings.warn(f"vlm_vit.shards is renamed vlm_vit.weights; import {name} from there "
                  f"(vlm_vit.shards goes in the next release)", DeprecationWarning,
                  stacklevel=2)
    return value


def __dir__() -> list[str]:
    return dir(_weights)
