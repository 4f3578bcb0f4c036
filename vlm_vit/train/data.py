"""Moved: `vlm_vit.data.samples` (UndecodableImage, ImageBatch, the collates, mixed_seed) and
`vlm_vit.data.folders` (the image folders, Augmentation, read_caption_lines). The old names
stay importable from here for one release, with a DeprecationWarning."""

from vlm_vit.data._moved import moved_names

__getattr__ = moved_names(__name__, ("vlm_vit.data.samples", "vlm_vit.data.folders"))
