"""`consolidate`: a run's checkpoint as a native encoder directory, bit-exactly the live
model's encoder, read one transformer block at a time (issue 29).

The tests here train the toy objective for 4 steps in one process under the "fsdp" strategy
(a distributed checkpoint at steps 2 and 4, written by one rank); `tests/train/test_fsdp.py`
consolidates its two-process run, whose every weight is split across two ranks' files.
"""

from __future__ import annotations

import logging
import shutil
import weakref
from pathlib import Path

import pytest
import torch

import vlm_vit
from tests.train.toy import config, image_folder, toy_objective, write_noise_images
from vlm_vit.io.integrity import IntegrityError
from vlm_vit.io.weights import SHARD_INDEX
from vlm_vit.train import Trainer, sharded_checkpoint
from vlm_vit.train import checkpoint as ckpt
from vlm_vit.train import consolidate as consolidation
from vlm_vit.train.consolidate import consolidate

DEPTH = 2  # the toy encoder's blocks


def train(root: Path, run: str, strategy: str = "fsdp", **options) -> Path:
    """A 4-step toy run in one process, checkpoints at steps 2 and 4."""
    if not (root / "data").is_dir():
        write_noise_images(root / "data", 12)
    settings = config(steps=4, checkpoint_every=2, strategy=strategy, **options)
    Trainer(toy_objective(), image_folder(root / "data"), settings, root / run,
            progress=False).fit()
    return root / run


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    return train(tmp_path_factory.mktemp("consolidate"), "fsdp")


def encoder_state(directory: Path) -> dict[str, torch.Tensor]:
    return vlm_vit.load_encoder(directory).state_dict()


def live_encoder(run_dir: Path) -> dict[str, torch.Tensor]:
    """The encoder's part of the final objective state: the run's `objective.pt`, or, where a
    sharded run wrote none, its final checkpoint read whole into an objective by DCP."""
    if not (run_dir / "objective.pt").is_file():
        objective = toy_objective(seed=5)
        sharded_checkpoint.load_weights(ckpt.latest_checkpoint(run_dir), objective)
        return objective.encoder.state_dict()
    state = torch.load(run_dir / "objective.pt", weights_only=True)
    return {name.removeprefix("encoder."): tensor for name, tensor in state.items()
            if name.startswith("encoder.")}


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


class Held:
    """Wraps `load_tensors` to record, at each call, the bytes of tensors it returned that are
    still alive plus those it returns now: the most tensor bytes held at once."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[int] = []
        self.peak = 0
        self._earlier: list[tuple[weakref.ref, int]] = []
        self._load = sharded_checkpoint.load_tensors
        monkeypatch.setattr(sharded_checkpoint, "load_tensors", self)

    def __call__(self, path, shapes, *args, **kwargs):
        tensors = self._load(path, shapes, *args, **kwargs)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        alive = sum(size for ref, size in self._earlier if ref() is not None)
        self._earlier += [(weakref.ref(t), t.numel() * t.element_size())
                          for t in tensors.values()]
        self.calls.append(size)
        self.peak = max(self.peak, alive + size)
        return tensors


def block_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for name, t in state.items()
               if name.startswith("blocks.0."))


def damage(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def test_an_fsdp_run_consolidates_to_its_live_encoder_bit_exactly(fsdp_run, tmp_path):
    out = consolidate(fsdp_run, tmp_path / "encoder")
    assert_bit_equal(encoder_state(out), live_encoder(fsdp_run))
    assert_bit_equal(encoder_state(out), encoder_state(fsdp_run / "encoder"))
    # Issue 47, 6: under the usual shard size, one file as save_pretrained writes (it was a
    # file per block and an index: 13 files for a 22 MB ViT-Ti).
    assert sorted(path.name for path in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / SHARD_INDEX).exists() and (out / "manifest.json").is_file()
    recorded = vlm_vit.io.files.read_json(out / "config.json")["consolidated_from"]
    assert recorded == {"checkpoint": "checkpoints/step_00000004", "step": 4}


def test_no_more_than_one_block_is_held_at_a_time(fsdp_run, tmp_path, monkeypatch):
    held = Held(monkeypatch)
    consolidate(fsdp_run, tmp_path / "encoder")
    live = live_encoder(fsdp_run)
    assert len(held.calls) == DEPTH + 1  # the rest, then each block
    assert held.peak <= block_bytes(live), (held.calls, held.peak, block_bytes(live))
    assert sum(held.calls) == sum(t.numel() * t.element_size() for t in live.values())


def test_a_smaller_shard_size_writes_whole_groups_per_shard_one_block_held(fsdp_run, tmp_path,
                                                                          monkeypatch):
    live = live_encoder(fsdp_run)
    held = Held(monkeypatch)
    out = consolidate(fsdp_run, tmp_path / "encoder", max_shard_size=block_bytes(live))
    assert held.peak <= block_bytes(live)
    shards = sorted(path.name for path in out.glob("model-*.safetensors"))
    assert shards == [f"model-{i:05d}-of-{DEPTH + 1:05d}.safetensors" for i in (1, 2, 3)]
    assert (out / SHARD_INDEX).is_file()
    assert_bit_equal(encoder_state(out), live)
    two = consolidate(fsdp_run, tmp_path / "two", max_shard_size=2 * block_bytes(live))
    assert len(list(two.glob("model-*.safetensors"))) == 2  # the rest and block 0, block 1
    assert_bit_equal(encoder_state(two), live)


def test_block_groups_put_each_block_apart_from_the_rest():
    names = ["encoder.cls_token", "encoder.blocks.10.mlp.fc1.weight",
             "encoder.blocks.2.norm1.weight", "encoder.blocks.2.attn.qkv.weight",
             "encoder.norm.weight"]
    assert consolidation.block_groups(names) == [
        ["encoder.cls_token", "encoder.norm.weight"],
        ["encoder.blocks.2.norm1.weight", "encoder.blocks.2.attn.qkv.weight"],
        ["encoder.blocks.10.mlp.fc1.weight"]]


def test_a_step_or_a_checkpoint_path_selects_that_checkpoint(fsdp_run, tmp_path):
    reference = toy_objective(seed=1)
    sharded_checkpoint.load_weights(ckpt.sharded_checkpoint_path(fsdp_run, 2), reference)
    expected = reference.encoder.state_dict()
    by_step = consolidate(fsdp_run, tmp_path / "by_step", step=2)
    by_path = consolidate(ckpt.sharded_checkpoint_path(fsdp_run, 2), tmp_path / "by_path")
    assert_bit_equal(encoder_state(by_step), expected)
    assert_bit_equal(encoder_state(by_path), expected)
    assert not torch.equal(expected["blocks.0.attn.qkv.weight"],
                           live_encoder(fsdp_run)["blocks.0.attn.qkv.weight"])
    with pytest.raises(FileNotFoundError, match="no checkpoint of step 3; it has steps 2, 4"):
        consolidate(fsdp_run, tmp_path / "missing", step=3)


def test_a_damaged_shard_file_is_refused_naming_it(fsdp_run, tmp_path):
    run = shutil.copytree(fsdp_run, tmp_path / "run")
    shard = ckpt.sharded_checkpoint_path(run, 4) / "__0_0.distcp"
    damage(shard)
    with pytest.raises(IntegrityError, match=str(shard)):
        consolidate(run, tmp_path / "encoder", step=4)
    assert not (tmp_path / "encoder").exists()


def test_a_damaged_newest_checkpoint_falls_back_with_a_warning(fsdp_run, tmp_path, caplog):
    run = shutil.copytree(fsdp_run, tmp_path / "run")
    damage(ckpt.sharded_checkpoint_path(run, 4) / "__0_0.distcp")
    with caplog.at_level(logging.WARNING, logger="vlm_vit.train.consolidate"):
        out = consolidate(run, tmp_path / "encoder")
    assert "step_00000004 is unusable" in caplog.text and "__0_0.distcp" in caplog.text
    assert vlm_vit.io.files.read_json(out / "config.json")["consolidated_from"]["step"] == 2
    damage(ckpt.sharded_checkpoint_path(run, 2) / ".metadata")
    with pytest.raises(ValueError, match=r"none of the 2 checkpoints .* is usable "
                                         r"\(step_00000004: .*; step_00000002: .*\.metadata"):
        consolidate(run, tmp_path / "none")


def test_a_failure_while_writing_leaves_the_previous_output(fsdp_run, tmp_path, monkeypatch):
    out = consolidate(fsdp_run, tmp_path / "encoder", step=2)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    original, calls = sharded_checkpoint.load_tensors, []

    def failing(path, shapes, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk gone")
        return original(path, shapes, *args, **kwargs)

    monkeypatch.setattr(sharded_checkpoint, "load_tensors", failing)
    with pytest.raises(OSError, match="disk gone"):
        consolidate(fsdp_run, out, step=4)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert [path.name for path in tmp_path.iterdir()] == ["encoder"]  # no temporary left


def test_a_ddp_run_file_checkpoint_consolidates_too(fsdp_run, tmp_path):
    run = train(fsdp_run.parent, "ddp", strategy="ddp")
    assert ckpt.latest_checkpoint(run).suffix == ".pt"
    out = consolidate(run, tmp_path / "encoder")
    assert_bit_equal(encoder_state(out), live_encoder(run))


@pytest.mark.parametrize("renamed, message", [
    ({"encoder.blocks.0.attn.qkv.lora_A.default.weight": "lora"}, "LoRA \\(peft\\) objective"),
    ({"tower.encoder.cls_token": "only"}, "holds no `encoder.` weights"),
    ({"encoder.blocks.7.norm1.weight": "extra"}, "unexpected: blocks.7.norm1.weight"),
])
def test_weights_that_are_not_a_plain_encoder_are_refused_by_name(fsdp_run, tmp_path,
                                                                  monkeypatch, renamed, message):
    original = sharded_checkpoint.tensor_shapes

    def shapes(path, *args, **kwargs):
        found = original(path, *args, **kwargs)
        anything = found["encoder.norm.weight"]
        if "only" in renamed.values():
            return {name: anything for name in renamed}
        return {**found, **{name: anything for name in renamed}}

    monkeypatch.setattr(sharded_checkpoint, "tensor_shapes", shapes)
    with pytest.raises(ValueError, match=message):
        consolidate(fsdp_run, tmp_path / "encoder")
    assert not (tmp_path / "encoder").exists()


def test_weights_that_do_not_fit_the_recorded_encoder_are_refused(fsdp_run, tmp_path):
    run = shutil.copytree(fsdp_run, tmp_path / "run")
    recorded = run / "run_config.json"
    recorded.write_text(recorded.read_text().replace('"depth": 2', '"depth": 3'))
    with pytest.raises(ValueError, match="missing: blocks.2.attn.proj.bias"):
        consolidate(run, tmp_path / "encoder")


@pytest.mark.parametrize("where", [".", "checkpoints", "checkpoints/step_00000004/x", ".."])
def test_an_output_over_the_run_or_its_checkpoints_is_refused(fsdp_run, where):
    with pytest.raises(ValueError, match="would replace the run directory"):
        consolidate(fsdp_run, fsdp_run / where)


def test_what_is_there_instead_of_a_checkpoint_is_named(fsdp_run, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(fsdp_run / "encoder", run / "encoder")
    (run / "metrics.csv").write_text("step,loss\n")
    with pytest.raises(FileNotFoundError, match=r"holds no training checkpoint .*; it holds "
                       r"encoder/, metrics.csv; .*encoder is the run's final encoder"):
        consolidate(run, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        consolidate(tmp_path / "nowhere", tmp_path / "out")


@pytest.mark.slow  # peft, and a real LoRA run
def test_a_lora_run_is_refused_by_name(fsdp_run, tmp_path):
    from vlm_vit.adapt.lora import apply_lora

    objective = apply_lora(toy_objective(), r=2, train_modules=["head"])
    Trainer(objective, image_folder(fsdp_run.parent / "data"),
            config(steps=2, checkpoint_every=2, strategy="fsdp"), tmp_path / "lora",
            progress=False).fit()
    with pytest.raises(ValueError, match=r"LoRA \(peft\) objective \(peft.peft_model.PeftModel"):
        consolidate(tmp_path / "lora", tmp_path / "encoder")
