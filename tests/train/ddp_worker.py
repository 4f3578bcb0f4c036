"""One process of the two-process test: `torchrun --nproc_per_node 2 ddp_worker.py DATA RUN`.

Each rank trains the toy objective and saves its final weights as RUN/rank{RANK}.pt.
"""

import os
import sys
from pathlib import Path

import torch

from tests.train.toy import config, image_folder, toy_objective
from vlm_vit.train import Trainer


def main() -> None:
    data, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    objective = toy_objective(seed=int(os.environ["RANK"]))  # DDP must make these agree
    Trainer(objective, image_folder(data), config(steps=3), run_dir).fit()
    torch.save(objective.state_dict(), run_dir / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
