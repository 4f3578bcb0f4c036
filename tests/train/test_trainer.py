"""The training loop: schedule, weight decay groups, exact resume, bad steps and outputs."""

from __future__ import annotations

import csv
import json
import logging
import math

import pytest
import torch
from torch import nn

from tests.train.toy import (
    Interrupted,
    config,
    image_folder,
    toy_objective,
    write_bad_images,
    write_noise_images,
)
from vlm_vit import load_encoder
from vlm_vit.train import (
    NonFiniteLossError,
    Trainer,
    build_scheduler,
    latest_checkpoint,
    learning_rate,
    load_checkpoint,
    parameter_groups,
)
from vlm_vit.train.checkpoint import checkpoint_path
from vlm_vit.train.trainer import NothingTrainedError


@pytest.fixture
def data(tmp_path):
    """20 noise images: 5 batches of 4 per epoch, so 6 steps cross an epoch boundary."""
    write_noise_images(tmp_path / "data", 20)
    return tmp_path / "data"


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_weights(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if atol == 0.0:
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)


# -- optimizer set-up ------------------------------------------------------------------------


def test_parameter_groups_exempt_norms_biases_tables_and_tokens():
    objective = toy_objective()
    objective.mask_token = nn.Parameter(torch.zeros(1, 1, 32))
    decay, no_decay = parameter_groups(objective, 0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    for name in ["encoder.pos_embed", "encoder.cls_token", "mask_token", "encoder.norm.weight",
                 "encoder.norm.bias", "encoder.blocks.0.norm1.weight",
                 "encoder.blocks.1.attn.qkv.bias", "encoder.patch_embed.proj.bias", "head.bias"]:
        assert name in no_decay["names"], name
    for name in ["encoder.blocks.0.attn.qkv.weight", "encoder.blocks.1.mlp.fc1.weight",
                 "encoder.blocks.0.attn.proj.weight", "encoder.patch_embed.proj.weight",
                 "head.weight"]:
        assert name in decay["names"], name
    everything = dict(objective.named_parameters())
    assert sorted(decay["names"] + no_decay["names"]) == sorted(everything)
    for group in (decay, no_decay):
        assert all(p is everything[n] for n, p in zip(group["names"], group["params"], strict=True))


def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    lr = dict(lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=14)
    assert [learning_rate(s, **lr) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert learning_rate(4, **lr) == 1.0  # the cosine starts at the peak
    assert learning_rate(9, **lr) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert learning_rate(14, **lr) == pytest.approx(0.1)  # one past the last step
    assert learning_rate(100, **lr) == pytest.approx(0.1)
    assert learning_rate(0, lr=1.0, min_lr=0.0, warmup_steps=0, total_steps=10) == 1.0

    cfg = config(lr=1.0, min_lr=0.1, warmup_steps=4, steps=14)
    optimizer = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    scheduler = build_scheduler(optimizer, cfg)
    seen = []
    for _ in range(14):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([learning_rate(s, **lr) for s in range(14)])


# -- exact resume ----------------------------------------------------------------------------


def test_resume_gives_the_same_losses_and_weights_as_an_uninterrupted_run(data, tmp_path):
    whole = toy_objective(dropout=0.3)  # dropout: the objective's RNG must be restored too
    uninterrupted = Trainer(whole, image_folder(data), config(), tmp_path / "whole").fit()
    assert uninterrupted.step == 6 and len(uninterrupted.losses) == 6

    # Killed in step 5, after the step-4 checkpoint; step 5 is the last batch of epoch 0.
    run_dir = tmp_path / "interrupted"
    with pytest.raises(Interrupted):
        Trainer(toy_objective(dropout=0.3, crash_at_call=5), image_folder(data), config(),
                run_dir).fit()
    assert latest_checkpoint(run_dir) == checkpoint_path(run_dir, 4)

    # A new process would build its objective afresh, from another seed and RNG state, and
    # may use workers: none of that may matter.
    resumed_objective = toy_objective(seed=123, dropout=0.3)
    resumed = Trainer(resumed_objective, image_folder(data), config(num_workers=2),
                      run_dir).fit(resume=True)

    assert resumed.step == 6
    assert resumed.losses == uninterrupted.losses
    assert_same_weights(weights(resumed_objective), weights(whole))
    with (run_dir / "metrics.csv").open() as handle:
        assert [int(row["step"]) for row in csv.DictReader(handle)] == [1, 2, 3, 4, 5, 6]


def test_resume_without_a_checkpoint_starts_fresh_and_says_so(data, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="vlm_vit.train")  # the default verbosity
    result = Trainer(toy_objective(), image_folder(data), config(steps=1),
                     tmp_path / "run").fit(resume=True)
    assert result.step == 1
    assert "no checkpoint in" in caplog.text and "starting a fresh run" in caplog.text


def interrupted_before_a_checkpoint(data, run_dir):
    """A run stopped at step 2 of 6, before its first checkpoint: metrics.csv and
    run_config.json exist, no checkpoint does."""
    with pytest.raises(Interrupted):
        Trainer(toy_objective(crash_at_call=3), image_folder(data),
                config(checkpoint_every=0), run_dir).fit()
    assert latest_checkpoint(run_dir) is None
    return {name: (run_dir / name).read_bytes() for name in ("metrics.csv", "run_config.json")}


@pytest.mark.parametrize("resume", [False, True])
def test_an_earlier_run_without_checkpoints_is_never_overwritten_silently(data, tmp_path,
                                                                          resume):
    run_dir = tmp_path / "run"
    before = interrupted_before_a_checkpoint(data, run_dir)
    message = ("has no checkpoint to resume from.*another run.*train lr 0.001 -> 0.002" if resume
               else "holds an earlier run's")
    with pytest.raises(FileExistsError, match=f"{message}.*pass --overwrite"):
        Trainer(toy_objective(), image_folder(data), config(lr=2e-3), run_dir).fit(
            resume=resume)
    assert {name: (run_dir / name).read_bytes() for name in before} == before


def test_a_requeued_run_killed_before_its_first_checkpoint_starts_afresh(data, tmp_path,
                                                                         caplog):
    """SIGKILL while the first checkpoint is written, then the same command with --resume
    (as a cluster requeue runs it) trains the run from the start (issue 26, item 5)."""
    whole = Trainer(toy_objective(), image_folder(data), config(), tmp_path / "whole").fit()
    run_dir = tmp_path / "run"
    interrupted_before_a_checkpoint(data, run_dir)
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / ".step_00000001.pt.x1y2.tmp").write_bytes(b"PK\x03\x04 half")

    caplog.set_level(logging.WARNING, logger="vlm_vit.train")
    result = Trainer(toy_objective(), image_folder(data), config(), run_dir).fit(resume=True)

    assert result.step == 6 and result.losses == whole.losses
    with (run_dir / "metrics.csv").open() as handle:
        assert [int(row["step"]) for row in csv.DictReader(handle)] == [1, 2, 3, 4, 5, 6]
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no checkpoint in" in m and "starting a fresh run" in m and "metrics.csv" in m
               for m in warned), warned


@pytest.mark.parametrize("name", ["model", "adapter", "objective.pt"])
def test_overwrite_removes_every_output_of_an_earlier_run(data, tmp_path, name):
    """The LLM bridge's model/, a LoRA run's adapter/ and objective.pt are a run's outputs
    too: a fresh run refuses them, --overwrite removes them (issue 26, item 1)."""
    run_dir = tmp_path / "run"
    stale = run_dir / name
    if "." in name:
        stale.parent.mkdir()
        stale.write_bytes(b"an earlier run's")
    else:
        (stale / "tower").mkdir(parents=True)
        (stale / "tower" / "pooler.safetensors").write_bytes(b"an earlier run's")
    with pytest.raises(FileExistsError, match=f"holds an earlier run's {name}"):
        Trainer(toy_objective(), image_folder(data), config(steps=1), run_dir).fit()
    Trainer(toy_objective(), image_folder(data), config(steps=1), run_dir).fit(overwrite=True)
    if name == "objective.pt":
        assert stale.read_bytes() != b"an earlier run's"  # this run's
    else:
        assert not stale.exists()


def test_overwrite_starts_afresh_and_keeps_the_caller_s_files(data, tmp_path):
    run_dir = tmp_path / "run"
    interrupted_before_a_checkpoint(data, run_dir)
    (run_dir / "finetune.json").write_text("{}")  # a command's own file, not the trainer's
    result = Trainer(toy_objective(), image_folder(data), config(steps=3), run_dir).fit(
        overwrite=True)
    assert result.step == 3
    with (run_dir / "metrics.csv").open() as handle:
        assert [row["step"] for row in csv.DictReader(handle)] == ["1", "2", "3"]
    assert (run_dir / "finetune.json").read_text() == "{}"


def test_a_fresh_run_refuses_a_directory_with_checkpoints(data, tmp_path):
    Trainer(toy_objective(), image_folder(data), config(steps=2), tmp_path / "run").fit()
    with pytest.raises(FileExistsError, match="resume=True"):
        Trainer(toy_objective(), image_folder(data), config(steps=2), tmp_path / "run").fit()


def test_a_failed_checkpoint_write_leaves_the_previous_one_whole(data, tmp_path, monkeypatch):
    real_save = torch.save
    calls = []

    def save_then_fail(obj, handle, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the step-4 checkpoint: half written, then the disk fills
            handle.write(b"PK\x03\x04 half a zip file")
            raise OSError("No space left on device")
        return real_save(obj, handle, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_then_fail)
    run_dir = tmp_path / "run"
    with pytest.raises(OSError, match="No space left"):
        Trainer(toy_objective(), image_folder(data), config(steps=4), run_dir).fit()

    assert latest_checkpoint(run_dir) == checkpoint_path(run_dir, 2)
    assert load_checkpoint(checkpoint_path(run_dir, 2))["step"] == 2
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_00000002.pt", "step_00000002.pt.sha256"]


# -- bad data and bad steps ------------------------------------------------------------------


def test_undecodable_images_are_skipped_counted_and_named(tmp_path, caplog):
    write_noise_images(tmp_path / "data", 12)
    bad = write_bad_images(tmp_path / "data")
    caplog.set_level(logging.WARNING, logger="vlm_vit.train")
    # 14 files in batches of 7: one epoch of 2 steps draws every file once.
    result = Trainer(toy_objective(), image_folder(tmp_path / "data"),
                     config(steps=2, batch_size=7), tmp_path / "run").fit()
    assert result.step == 2 and all(math.isfinite(loss) for loss in result.losses)
    assert result.undecodable_images == 2
    assert result.undecodable_paths == sorted(str(p) for p in bad)
    for path in bad:
        assert str(path) in caplog.text


def test_a_run_on_undecodable_images_only_fails_and_exports_nothing(tmp_path):
    """Every image undecodable: no step trains, so there is no encoder to export (issue 26,
    item 4), and the error says why."""
    (tmp_path / "data").mkdir()
    bad = write_bad_images(tmp_path / "data")
    run_dir = tmp_path / "run"
    with pytest.raises(NothingTrainedError, match=r"no step of the 2 trained.*undecodable") \
            as error:
        Trainer(toy_objective(), image_folder(tmp_path / "data"),
                config(steps=2, batch_size=2), run_dir).fit()
    assert all(str(path) in str(error.value) for path in bad)
    assert not (run_dir / "encoder").exists() and not (run_dir / "objective.pt").exists()


def test_a_nan_loss_skips_its_update(data, tmp_path, caplog):
    run_dir = tmp_path / "run"
    caplog.set_level(logging.WARNING, logger="vlm_vit.train")
    result = Trainer(toy_objective(nan_at_calls=(3,)), image_folder(data),
                     config(steps=4, checkpoint_every=1), run_dir).fit()
    assert result.step == 4 and result.skipped_steps == 1
    assert math.isnan(result.losses[2])
    assert all(math.isfinite(result.losses[i]) for i in (0, 1, 3))
    before = load_checkpoint(checkpoint_path(run_dir, 2))["objective"]
    after = load_checkpoint(checkpoint_path(run_dir, 3))["objective"]
    next_step = load_checkpoint(checkpoint_path(run_dir, 4))["objective"]
    assert_same_weights(before, after)
    assert not torch.equal(after["head.weight"], next_step["head.weight"])
    assert "step 3: loss nan" in caplog.text


def test_consecutive_nan_losses_abort_with_a_clear_error(data, tmp_path):
    objective = toy_objective(nan_at_calls=(2, 3, 4, 5))
    with pytest.raises(NonFiniteLossError, match=r"3 consecutive steps \(up to step 4\)"):
        Trainer(objective, image_folder(data), config(max_bad_steps=3), tmp_path / "run").fit()


# -- numerics --------------------------------------------------------------------------------


def test_gradient_accumulation_matches_one_full_batch(data, tmp_path):
    gradients, final = [], []
    for accumulation in (1, 2):
        objective = toy_objective()
        run_dir = tmp_path / f"accumulate_{accumulation}"
        Trainer(objective, image_folder(data), config(steps=1, grad_accumulation=accumulation),
                run_dir).fit()
        # After one AdamW step, exp_avg = (1 - beta1) * the clipped gradient that was applied.
        state = load_checkpoint(checkpoint_path(run_dir, 1))["optimizer"]["state"]
        gradients.append({index: s["exp_avg"] / 0.1 for index, s in state.items()})
        final.append(weights(objective))
    assert_same_weights(gradients[0], gradients[1], atol=1e-6)
    # Adam moves each weight by about lr * g / (|g| + eps): for the rare element whose
    # gradient is near eps, float rounding in g shows up as a few 1e-6 in the weight.
    assert_same_weights(final[0], final[1], atol=1e-5)


def test_uneven_micro_batches_are_weighted_by_their_share_of_the_batch(tmp_path):
    """3 decodable images of 4 in accumulation 2 split 2 + 1: each micro-batch's loss counts
    by its share (2/3, 1/3), not by 1/2 each, so the step equals one full batch's (issue 26,
    item 6)."""
    write_noise_images(tmp_path / "data", 3)
    write_bad_images(tmp_path / "data")[0].unlink()  # keep one undecodable file: 4 in all
    exp_avg, losses = [], []
    for accumulation in (1, 2):
        run_dir = tmp_path / f"accumulate_{accumulation}"
        result = Trainer(toy_objective(), image_folder(tmp_path / "data"),
                         config(steps=1, grad_accumulation=accumulation), run_dir).fit()
        assert result.undecodable_images == 1
        losses.append(result.losses[0])
        state = load_checkpoint(checkpoint_path(run_dir, 1))["optimizer"]["state"]
        exp_avg.append({index: s["exp_avg"] for index, s in state.items()})
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    assert_same_weights(exp_avg[0], exp_avg[1], atol=1e-7)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(data, tmp_path, precision):
    objective = toy_objective()
    start = weights(objective)
    result = Trainer(objective, image_folder(data), config(steps=2, precision=precision),
                     tmp_path / "run").fit()
    assert all(math.isfinite(loss) for loss in result.losses)
    assert objective.head.weight.dtype == torch.float32
    assert not torch.equal(start["head.weight"], objective.head.weight)


# -- what a run leaves behind ----------------------------------------------------------------


class Flagged(nn.Module):
    """Has the attribute the trainer sets for gradient checkpointing."""

    gradient_checkpointing = False


def test_run_directory_holds_config_metrics_and_a_loadable_encoder(data, tmp_path):
    objective = toy_objective()
    objective.flagged = Flagged()
    run_dir = tmp_path / "run"
    cfg = config(steps=3, grad_checkpointing=True)
    Trainer(objective, image_folder(data), cfg, run_dir, command="python train.py --steps 3").fit()

    assert objective.flagged.gradient_checkpointing is True
    run_config = json.loads((run_dir / "run_config.json").read_text())
    assert run_config["command"] == "python train.py --steps 3"
    assert run_config["train"] == cfg.to_dict()
    assert run_config["encoder"]["width"] == 32
    assert run_config["dataset"]["length"] == 20

    with (run_dir / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["step"]) for row in rows] == [1, 2, 3]
    assert {"loss", "lr", "grad_norm", "images_per_s", "target_mean"} <= set(rows[0])

    encoder = load_encoder(run_dir / "encoder")
    assert_same_weights(weights(encoder), weights(objective.encoder))
    saved = torch.load(run_dir / "objective.pt", weights_only=True)
    assert_same_weights(saved, weights(objective))


def test_command_defaults_to_sys_argv(data, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["train.py", "--lr", "1e-3"])
    trainer = Trainer(toy_objective(), image_folder(data), config(), tmp_path / "run")
    assert trainer.command == "train.py --lr 1e-3"


def test_an_objective_with_export_writes_its_own_result(data, tmp_path):
    objective = toy_objective()
    written = []

    def export(run_dir):
        written.append(run_dir)
        objective.encoder.save_pretrained(run_dir / "mine")
        return run_dir / "mine"

    objective.export = export
    run_dir = tmp_path / "run"
    Trainer(objective, image_folder(data), config(steps=2), run_dir, progress=False).fit()
    assert written == [run_dir]
    assert (run_dir / "mine" / "config.json").is_file()
    assert not (run_dir / "encoder").exists() and not (run_dir / "objective.pt").exists()


class SelfCheckpointing(nn.Module):
    """An objective that sets gradient checkpointing up itself, as the LLM bridge does."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = toy_objective()
        self.encoder = self.inner.encoder
        self.requested: list[bool] = []

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        self.requested.append(enabled)

    def forward(self, pixel_values):
        return self.inner(pixel_values)


def test_an_objective_may_set_gradient_checkpointing_up_itself(data, tmp_path):
    objective = SelfCheckpointing()
    Trainer(objective, image_folder(data), config(steps=1, grad_checkpointing=True),
            tmp_path / "run").fit()
    assert objective.requested == [True]
    # ... and the trainer leaves its modules alone
    assert all(not getattr(m, "gradient_checkpointing", False) for m in objective.modules())


class RecordingFolder(torch.utils.data.Dataset):
    """An image folder whose sample i has length i, recording the order it is read in."""

    def __init__(self, folder) -> None:
        self.folder, self.read = folder, []
        self.lengths = list(range(len(folder)))

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int):
        self.read.append(index)
        return self.folder[index]


def test_group_by_length_needs_lengths_and_then_groups(data, tmp_path):
    with pytest.raises(ValueError, match="group_by_length needs a dataset with `lengths`; "
                                         "ImageFolder has none"):
        Trainer(toy_objective(), image_folder(data), config(group_by_length=True),
                tmp_path / "bare").fit()
    assert not (tmp_path / "bare" / "checkpoints").exists()
    folder = RecordingFolder(image_folder(data))
    Trainer(toy_objective(), folder, config(steps=5, group_by_length=True, checkpoint_every=0),
            tmp_path / "grouped").fit()
    # One window holds the whole epoch: sorted by length and cut, each batch is 4 neighbours.
    batches = [sorted(folder.read[i:i + 4]) for i in range(0, 20, 4)]
    assert sorted(batches) == [list(range(k, k + 4)) for k in range(0, 20, 4)]


def flushes_denormals() -> bool:
    """Whether this process treats denormal floats as zero now."""
    return (torch.tensor([1e-39], dtype=torch.float32) * 1.0).item() == 0.0


@pytest.mark.parametrize("flush", [True, False])
def test_denormals_are_flushed_during_a_cpu_run_only_when_asked(data, tmp_path, flush):
    objective = toy_objective()
    seen = []
    objective.register_forward_pre_hook(lambda *_: seen.append(flushes_denormals()))
    assert not flushes_denormals()
    Trainer(objective, image_folder(data), config(steps=2, flush_denormal=flush),
            tmp_path / "run").fit()
    assert seen == [flush, flush]
    assert not flushes_denormals()  # the process-wide flag is cleared after the run


def signalled(objective, signal_number, at_call):
    """`objective`, which sends this process `signal_number` in its forward call `at_call`,
    as Ctrl-C or a scheduler's SIGTERM would."""
    import os

    calls = []

    def hook(module, args):
        calls.append(1)
        if len(calls) == at_call:
            os.kill(os.getpid(), signal_number)

    objective.register_forward_pre_hook(hook)
    return objective


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_checkpoints_the_current_step_and_the_resume_is_exact(data, tmp_path, name,
                                                                       caplog):
    import random
    import signal

    number = getattr(signal, name)
    at_step = random.Random(name).randint(1, 5)  # "a random step", the same on every run
    whole = toy_objective(dropout=0.3)
    uninterrupted = Trainer(whole, image_folder(data), config(checkpoint_every=0),
                            tmp_path / "whole").fit()
    run_dir = tmp_path / "signalled"
    before = signal.getsignal(number)
    with pytest.raises(KeyboardInterrupt):
        Trainer(signalled(toy_objective(dropout=0.3), number, at_step), image_folder(data),
                config(checkpoint_every=0), run_dir).fit()
    assert signal.getsignal(number) is before  # the trainer's handler is gone again
    assert latest_checkpoint(run_dir) == checkpoint_path(run_dir, at_step)
    assert f"stopped by signal {name} after step {at_step}" in caplog.text
    resumed_objective = toy_objective(seed=7, dropout=0.3)
    resumed = Trainer(resumed_objective, image_folder(data), config(checkpoint_every=0),
                      run_dir).fit(resume=True)
    assert resumed.losses == uninterrupted.losses
    assert_same_weights(weights(resumed_objective), weights(whole))


class Undecodable(torch.utils.data.Dataset):
    """Four files that never decode: every step of a run on it skips its update."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        from vlm_vit.train import UndecodableImage

        return UndecodableImage(f"bad{index}.png", "not a PNG")


def test_a_step_without_images_leaks_no_scheduler_warning_and_logs_beside_the_bar(
        tmp_path, monkeypatch):
    import warnings

    from tqdm import tqdm

    written = []
    monkeypatch.setattr(tqdm, "write", classmethod(
        lambda cls, text, *args, **kwargs: written.append(text)))
    root = logging.getLogger()
    handler = logging.StreamHandler()
    root.addHandler(handler)  # as the CLI's basicConfig does
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(NothingTrainedError, match="no step of the 2 trained"):
                Trainer(toy_objective(), Undecodable(), config(steps=2), tmp_path / "run",
                        progress=True).fit()
    finally:
        root.removeHandler(handler)
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]
    assert any("no decodable image" in line for line in written)  # through the bar's writer
