"""One process of the strategy tests: `torchrun ... strategy_worker.py DATA RUN [options]`.

Trains the toy objective with the given strategy; rank 0's export leaves RUN/objective.pt.
Run without torchrun, it is the same run on one process.
"""

import argparse
import os
from pathlib import Path

import torch

from tests.train.toy import config, image_folder, toy_objective
from vlm_vit.train import Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data", type=Path)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--grad-checkpointing", action="store_true")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--cpu-offload", action="store_true")
    parser.add_argument("--grad-accumulation", type=int, default=1)
    parser.add_argument("--fail-rank", type=int, default=None, help="raises at its 2nd step")
    parser.add_argument("--kill-in-save", type=int, default=None, metavar="STEP",
                        help="rank 0 SIGKILLs itself while saving STEP's checkpoint, after "
                        "every rank wrote its shards")
    args = parser.parse_args()
    if args.kill_in_save is not None:
        kill_in_save(args.kill_in_save)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    crash = 2 if args.fail_rank == rank else None
    objective = toy_objective(seed=rank, crash_at_call=crash)  # the strategy must make these agree
    settings = config(steps=args.steps, checkpoint_every=args.checkpoint_every,
                      keep_checkpoints=0, strategy=args.strategy, precision=args.precision,
                      grad_checkpointing=args.grad_checkpointing, batch_size=args.batch_size,
                      cpu_offload=args.cpu_offload, grad_accumulation=args.grad_accumulation)
    Trainer(objective, image_folder(args.data), settings, args.run_dir,
            progress=False).fit(resume=args.resume)


def kill_in_save(step: int) -> None:
    import signal

    import vlm_vit.train.sharded_checkpoint as sharded

    original = sharded.save_checkpoint

    def save_checkpoint(state, path):
        if state["step"] == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(state, path)

    sharded.save_checkpoint = save_checkpoint


if __name__ == "__main__":
    main()
