"""`BridgeObjective`: checkpoints hold the trainable tensors and a fingerprint of the frozen
base; gradient checkpointing changes nothing but memory; the trainer resumes exactly."""

import io

import pytest
import torch
from conftest import CAPTIONS, perturb_lora, photos, tiny_llm, tiny_tower
from test_llm_train import write_captions
from torch import nn

from vlm_vit.train import TrainConfig, Trainer
from vlm_vit.train.checkpoint import list_checkpoints, load_checkpoint
from vlm_vit_llm import MultimodalLM
from vlm_vit_llm.objective import FINGERPRINT_KEY
from vlm_vit_llm.train import CaptionCollate, CaptionFolder, CaptionObjective

STAGES = ["projector", "lora"]


def objective(tokenizer, stage: str, lora_seed: int = 0,
              llm_seed: int = 0) -> CaptionObjective:
    mm = MultimodalLM(tiny_tower(), tiny_llm(seed=llm_seed), tokenizer)
    torch.manual_seed(lora_seed)  # LoRA's A matrices start random
    if stage == "projector":
        mm.train_projector_only()
    else:
        mm.add_lora(r=4, encoder_targets="attn")  # the last block's LoRA stays frozen
    return CaptionObjective(mm)


def plain(module: nn.Module) -> nn.Module:
    """The module under peft's wrapper, if any."""
    return module.get_base_model() if hasattr(module, "peft_config") else module


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return nn.Module.state_dict(module)


def saved_size(state) -> int:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


@pytest.mark.parametrize("stage", STAGES)
def test_the_state_dict_holds_the_trainable_tensors_and_a_fingerprint(tokenizer, stage):
    obj = objective(tokenizer, stage)
    state = obj.state_dict()
    names = set(state) - {FINGERPRINT_KEY}
    trainable = {name for name, p in obj.named_parameters() if p.requires_grad}
    if stage == "projector":
        pooler = {n for n in full_state(obj) if n.startswith("mm.tower.pooler.")}
        assert names == trainable == pooler
    else:
        # Every LoRA tensor: the trained ones, and those on encoder blocks past the feature
        # layer, held frozen (their random A would otherwise enter the base's fingerprint).
        lora = {n for n in full_state(obj) if ".lora_" in n}
        assert names == {n for n in trainable if n.startswith("mm.tower.pooler.")} | lora
        assert trainable < names and any(".blocks.2." in n for n in names - trainable)
    fingerprint = state[FINGERPRINT_KEY]
    assert fingerprint.dtype == torch.uint8 and fingerprint.shape == (2, 32)  # llm, tower
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True).keys() == state.keys()
    assert saved_size(state) * 5 < saved_size(full_state(obj))


@pytest.mark.parametrize("stage", STAGES)
def test_a_round_trip_restores_the_trainable_tensors_exactly(tokenizer, stage):
    trained = objective(tokenizer, stage)
    torch.manual_seed(3)
    perturb_lora(trained.mm)
    with torch.no_grad():
        for parameter in trained.mm.tower.pooler.parameters():
            parameter.add_(torch.randn_like(parameter))
    state = trained.state_dict()
    fresh = objective(tokenizer, stage, lora_seed=1)  # another LoRA init, the same base
    assert fresh.load_state_dict(state) == ([], [])
    ours, theirs = full_state(fresh), full_state(trained)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize(("part", "where"), [("mm.llm", "model.layers.1.mlp.up_proj"),
                                              ("mm.tower", "blocks.0.mlp.fc1")])
def test_a_changed_frozen_base_is_refused(tokenizer, part, where):
    state = objective(tokenizer, "lora").state_dict()
    other = objective(tokenizer, "lora")
    owner = other.mm.llm if part == "mm.llm" else other.mm.tower.encoder
    with torch.no_grad():
        plain(owner).get_submodule(where).weight[0, 0] += 1e-3  # one frozen weight, a little
    other = CaptionObjective(other.mm)  # the fingerprint is taken when the objective is built
    before = {name: tensor.clone() for name, tensor in other.state_dict().items()}
    with pytest.raises(ValueError, match=rf"the frozen LLM/encoder differs from the one this "
                                         rf"checkpoint was trained on: {part} changed "
                                         rf"\('{FINGERPRINT_KEY}'"):
        other.load_state_dict(state)
    for name, tensor in other.state_dict().items():
        assert torch.equal(tensor, before[name]), name  # nothing loaded


def test_strict_loading_names_missing_and_unexpected_tensors(tokenizer):
    obj = objective(tokenizer, "projector")
    state = obj.state_dict()
    del state["mm.tower.pooler.0.bias"]
    state["mm.tower.pooler.9.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing \['mm.tower.pooler.0.bias'\], "
                                         r"unexpected \['mm.tower.pooler.9.weight'\]"):
        obj.load_state_dict(state)
    result = obj.load_state_dict(state, strict=False)
    assert result == (["mm.tower.pooler.0.bias"], ["mm.tower.pooler.9.weight"])


def test_a_whole_state_dict_from_before_still_loads(tokenizer):
    """Checkpoints written before this class hold every tensor and no fingerprint."""
    trained = objective(tokenizer, "projector")
    with torch.no_grad():
        trained.mm.tower.pooler[0].weight.add_(1.0)
    fresh = objective(tokenizer, "projector")
    fresh.load_state_dict(full_state(trained))
    assert torch.equal(fresh.mm.tower.pooler[0].weight, trained.mm.tower.pooler[0].weight)


def loss_and_gradients(obj, checkpointing: bool):
    obj.set_gradient_checkpointing(checkpointing)
    obj.train()
    calls = {"llm": 0, "encoder": 0}
    # Pre-hooks: a recomputation stops early, once it has what backward needs, so a
    # forward hook would not see it. transformers checkpoints a layer's `forward`, not its
    # call, so the LLM's count is at the layer's first module.
    hooks = [plain(obj.mm.llm).model.layers[0].input_layernorm,
             plain(obj.mm.tower.encoder).blocks[0]]
    handles = [module.register_forward_pre_hook(
        lambda *_, key=key: calls.__setitem__(key, calls[key] + 1))
        for key, module in zip(calls, hooks, strict=True)]
    obj.zero_grad(set_to_none=True)
    pixels = torch.stack([obj.mm.processor.preprocess_one(p) for p in photos(2)])
    labels = CaptionCollate(obj.mm)([(pixels[0], CAPTIONS[0], None),
                                     (pixels[1], CAPTIONS[1], "what is in the image <image>")])
    loss = obj(labels.pixel_values, labels.labels).loss
    loss.backward()
    for handle in handles:
        handle.remove()
    gradients = {name: p.grad.clone() for name, p in obj.named_parameters() if p.grad is not None}
    return loss.detach(), gradients, calls


@pytest.mark.parametrize("stage", STAGES)
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tokenizer, stage):
    """In train mode, with the LLM frozen (stage 1: gradients reach the projector only
    through the input embeddings) and with LoRA in the LLM and the encoder (stage 2)."""
    obj = objective(tokenizer, stage)
    torch.manual_seed(3)
    perturb_lora(obj.mm)
    loss, gradients, calls = loss_and_gradients(obj, checkpointing=False)
    loss_again, gradients_again, calls_again = loss_and_gradients(obj, checkpointing=True)
    torch.testing.assert_close(loss_again, loss, rtol=1e-5, atol=1e-5)
    assert gradients_again.keys() == gradients.keys()
    assert {name.split(".")[1] for name in gradients} == (
        {"tower"} if stage == "projector" else {"tower", "llm"})
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradients_again[name], gradient, rtol=1e-5, atol=1e-5)
    # Checkpointed layers run again in backward: the LLM's always, the encoder's when it
    # trains (a frozen encoder runs without a graph, so there is nothing to recompute).
    assert calls == {"llm": 1, "encoder": 1}
    assert calls_again == {"llm": 2, "encoder": 1 if stage == "projector" else 2}
    assert plain(obj.mm.tower.encoder).gradient_checkpointing
    obj.set_gradient_checkpointing(False)
    assert loss_and_gradients(obj, checkpointing=False)[2] == {"llm": 1, "encoder": 1}


def fit(obj, data, run_dir, steps: int, resume: bool = False):
    # A constant LR (min_lr = lr), so a 4-step run resumed to 8 follows the 8-step schedule.
    config = TrainConfig(steps=steps, batch_size=2, lr=3e-3, min_lr=3e-3, weight_decay=0.0,
                         num_workers=0, checkpoint_every=4, keep_checkpoints=0, log_every=100,
                         device="cpu")
    dataset = CaptionFolder(data, data / "captions.jsonl", obj.mm.processor)
    return Trainer(obj, dataset, config, run_dir, collate=CaptionCollate(obj.mm),
                   progress=False).fit(resume=resume)


@pytest.mark.parametrize("stage", STAGES)
def test_the_trainer_resumes_exactly_from_small_checkpoints(tmp_path, tokenizer, stage):
    data = tmp_path / "data"
    write_captions(data)
    straight = objective(tokenizer, stage)
    expected = fit(straight, data, tmp_path / "straight", steps=8)

    first = objective(tokenizer, stage)
    fit(first, data, tmp_path / "resumed", steps=4)
    # A new process: the same base, another LoRA init; the checkpoint restores the rest.
    second = objective(tokenizer, stage, lora_seed=1)
    result = fit(second, data, tmp_path / "resumed", steps=8, resume=True)

    assert len(result.losses) == 8
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(expected.losses),
                               rtol=0, atol=1e-6)
    for name, tensor in full_state(straight).items():
        torch.testing.assert_close(full_state(second)[name], tensor, rtol=0, atol=1e-6)

    (step, path), *_ = list_checkpoints(tmp_path / "resumed")
    assert step == 4
    assert set(load_checkpoint(path)["objective"]) == set(second.state_dict())
    # Trainable tensors, their AdamW moments and the RNG states: less than the weights alone.
    assert path.stat().st_size < saved_size(full_state(second))
    assert (tmp_path / "resumed" / "model" / "multimodal_config.json").is_file()


def test_a_resume_onto_another_llm_is_refused(tmp_path, tokenizer):
    data = tmp_path / "data"
    write_captions(data)
    fit(objective(tokenizer, "projector"), data, tmp_path / "run", steps=4)
    with pytest.raises(ValueError, match="mm.llm changed"):
        fit(objective(tokenizer, "projector", llm_seed=1), data, tmp_path / "run", steps=8,
            resume=True)


def test_the_image_token_row_is_the_same_in_every_process(tokenizer_dir):
    """Adding the image token grows the embeddings; the new row is the old rows' mean (as
    LLaVA's), not random, so a resumed process builds the base its checkpoint names."""
    from transformers import LlamaTokenizer

    built = []
    for seed in (1, 2):
        tokenizer = LlamaTokenizer.from_pretrained(tokenizer_dir)
        tower, llm = tiny_tower(), tiny_llm(vocab_size=len(tokenizer))
        torch.manual_seed(seed)  # whatever the script drew before
        mm = MultimodalLM(tower, llm, tokenizer).train_projector_only()
        built.append(CaptionObjective(mm))
    for matrix in (built[0].mm.llm.get_input_embeddings().weight,
                   built[0].mm.llm.get_output_embeddings().weight):
        assert matrix.shape[0] == len(tokenizer) == 121
        torch.testing.assert_close(matrix[-1], matrix[:-1].mean(dim=0), rtol=0, atol=0)
    built[1].load_state_dict(built[0].state_dict())  # the same fingerprint
