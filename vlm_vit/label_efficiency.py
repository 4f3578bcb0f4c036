"""Deprecated: moved to `vlm_vit.recipes.label_efficiency` (the library never imports a
recipe); this name goes in the next release.

Every public name there reads from here with a DeprecationWarning that points at the
importing line.
"""

from __future__ import annotations

import warnings
from typing import Any

_NAMES = ("FinetuneJob", "FinetuneRecipe", "ShiftedImages", "finetune_accuracy",
          "finetune_many", "fingerprint", "shot_rows", "translate")


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'vlm_vit.label_efficiency' has no attribute {name!r}")
    warnings.warn(f"vlm_vit.label_efficiency moved to vlm_vit.recipes.label_efficiency; import "
                  f"{name} from there (vlm_vit.label_efficiency goes in the next release)",
                  DeprecationWarning, stacklevel=2)
    from vlm_vit.recipes import label_efficiency

    return getattr(label_efficiency, name)


def __dir__() -> list[str]:
    return list(_NAMES)
