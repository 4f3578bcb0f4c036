"""The "fsdp" strategy (FSDP2) and its distributed checkpoints, on gloo over CPU processes.

The slow tests launch `tests/train/strategy_worker.py` under torchrun: the toy objective
(deterministic: no dropout), 12 noise images, global batch 6, so the same global batches
reach the model at 1, 2 or 3 processes and a run's weights do not depend on their number
beyond float rounding.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.train.test_consolidate import (
    DEPTH,
    Held,
    assert_bit_equal,
    block_bytes,
    encoder_state,
    live_encoder,
)
from tests.train.test_distributed import free_port
from tests.train.toy import config, image_folder, toy_objective, write_noise_images
from vlm_vit import load_encoder
from vlm_vit.train import Trainer, fsdp, sharded_checkpoint
from vlm_vit.train import checkpoint as ckpt
from vlm_vit.train.config import TrainConfig
from vlm_vit.train.consolidate import consolidate

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "train" / "strategy_worker.py"
STEPS = 4


def launch(processes: int, data: Path, run_dir: Path, *options: str,
           timeout: float = 150) -> subprocess.CompletedProcess:
    """The worker under torchrun on `processes` processes (or directly, for 1)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                str(processes), "--master_addr", "127.0.0.1", "--master_port",
                str(free_port())] if processes > 1 else [sys.executable]
    return subprocess.run([*launcher, str(WORKER), str(data), str(run_dir),
                           "--steps", str(STEPS), "--batch-size", "6", *options],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def trained(run_dir: Path) -> dict[str, torch.Tensor]:
    """The objective's final weights: its export, or for a sharded run (which writes only
    `encoder/`, one block at a time) the final checkpoint read into a whole objective, checked
    against that `encoder/`."""
    if (run_dir / "objective.pt").is_file():
        return torch.load(run_dir / "objective.pt", weights_only=True)
    objective = toy_objective(seed=5)
    sharded_checkpoint.load_weights(ckpt.latest_checkpoint(run_dir), objective)
    exported = load_encoder(run_dir / "encoder").state_dict()
    for name, value in objective.encoder.state_dict().items():
        assert torch.equal(exported[name], value), name
    return objective.state_dict()


def losses(run_dir: Path) -> list[float]:
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    column = rows[0].split(",").index("loss")
    return [float(row.split(",")[column]) for row in rows[1:]]


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)


def resume_from_step(run_dir: Path, copy: Path, step: int) -> Path:
    """A copy of a finished run with only the checkpoints up to `step`: resuming it retrains
    the rest."""
    shutil.copytree(run_dir, copy)
    for found, path in ckpt.list_checkpoints(copy):
        if found > step:
            shutil.rmtree(path)
    return copy


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted DDP run and an FSDP2 run (checkpoints at steps 2 and 4), 2 processes."""
    root = tmp_path_factory.mktemp("strategies")
    write_noise_images(root / "data", 12)
    for strategy in ("ddp", "fsdp"):
        done = launch(2, root / "data", root / strategy, "--strategy", strategy,
                      "--checkpoint-every", "2")
        assert done.returncode == 0, done.stderr[-3000:]
    return root


@pytest.mark.slow
def test_fsdp_and_ddp_give_the_same_losses_and_weights(runs):
    assert_same_weights(trained(runs / "fsdp"), trained(runs / "ddp"), atol=1e-5)
    torch.testing.assert_close(losses(runs / "fsdp"), losses(runs / "ddp"), rtol=0, atol=1e-5)
    # Each rank wrote its own shards of every checkpoint, each with its hash.
    step = runs / "fsdp" / "checkpoints" / "step_00000002"
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "trainer.pt"):
        assert (step / name).is_file() and (step / f"{name}.sha256").is_file(), name
    # The sharded run's encoder was written from its final checkpoint, a block at a time, into
    # one weight file (it is under the usual shard size; issue 47).
    assert not (runs / "fsdp" / "objective.pt").exists()
    assert (runs / "fsdp" / "encoder" / "model.safetensors").is_file()
    assert not (runs / "fsdp" / "encoder" / "model.safetensors.index.json").exists()


@pytest.mark.slow
def test_a_distributed_checkpoint_resumes_bit_exactly_at_the_same_size(runs, tmp_path):
    run = resume_from_step(runs / "fsdp", tmp_path / "again", 2)
    done = launch(2, runs / "data", run, "--strategy", "fsdp", "--checkpoint-every", "2",
                  "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    resumed, whole = trained(run), trained(runs / "fsdp")
    for name in whole:
        assert torch.equal(resumed[name], whole[name]), name
    assert losses(run) == losses(runs / "fsdp")


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 3])
def test_a_distributed_checkpoint_resumes_at_another_number_of_processes(runs, tmp_path,
                                                                         processes):
    """Saved by 2 ranks at step 2, resumed by 1 or 3: the run ends as an uninterrupted one
    (the same global batches, so the same weights up to float rounding)."""
    run = resume_from_step(runs / "fsdp", tmp_path / "resharded", 2)
    done = launch(processes, runs / "data", run, "--strategy", "fsdp", "--checkpoint-every",
                  "2", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_weights(trained(run), trained(runs / "ddp"), atol=1e-5)
    torch.testing.assert_close(losses(run), losses(runs / "ddp"), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_the_two_rank_run_consolidates_bit_exactly_a_block_at_a_time(runs, tmp_path,
                                                                    monkeypatch):
    """`consolidate` on the fixture's FSDP2 run, every weight split across two ranks' files:
    its live encoder, bit for bit, reading one block at a time."""
    run = runs / "fsdp"
    step = ckpt.sharded_checkpoint_path(run, STEPS)
    assert sorted(path.name for path in step.glob("*.distcp")) == ["__0_0.distcp",
                                                                   "__1_0.distcp"]
    held = Held(monkeypatch)
    out = consolidate(run, tmp_path / "encoder")
    assert_bit_equal(encoder_state(out), live_encoder(run))
    assert_bit_equal(encoder_state(out), encoder_state(run / "encoder"))
    assert len(held.calls) == DEPTH + 1 and held.peak <= block_bytes(live_encoder(run))


@pytest.mark.slow
def test_a_kill_during_a_distributed_save_leaves_the_previous_checkpoint_usable(runs, tmp_path):
    run = tmp_path / "killed"
    done = launch(2, runs / "data", run, "--strategy", "fsdp", "--checkpoint-every", "2",
                  "--kill-in-save", "4")
    assert done.returncode != 0
    checkpoints = run / "checkpoints"
    assert [step for step, _ in ckpt.list_checkpoints(run)] == [2]
    assert (checkpoints / ".step_00000004.tmp").is_dir()  # what the kill left
    done = launch(1, runs / "data", run, "--strategy", "fsdp", "--checkpoint-every", "2",
                  "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (checkpoints / ".step_00000004.tmp").exists()
    assert_same_weights(trained(run), trained(runs / "ddp"), atol=1e-5)


@pytest.mark.slow
def test_a_raising_rank_stops_every_rank_with_its_error(runs, tmp_path):
    started = time.monotonic()
    done = launch(2, runs / "data", tmp_path / "failing", "--strategy", "fsdp",
                  "--fail-rank", "1", timeout=120)
    assert done.returncode != 0
    assert time.monotonic() - started < 100  # not the 30-minute collective timeout
    assert "vlm-vit: rank 0 stopping: rank 1 failed: Interrupted: interrupted at forward " \
        "call 2" in done.stderr


@pytest.mark.slow
def test_a_rank_that_lost_an_image_runs_as_many_micro_batches_as_the_others(tmp_path):
    """Micro-batches of 1 image; one rank's share of a batch holds an undecodable file, so it
    has 1 image where the other has 2. Both must run 1 micro-batch (its collectives), not 1
    and 2, or under FSDP2 (an all-gather per micro-batch) the run waits until the collective
    timeout; DDP's one all-reduce per step hid it."""
    write_noise_images(tmp_path / "data", 11)
    (tmp_path / "data" / "img_011.png").write_bytes(b"not an image")
    done = launch(2, tmp_path / "data", tmp_path / "run", "--strategy", "fsdp",
                  "--grad-accumulation", "2", "--batch-size", "4", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "img_011.png" in done.stderr  # it was drawn, and skipped


# -- one process --------------------------------------------------------------------------


def fsdp_config(**overrides) -> TrainConfig:
    return config(strategy="fsdp", **overrides)


def test_fsdp_on_one_process_writes_distributed_checkpoints_and_resumes_bit_exactly(tmp_path):
    write_noise_images(tmp_path / "data", 8)
    whole = toy_objective(dropout=0.1)
    Trainer(whole, image_folder(tmp_path / "data"), fsdp_config(steps=4), tmp_path / "whole",
            progress=False).fit()
    step = ckpt.sharded_checkpoint_path(tmp_path / "whole", 2)
    assert sorted(p.name for p in step.iterdir()) == [
        ".metadata", ".metadata.sha256", "__0_0.distcp", "__0_0.distcp.sha256", "trainer.pt",
        "trainer.pt.sha256"]
    run = resume_from_step(tmp_path / "whole", tmp_path / "run", 2)
    resumed = toy_objective(seed=3, dropout=0.1)
    result = Trainer(resumed, image_folder(tmp_path / "data"), fsdp_config(steps=4), run,
                     progress=False).fit(resume=True)
    assert result.step == 4
    for name, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_a_distributed_checkpoint_resumes_under_ddp_too(tmp_path):
    write_noise_images(tmp_path / "data", 8)
    whole = toy_objective()
    Trainer(whole, image_folder(tmp_path / "data"), fsdp_config(steps=4), tmp_path / "whole",
            progress=False).fit()
    run = resume_from_step(tmp_path / "whole", tmp_path / "run", 2)
    resumed = toy_objective(seed=3)
    Trainer(resumed, image_folder(tmp_path / "data"), config(steps=4), run,
            progress=False).fit(resume=True)
    for name, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_a_whole_model_reads_a_distributed_checkpoint_alone_inside_a_process_group(
        tmp_path, monkeypatch):
    """Rank 0's whole copy after an FSDP2 run (`finetune`) reads the final checkpoint with
    no collective: where the caller's process group outlives the run, the other ranks never
    join one, and a collective read waited for them for ever."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    write_noise_images(tmp_path / "data", 8)
    whole = toy_objective()
    Trainer(whole, image_folder(tmp_path / "data"), fsdp_config(steps=2), tmp_path / "run",
            progress=False).fit()
    calls, load = [], dcp.load
    monkeypatch.setattr(dcp, "load", lambda *a, **k: calls.append(k["no_dist"]) or load(*a, **k))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        copy = toy_objective(seed=3)
        sharded_checkpoint.load_weights(ckpt.latest_checkpoint(tmp_path / "run"), copy)
    finally:
        dist.destroy_process_group()
    assert calls == [True]
    for name, value in whole.state_dict().items():
        assert torch.equal(copy.state_dict()[name], value), name


def test_a_damaged_shard_file_is_skipped_for_the_previous_checkpoint(tmp_path, caplog):
    write_noise_images(tmp_path / "data", 8)
    Trainer(toy_objective(), image_folder(tmp_path / "data"), fsdp_config(steps=4),
            tmp_path / "run", progress=False).fit()
    shard = ckpt.sharded_checkpoint_path(tmp_path / "run", 4) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    path, state = ckpt.load_latest_checkpoint(tmp_path / "run")
    assert path == ckpt.sharded_checkpoint_path(tmp_path / "run", 2)
    assert state["progress"]["step"] == 2
    assert "__0_0.distcp" in caplog.text
    (shard.parent / "__0_0.distcp.sha256").unlink()
    with pytest.raises(ValueError, match="has no __0_0.distcp.sha256"):
        ckpt.load_checkpoint(shard.parent)


def test_old_distributed_checkpoints_are_pruned_whole(tmp_path):
    write_noise_images(tmp_path / "data", 8)
    Trainer(toy_objective(), image_folder(tmp_path / "data"),
            fsdp_config(steps=6, keep_checkpoints=1), tmp_path / "run", progress=False).fit()
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000006"]


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_distributed_checkpoint_metadata_that_names_code_is_refused(tmp_path):
    write_noise_images(tmp_path / "data", 8)
    Trainer(toy_objective(), image_folder(tmp_path / "data"), fsdp_config(steps=2),
            tmp_path / "run", progress=False).fit()
    step = ckpt.sharded_checkpoint_path(tmp_path / "run", 2)
    assert sharded_checkpoint.tensor_shapes(step)["encoder.cls_token"][0] == (1, 1, 32)
    (step / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(pickle.UnpicklingError, match=r"names posix.system|names os.system"):
        sharded_checkpoint.tensor_shapes(step)


def test_cpu_offload_is_refused_on_a_cpu(tmp_path):
    write_noise_images(tmp_path / "data", 8)
    trainer = Trainer(toy_objective(), image_folder(tmp_path / "data"),
                      fsdp_config(steps=2, cpu_offload=True), tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="this run trains on cpu already"):
        trainer.fit()


@pytest.mark.slow
def test_bf16_and_activation_checkpointing_compose_with_fsdp(runs, tmp_path):
    """FSDP2's bf16 parameters (fp32 reductions) with recomputed blocks train as DDP under
    bf16 autocast does, up to bf16 rounding."""
    options = ["--precision", "bf16", "--grad-checkpointing"]
    for strategy in ("ddp", "fsdp"):
        done = launch(2, runs / "data", tmp_path / strategy, "--strategy", strategy, *options)
        assert done.returncode == 0, done.stderr[-3000:]
    torch.testing.assert_close(losses(tmp_path / "fsdp"), losses(tmp_path / "ddp"), rtol=0,
                               atol=2e-2)
    assert_same_weights(trained(tmp_path / "fsdp"), trained(tmp_path / "ddp"), atol=2e-2)


def test_strategy_settings_are_checked():
    with pytest.raises(ValueError, match="strategy 'zero3' is not one of"):
        TrainConfig(strategy="zero3")
    with pytest.raises(ValueError, match="cpu_offload needs strategy 'fsdp'"):
        TrainConfig(cpu_offload=True)
    with pytest.raises(ValueError, match="use precision 'bf16'"):
        TrainConfig(strategy="fsdp", precision="fp16")


@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 13])
@pytest.mark.parametrize("rows", [(4, 8), (0, 12), (0, 1), (11, 12), (5, 5)])
def test_zero_frozen_rows_zeroes_each_shards_part_of_the_rows(ranks, rows):
    """Over FSDP2's dim-0 shards (torch.chunk's, the last ones shorter or empty), each rank
    zeroing its own shard zeroes exactly the whole tensor's frozen rows."""
    whole = torch.arange(1.0, 12 * 3 + 1).reshape(12, 3)
    shards = [piece.clone() for piece in torch.chunk(whole, ranks)]
    shards += [whole[:0].clone()] * (ranks - len(shards))  # ranks with an empty shard
    offset = 0
    for shard in shards:
        fsdp.zero_frozen_rows(shard, offset, rows)
        offset += shard.shape[0]
    expected = whole.clone()
    expected[rows[0]:rows[1]] = 0
    assert torch.equal(torch.cat(shards), expected)
