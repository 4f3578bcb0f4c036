"""One process of a multi-run launch: `torchrun ... cli_worker.py COMMANDS.json`.

COMMANDS.json is a list of `vlm-vit` argument lists. The process group is set up here, once,
so that one launch runs every command in turn (the trainer leaves a group it did not create
in place): each launch costs two interpreters importing torch, which on two cores is most of
a short run's time. The worker exits with the first failing command's status.
"""

import json
import sys

import torch.distributed as dist

from vlm_vit.cli import main


def run(commands: list[list[str]]) -> int:
    dist.init_process_group("gloo", init_method="env://")
    try:
        for argv in commands:
            status = main(argv)
            if status != 0:
                print(f"cli_worker: {' '.join(argv)} exited {status}", file=sys.stderr)
                return status
            dist.barrier()
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    with open(sys.argv[1]) as file:
        sys.exit(run(json.load(file)))
