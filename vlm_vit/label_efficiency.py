"""The old home of the label-efficiency protocol, now `vlm_vit.recipes.label_efficiency`; its
public names, kept here for one release."""

from vlm_vit.recipes.label_efficiency import (  # noqa: F401
    FinetuneJob,
    FinetuneRecipe,
    ShiftedImages,
    finetune_accuracy,
    finetune_many,
    fingerprint,
    shot_rows,
    translate,
)
