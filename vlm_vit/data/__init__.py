"""Data: where samples come from, whatever the storage.

A folder of images and a set of tar shards are two `DataSource`s of the same samples
(`vlm_vit.data.source`). The trainer, evaluation and the commands see batches and a
source's state, never files or shards. Importing this package loads no optional dependency.
"""

from vlm_vit.data.source import DataSource, MapSource, ShardSource, SourceBatch, as_source

__all__ = ["DataSource", "MapSource", "ShardSource", "SourceBatch", "as_source"]
