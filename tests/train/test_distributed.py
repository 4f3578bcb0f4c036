"""Data parallelism: batch sharding, and a real two-process gloo run against one process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.train.toy import config, image_folder, toy_objective, write_noise_images
from vlm_vit.train import GlobalBatchSampler, Trainer
from vlm_vit.train.distributed import split_batch

REPO = Path(__file__).resolve().parents[2]


def test_ranks_split_each_global_batch_without_padding_or_overlap():
    single = list(GlobalBatchSampler(22, 8, seed=3, epoch=1))
    assert len(single) == 2 and all(len(batch) == 8 for batch in single)
    ranks = [list(GlobalBatchSampler(22, 8, seed=3, epoch=1, rank=r, world_size=4))
             for r in range(4)]
    for b, batch in enumerate(single):
        assert sum((ranks[r][b] for r in range(4)), []) == batch
    assert list(GlobalBatchSampler(22, 8, seed=3, epoch=1, start_batch=1)) == single[1:]
    assert list(GlobalBatchSampler(22, 8, seed=3, epoch=2)) != single


def test_length_grouping_keeps_every_sample_once_and_batches_alike():
    lengths = torch.randint(1, 500, (200,), generator=torch.Generator().manual_seed(0))
    lengths[::7] *= -1  # another modality (text-only records): sorts after every positive
    plain = list(GlobalBatchSampler(200, 8, seed=1, epoch=0))
    grouped = list(GlobalBatchSampler(200, 8, seed=1, epoch=0, lengths=lengths,
                                      group_batches=5))
    assert len(grouped) == len(plain) == 25
    assert sorted(sum(grouped, [])) == sorted(sum(plain, [])) == list(range(200))

    def spread(batches):  # mean over batches of (longest - shortest) among positive lengths
        ranges = [int(lengths[b].max() - lengths[b].min()) for b in batches]
        return sum(ranges) / len(ranges)

    assert spread(grouped) < spread(plain) / 3
    mixed = sum(1 for b in grouped if (lengths[b] > 0).any() and (lengths[b] < 0).any())
    assert mixed <= 5  # at most one batch per window straddles the two modalities
    # Windows come from the seeded permutation: the same seed gives the same batches, another
    # epoch others; resuming yields the remaining ones.
    assert grouped == list(GlobalBatchSampler(200, 8, seed=1, epoch=0, lengths=lengths,
                                              group_batches=5))
    assert grouped != list(GlobalBatchSampler(200, 8, seed=1, epoch=1, lengths=lengths,
                                              group_batches=5))
    assert list(GlobalBatchSampler(200, 8, seed=1, epoch=0, lengths=lengths, group_batches=5,
                                   start_batch=3)) == grouped[3:]
    ranks = [list(GlobalBatchSampler(200, 8, seed=1, epoch=0, lengths=lengths,
                                     group_batches=5, rank=r, world_size=2)) for r in range(2)]
    assert [a + b for a, b in zip(*ranks, strict=True)] == grouped
    with pytest.raises(ValueError, match="199 lengths for 200 samples"):
        GlobalBatchSampler(200, 8, seed=1, lengths=lengths[:199])


def test_batch_must_divide_over_processes_and_micro_batches():
    assert split_batch(16, 2, 4) == (8, 2)
    with pytest.raises(ValueError, match=r"batch_size 12 .* world_size 4 x grad_accumulation 2"):
        split_batch(12, 4, 2)
    with pytest.raises(ValueError, match="fewer than one batch"):
        GlobalBatchSampler(3, 4, seed=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two processes and a rendezvous
def test_two_gloo_processes_match_one_process(tmp_path):
    write_noise_images(tmp_path / "data", 12)
    run_dir = tmp_path / "ddp"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               str(REPO / "tests" / "train" / "ddp_worker.py"), str(tmp_path / "data"),
               str(run_dir)]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]

    ranks = [torch.load(run_dir / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for name in ranks[0]:
        assert torch.equal(ranks[0][name], ranks[1][name]), name

    single = toy_objective(seed=0)
    Trainer(single, image_folder(tmp_path / "data"), config(steps=3), tmp_path / "one").fit()
    for name, value in single.state_dict().items():
        torch.testing.assert_close(ranks[0][name], value, rtol=0, atol=1e-5, msg=name)
    # Rank 0 alone wrote the metrics (one row per step) and the encoder.
    assert len((run_dir / "metrics.csv").read_text().splitlines()) == 1 + 3
    assert (run_dir / "encoder" / "model.safetensors").is_file()


def test_a_closed_failure_watch_has_left_the_store(monkeypatch):
    """`close` waits for the watch thread: one still inside a store call at interpreter exit
    aborts the process (seen once in a two-rank run under load)."""
    import datetime
    import time

    import torch.distributed as dist

    from vlm_vit.train.distributed import DistributedContext, FailureWatch

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True,
                           timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    watch = FailureWatch(DistributedContext(rank=0, world_size=2), poll_seconds=0.01)
    assert watch._thread.is_alive()
    time.sleep(0.05)  # a few polls of the store
    watch.close()
    assert not watch._thread.is_alive()
    del master
