"""The bridge under data parallelism: FSDP2 trains as DDP does (both stages, through a
sharded checkpoint and a resume), a rank that sees only text-only records neither hangs nor
changes the result, the gathered state exports as an unsharded run's, and `llm train` takes
`--strategy`."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CAPTIONS, photos, tiny_llm, tiny_tower
from llm_fsdp_worker import bridge
from llm_fsdp_worker import train as train_run
from test_conversation_data import gpt, human, write_images
from test_llm_train import write_captions
from torch import nn

from vlm_vit.cli import main
from vlm_vit.train import TrainConfig, TrainResult
from vlm_vit.train import sharded_checkpoint as sharded
from vlm_vit.train.distributed import GlobalBatchSampler
from vlm_vit_llm import MultimodalLM
from vlm_vit_llm.objective import MODEL_DIR
from vlm_vit_llm.records import Turn
from vlm_vit_llm.train import ConversationCollate, ConversationItem, ConversationObjective

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parents[2]
WORKER = TESTS / "llm_fsdp_worker.py"
STAGES = ["projector", "lora"]
# Small enough that AdamW's first steps do not blow float32 rounding (~1e-8) up past 1e-5 in
# weights whose gradient is nearly zero (at 1e-3 one such projector weight moved 1.4e-5 apart
# after two steps); the weights still move ~1e-3 in five steps.
LR = 2e-4


def conversations(objective: ConversationObjective, with_images: bool = False):
    """Two records asking about an image (with `with_images`) or not, as a batch."""
    mm = objective.mm
    question = "<image>\nWhat is in the image?" if with_images else "describe the picture"
    items = [ConversationItem(f"r{i}", [Turn("user", question), Turn("assistant", caption)],
                              [mm.processor.preprocess_one(photo)] if with_images else [])
             for i, (caption, photo) in enumerate(zip(CAPTIONS[:2], photos(2), strict=True))]
    return ConversationCollate(mm, template="vicuna_v1")(items).pixel_values


def loss_and_gradients(objective, batch):
    """The loss, and each trainable tensor's gradient (None: it got none)."""
    objective.zero_grad(set_to_none=True)
    loss = objective(batch).loss
    if loss.requires_grad:
        loss.backward()
    return loss.detach(), {name: p.grad for name, p in objective.named_parameters()
                           if p.requires_grad}


@pytest.mark.parametrize("stage", STAGES)
def test_a_rank_without_images_runs_the_tower_and_adds_exactly_nothing(chat_tokenizer,
                                                                       monkeypatch, stage):
    """One of several processes runs the tower and projector on a blank image for a batch
    without images: the loss and the LLM's gradients are bit for bit those of a run without
    it, and every trainable tower tensor gets a zero gradient instead of none (so DDP's
    all-reduce and FSDP2's reduce-scatter see the same tensors on every rank)."""
    objective = bridge(chat_tokenizer, stage)
    batch = conversations(objective)
    calls = []
    objective.mm.tower.register_forward_hook(lambda *_: calls.append(1))
    with monkeypatch.context() as patch:
        patch.setattr("vlm_vit_llm.model.idle_image_features", lambda mm: None)
        alone_loss, alone = loss_and_gradients(objective, batch)
    assert calls == []
    monkeypatch.setattr("vlm_vit_llm.parallel.several_processes", lambda: True)
    loss, gradients = loss_and_gradients(objective, batch)
    assert len(calls) == 1
    assert torch.equal(loss, alone_loss)
    tower = {name for name in gradients if name.startswith("mm.tower.")}
    assert any("pooler" in name for name in tower)
    assert any(".lora_" in name for name in tower) == (stage == "lora")
    for name, gradient in gradients.items():
        if name in tower:
            assert alone[name] is None and torch.equal(gradient, torch.zeros_like(gradient)), \
                name
        else:
            assert torch.equal(gradient, alone[name]), name


@pytest.mark.parametrize("stage", STAGES)
def test_one_process_runs_the_tower_for_text_only_when_nothing_else_trains(chat_tokenizer,
                                                                           stage):
    """On one process a text-only batch costs no tower call, except in stage 1 (only the
    projector trains), where the loss would otherwise have no gradient to go backward with."""
    objective = bridge(chat_tokenizer, stage)
    calls = []
    objective.mm.tower.register_forward_hook(lambda *_: calls.append(1))
    loss, gradients = loss_and_gradients(objective, conversations(objective))
    assert loss.isfinite()
    assert len(calls) == (stage == "projector")
    projector = gradients["mm.tower.pooler.0.weight"]
    assert projector is None if stage == "lora" else not projector.any()
    with torch.no_grad():
        objective(conversations(objective))
    assert len(calls) == (stage == "projector")  # no gradient, no need


def test_the_export_writes_the_gathered_state_as_a_whole_run_writes_its_own(tmp_path,
                                                                           chat_tokenizer):
    """`export(run_dir, state_dict=...)` (the trainer's call under FSDP2) writes what the
    state holds, frozen base included, through the same save as an unsharded run; the live
    parameters are back afterwards. A checkpoint's state (trainable tensors only) is refused,
    naming a frozen tensor."""
    objective = bridge(chat_tokenizer, "lora")
    live = dict(objective.named_parameters())
    state = {name: tensor.clone() for name, tensor in nn.Module.state_dict(objective).items()}
    frozen = "mm.llm.base_model.model.model.layers.1.mlp.up_proj.weight"
    trained = "mm.tower.pooler.0.weight"
    state[frozen] += 1.0
    state[trained] += 1.0
    objective.export(tmp_path / "own")
    objective.export(tmp_path / "gathered", state_dict=state)
    assert all(parameter is live[name] for name, parameter in objective.named_parameters())
    own = MultimodalLM.from_pretrained(tmp_path / "own" / MODEL_DIR).state_dict()
    gathered = MultimodalLM.from_pretrained(tmp_path / "gathered" / MODEL_DIR).state_dict()
    assert own.keys() == gathered.keys()
    changed = {"llm.base_model.model.model.layers.1.mlp.up_proj.weight", "tower.pooler.0.weight"}
    for name, tensor in own.items():
        expected = tensor + 1.0 if name in changed else tensor
        assert torch.equal(gathered[name], expected), name
    listing = {path.relative_to(tmp_path / "own"): path.read_bytes()
               for path in (tmp_path / "own").rglob("*.json") if path.name != "manifest.json"}
    for path, content in listing.items():
        assert (tmp_path / "gathered" / path).read_bytes() == content, path
    with pytest.raises(ValueError, match=r"lacks \d+ of the model's parameters \(first: mm\."):
        objective.export(tmp_path / "partial", state_dict=objective.state_dict())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, meant
def test_a_distributed_checkpoint_restores_what_trains_and_refuses_another_base(
        tmp_path, chat_tokenizer):
    """The DCP path (`sharded_checkpoint.save` / `load_weights`, here in one process) with the
    bridge's own state dict: the trainable tensors and AdamW's moments come back; a model on
    another frozen base is refused by the fingerprint."""
    trained = bridge(chat_tokenizer, "lora")
    optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad])
    loss_and_gradients(trained, conversations(trained, with_images=True))
    optimizer.step()  # every trainable tensor moves, and has moments
    path = sharded.save(tmp_path / "step", trained, optimizer, {"step": 1}, rank=0,
                        world_size=1)
    saved = set(sharded.tensor_shapes(path))
    assert saved == set(trained.state_dict())  # the trainable tensors and the fingerprint
    fresh = bridge(chat_tokenizer, "lora")
    fresh_optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad])
    assert not torch.equal(fresh.mm.tower.pooler[0].weight, trained.mm.tower.pooler[0].weight)
    sharded.load_weights(path, fresh, fresh_optimizer)
    for name, tensor in nn.Module.state_dict(trained).items():
        assert torch.equal(nn.Module.state_dict(fresh)[name], tensor), name
    moments = [state["exp_avg"] for state in fresh_optimizer.state.values()]
    assert moments and all(m.abs().sum() > 0 for m in moments)
    other = bridge(chat_tokenizer, "lora", llm_seed=1)
    with pytest.raises(ValueError, match="the frozen LLM/encoder differs .*: mm.llm changed"):
        sharded.load_weights(path, other)


def test_llm_train_passes_the_strategy_to_the_trainer(tmp_path, tokenizer, monkeypatch):
    tiny_tower().encoder.save_pretrained(tmp_path / "encoder")
    tiny_llm().save_pretrained(tmp_path / "llm")
    tokenizer.save_pretrained(tmp_path / "llm")
    write_captions(tmp_path / "data")
    configs: list[TrainConfig] = []

    class Recorder:
        def __init__(self, objective, dataset, config, run_dir, **kwargs):
            configs.append(config)
            self.run_dir = run_dir

        def fit(self, resume=False, overwrite=False):
            return TrainResult(1, [1.0], 0, 0, [], self.run_dir)

    monkeypatch.setattr("vlm_vit.train.Trainer", Recorder)
    common = ["llm", "train", "--data", str(tmp_path / "data"), "--captions",
              str(tmp_path / "data" / "captions.jsonl"), "--tower", str(tmp_path / "encoder"),
              "--llm", str(tmp_path / "llm"), "--out", str(tmp_path / "run"), "--device", "cpu"]
    assert main(common) == 0
    assert main([*common, "--strategy", "fsdp", "--cpu-offload"]) == 0
    assert [(c.strategy, c.cpu_offload) for c in configs] == [("ddp", False), ("fsdp", True)]


# -- two processes -------------------------------------------------------------------------


def write_conversations(folder: Path, text_only: set[int], count: int) -> Path:
    """`count` records asking about an image, those in `text_only` without one."""
    write_images(folder / "images")
    lines = []
    for index in range(count):
        answer = gpt(CAPTIONS[index % 4])
        if index in text_only:
            lines.append({"id": str(index), "conversations": [human("describe the picture"),
                                                             answer]})
        else:
            lines.append({"id": str(index), "image": f"{index % 4}.png",
                          "conversations": [human("<image>\nWhat is in the image?"), answer]})
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, spec: dict, timeout: int = 500) -> None:
    """Runs the worker's runs on two gloo processes; fails with their output's tail."""
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(WORKER),
               str(spec_path)]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]


def rank_1_records(steps: int) -> set[int]:
    """The records that rank 1 of 2 reads in `steps` global batches of 4."""
    return {index for batch in GlobalBatchSampler(4 * steps, 4, seed=0, rank=1, world_size=2)
            for index in batch}


TEXT_ONLY_STEPS = 3  # the scenario where rank 1 sees only text
TILED_STEPS = 2


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, chat_tokenizer_dir) -> Path:
    """Every two-process scenario below, each in its folder with its own records, trained in
    one launch (each launch's start costs more than a short run): per stage, DDP and FSDP2
    packed with a third of the records text-only (FSDP2 with activation checkpointing and a
    resume after 3 of 5 steps) in `packed_<stage>/`, and DDP and FSDP2 where rank 1 sees only
    text in `text_only_<stage>/`; AnyRes tiles under DDP and FSDP2 in `tiled/`."""
    root = tmp_path_factory.mktemp("two_ranks")
    runs = []

    def scenario(name: str, text_only: set[int], count: int, **run) -> None:
        folder = root / name
        data = write_conversations(folder, text_only, count)
        strategies = {"ddp": {}, "fsdp": {}}
        if name.startswith("packed"):
            strategies["fsdp"] = {"split": 3, "grad_checkpointing": True}
        runs.extend({"lr": LR, "data": str(data), "images": str(folder / "images"),
                     "strategy": strategy, "run_dir": str(folder / strategy), **run, **extra}
                    for strategy, extra in strategies.items())

    for stage in (1, 2):
        scenario(f"packed_{stage}", {i for i in range(20) if i % 3 == 2}, 20, stage=stage,
                 steps=5, packing=True)
        scenario(f"text_only_{stage}", rank_1_records(TEXT_ONLY_STEPS), 4 * TEXT_ONLY_STEPS,
                 stage=stage, steps=TEXT_ONLY_STEPS)
    rank_1 = rank_1_records(TILED_STEPS)
    scenario("tiled", set(sorted(rank_1)[len(rank_1) // 2:]), 4 * TILED_STEPS, stage=1,
             steps=TILED_STEPS, packing=True, tiled=True)
    from test_llm_anyres import image

    for index, size in enumerate([(90, 120), (61, 41), (40, 100), (33, 33)]):
        image(*size).save(root / "tiled" / "images" / f"{index}.png")
    launch(root, {"tokenizer": str(chat_tokenizer_dir), "runs": runs})
    return root


def results(run_dir: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A run's losses and its exported model's weights."""
    losses = json.loads((run_dir / "losses.json").read_text()) if (
        run_dir / "losses.json").is_file() else None
    return losses, MultimodalLM.from_pretrained(run_dir / MODEL_DIR).state_dict()


def assert_same_run(ours: Path, reference: Path, reference_losses=None) -> None:
    losses, weights = results(ours)
    expected_losses, expected = results(reference)
    # The losses are near 12 (a random LLM); 1e-5 of that is float32 reduction order.
    torch.testing.assert_close(losses, reference_losses or expected_losses, rtol=1e-5, atol=0)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow  # the two-process launch
@pytest.mark.parametrize("stage", [1, 2])
def test_fsdp_trains_as_ddp_and_resumes_from_its_sharded_checkpoint(two_ranks, stage):
    """Five steps at two ranks, a third of the records text-only, packed into rows: FSDP2
    with activation checkpointing (three steps, then a resume from its distributed
    checkpoint onto a model built afresh, whose frozen base the fingerprint checks) gives
    DDP's losses and exported model."""
    runs = two_ranks / f"packed_{stage}"
    assert any((runs / "fsdp" / "checkpoints").glob("step_00000003/__1_0.distcp"))
    assert_same_run(runs / "fsdp", runs / "ddp")
    ddp_files = sorted(p.relative_to(runs / "ddp" / MODEL_DIR)
                       for p in (runs / "ddp" / MODEL_DIR).rglob("*"))
    assert ddp_files == sorted(p.relative_to(runs / "fsdp" / MODEL_DIR)
                               for p in (runs / "fsdp" / MODEL_DIR).rglob("*"))


def one_process(two_ranks: Path, chat_tokenizer_dir: Path, scenario: str) -> list[float]:
    """The scenario's DDP run again in this process (the union of the two ranks' batches)
    into `one/`; its losses."""
    folder = two_ranks / scenario
    spec = json.loads((two_ranks / "spec.json").read_text())
    run = next(run for run in spec["runs"] if run["run_dir"] == str(folder / "ddp"))
    one = {**run, "run_dir": str(folder / "one")}
    return train_run({"tokenizer": str(chat_tokenizer_dir)}, one, run["steps"], resume=False)


@pytest.mark.slow  # the two-process launch, and one process
@pytest.mark.parametrize("stage", [1, 2])
def test_a_rank_that_sees_only_text_finishes_and_matches_one_process(two_ranks,
                                                                    chat_tokenizer_dir,
                                                                    stage):
    """Rank 1's records are all text-only, rank 0's all have an image: under DDP and FSDP2
    every step completes (the timeout would catch a hang), and the losses and weights are
    those of one process training on the union of the two ranks' batches."""
    losses = one_process(two_ranks, chat_tokenizer_dir, f"text_only_{stage}")
    for strategy in ("ddp", "fsdp"):
        assert_same_run(two_ranks / f"text_only_{stage}" / strategy,
                        two_ranks / f"text_only_{stage}" / "one", reference_losses=losses)


@pytest.mark.slow  # the two-process launch, and one process
def test_a_tiled_tower_trains_under_ddp_and_fsdp_as_one_process(two_ranks, chat_tokenizer_dir):
    """AnyRes at two ranks: photos of four shapes (so the ranks' tiled views differ in
    number), rank 1's records text-only in the second step; DDP and FSDP2, packed, give one
    process's losses and weights on the union of the batches."""
    losses = one_process(two_ranks, chat_tokenizer_dir, "tiled")
    tiled = two_ranks / "tiled"
    assert MultimodalLM.from_pretrained(tiled / "fsdp" / MODEL_DIR).tower.tiling is not None
    for strategy in ("ddp", "fsdp"):
        assert_same_run(tiled / strategy, tiled / "one", reference_losses=losses)
