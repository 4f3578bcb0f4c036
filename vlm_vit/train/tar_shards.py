"""Moved: tar shards live in `vlm_vit.data.shards` (spec, reader, decode, split, stream), the
sample log in `vlm_vit.train.metrics`. The old names stay importable from here for one
release, with a DeprecationWarning."""

from vlm_vit.data._moved import moved_names

__getattr__ = moved_names(__name__, (
    "vlm_vit.data.samples", "vlm_vit.data.shards.spec", "vlm_vit.data.shards.reader",
    "vlm_vit.data.shards.decode", "vlm_vit.data.shards.split", "vlm_vit.data.shards.stream",
    "vlm_vit.train.metrics"))
