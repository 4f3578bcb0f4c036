"""One process of the two-process shard test:
`torchrun --nproc_per_node 2 ddp_shards_worker.py SHARD_SPEC RUN_DIR STEPS`.

Each rank trains the toy objective on the shards with 2 DataLoader workers, logging every
sample's key to RUN_DIR/samples/rank_R.tsv.
"""

import sys

import torch

from tests.train.test_tar_shards import decode
from tests.train.toy import config, toy_objective
from vlm_vit.data.shards import ShardStream
from vlm_vit.train import Trainer


def main() -> None:
    spec, run_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    Trainer(toy_objective(), ShardStream(spec, decode(), seed=3),
            config(steps=steps, num_workers=2, log_samples=True, checkpoint_every=0),
            run_dir, progress=False).fit()


if __name__ == "__main__":
    main()
