"""Moved: `vlm_vit.data.shards.writer`. The old names stay importable from here for one
release, with a DeprecationWarning."""

from vlm_vit.data._moved import moved_names

__getattr__ = moved_names(__name__, ("vlm_vit.data.shards.writer",))
