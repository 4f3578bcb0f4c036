"""Named settings that `vlm-vit llm` offers as choices: a leaf that imports nothing, so the
command table and `--help` are built without torch (the modules that use these import them
from here)."""

# How a packed batch's loss averages: over every answer token, or per record first.
LOSS_REDUCTIONS = ("token", "record")
