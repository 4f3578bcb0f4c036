"""Data: where samples come from, whatever the storage.

A folder of images and a set of tar shards are two `DataSource`s of the same samples
(`source.py`). The trainer, evaluation and the commands see batches and a source's state,
never files or shards. Importing this package loads no optional dependency.

- `samples.py`: `UndecodableImage`, `ImageBatch`, the collates, `mixed_seed`.
- `folders.py`: `ImageFolder`, `LabelledImageFolder`, `Augmentation`, caption files.
- `sampler.py`: `GlobalBatchSampler`, the resumable order of a map-style dataset.
- `shards/`: tar shards (spec, reader, decode, split, stream, writer).
- `source.py`: `DataSource`, `MapSource`, `ShardSource`, `as_source`, `open_source`.
"""

from vlm_vit.data.folders import Augmentation, ImageFolder, LabelledImageFolder
from vlm_vit.data.sampler import GlobalBatchSampler
from vlm_vit.data.samples import (
    ImageBatch,
    UndecodableImage,
    collate_images,
    collate_labelled,
    mixed_seed,
)
from vlm_vit.data.source import (
    DataSource,
    MapSource,
    ShardSource,
    SourceBatch,
    as_source,
    open_source,
    storage,
)

__all__ = ["Augmentation", "DataSource", "GlobalBatchSampler", "ImageBatch", "ImageFolder",
           "LabelledImageFolder", "MapSource", "ShardSource", "SourceBatch", "UndecodableImage",
           "as_source", "collate_images", "collate_labelled", "mixed_seed", "open_source",
           "storage"]
