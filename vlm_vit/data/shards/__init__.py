"""WebDataset tar shards: a second storage of the same samples as an image folder.

- `spec.py`: shard specs (patterns, globs, lists, folders, URLs) and the `dataset.json` index.
- `reader.py`: raw `Sample`s, bounded and named, nothing unpickled.
- `decode.py`: a `Sample` into what the folder datasets return.
- `split.py`: held-out keys, a rank's shards.
- `stream.py`: `ShardStream`, the endless, exactly resumable stream the trainer reads.
- `reshard.py`: a stream's checkpoint remapped onto other ranks and workers.
- `writer.py`: `write_shards` (`vlm-vit shards`), beside the reader.
"""

from vlm_vit.data.shards.decode import ImageDecode, LabelledBatches, LabelledDecode
from vlm_vit.data.shards.reader import (
    Sample,
    ShardProblems,
    escape_name,
    iter_samples,
    read_shard,
    unescape_name,
)
from vlm_vit.data.shards.spec import expand_shards, is_shard_spec, read_dataset_index
from vlm_vit.data.shards.split import KeySplit, held_out, rank_shards
from vlm_vit.data.shards.stream import ShardStream, StreamBatch, StreamState

__all__ = ["ImageDecode", "KeySplit", "LabelledBatches", "LabelledDecode", "Sample",
           "ShardProblems", "ShardStream", "StreamBatch", "StreamState", "escape_name",
           "expand_shards", "held_out", "is_shard_spec", "iter_samples", "rank_shards",
           "read_dataset_index", "read_shard", "unescape_name"]
