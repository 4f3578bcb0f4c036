"""Two "machines" on this one: `torchrun --nnodes 2 --nproc_per_node 1` with a c10d
rendezvous on localhost runs `vlm-vit pretrain` on shards to the end, and trains the same
encoder as `--nnodes 1 --nproc_per_node 2`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_config
from tests.train.test_distributed import free_port
from tests.train.toy import write_shards
from vlm_vit import VisionEncoder, load_encoder

REPO = Path(__file__).resolve().parents[2]


def pretrain(tmp_path: Path, out: Path) -> list[str]:
    return ["-m", "vlm_vit.cli", "pretrain", "--objective", "mae", str(tmp_path / "start"),
            "--data", str(tmp_path / "shards"), "--out", str(out),
            "--batch-size", "4", "--num-workers", "1", "--steps", "4", "--checkpoint-every",
            "2", "--decoder-width", "32", "--decoder-depth", "1", "--strategy", "fsdp",
            "--quiet"]


@pytest.mark.slow
def test_two_nodes_of_one_process_train_as_one_node_of_two(tmp_path):
    write_shards(tmp_path / "shards", 4, 4)
    torch.manual_seed(0)
    VisionEncoder(tiny_config()).save_pretrained(tmp_path / "start")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run"]

    one_node = subprocess.run(
        [*torchrun, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
         str(free_port()), *pretrain(tmp_path, tmp_path / "one")],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert one_node.returncode == 0, one_node.stderr[-3000:]

    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen(
        [*torchrun, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes", "--node-rank", str(node),
         *pretrain(tmp_path, tmp_path / "two")],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in range(2)]
    try:
        outputs = [node.communicate(timeout=180) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (_, stderr) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, stderr[-3000:]

    two, one = (load_encoder(tmp_path / run / "encoder").state_dict() for run in ("two", "one"))
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, rtol=0, atol=1e-6, msg=name)
    # Both nodes' processes wrote their shards of the checkpoints.
    step = tmp_path / "two" / "checkpoints" / "step_00000004"
    assert {p.name for p in step.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
