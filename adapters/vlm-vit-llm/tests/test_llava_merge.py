"""The LLaVA export merges LoRA into the tensors it writes, one weight at a time: no copy of
the model, the caller's model and tokenizer unchanged, peft's merge exactly."""

import copy

import pytest
import torch
from conftest import assert_export_matches, perturb_lora, photos
from peft.tuners.lora import LoraLayer
from torch import nn

from vlm_vit_llm import MultimodalLM, export_llava
from vlm_vit_llm.peft_helpers import merged_state

PROMPTS = ["<image>\nwhat is in the image", "<image> the dog <image>"]


def with_lora(mm, encoder_targets: str, dropout: float = 0.0):
    mm.add_lora(r=4, dropout=dropout, encoder_targets=encoder_targets)
    torch.manual_seed(1)
    perturb_lora(mm, hold_key_rows=encoder_targets == "attn_qv")
    return mm.eval()


@pytest.mark.parametrize("encoder_targets", ["attn", "attn_qv"])
def test_export_merges_lora_without_copying_the_model(mm, tmp_path, monkeypatch,
                                                      encoder_targets):
    """Dropout on the LoRA branch (here 0.1) has no part in the merged weights."""
    with_lora(mm, encoder_targets, dropout=0.1)
    images = photos(3)
    per_prompt = [[images[0]], [images[1], images[2]]]
    with torch.no_grad():
        ours = mm(PROMPTS, per_prompt).logits
    before = {name: tensor.clone() for name, tensor in mm.state_dict().items()}
    deepcopy = copy.deepcopy

    def no_module_copies(value, *args, **kwargs):
        if isinstance(value, nn.Module):
            raise AssertionError(f"export deep-copied a {type(value).__name__}")
        return deepcopy(value, *args, **kwargs)

    def no_merged_copy(self):
        raise AssertionError("export called MultimodalLM.merged")

    monkeypatch.setattr(copy, "deepcopy", no_module_copies)
    monkeypatch.setattr(MultimodalLM, "merged", no_merged_copy)
    export_llava(mm, tmp_path / "llava")
    monkeypatch.undo()

    # The caller's model: the same tensors, LoRA still on and unmerged, the same logits.
    after = mm.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    assert hasattr(mm.llm, "peft_config") and hasattr(mm.tower.encoder, "peft_config")
    layers = [module for module in mm.modules() if isinstance(module, LoraLayer)]
    assert layers and not any(layer.merged for layer in layers)
    assert mm.tokenizer.pad_token is None  # only the exported copy pads
    with torch.no_grad():
        torch.testing.assert_close(mm(PROMPTS, per_prompt).logits, ours, rtol=0, atol=0)

    assert_export_matches(mm, tmp_path / "llava", PROMPTS, per_prompt, images)


@pytest.mark.parametrize("encoder_targets", ["attn", "attn_qv"])
def test_merged_state_is_peft_merge_exactly_and_shares_what_lora_leaves(mm, encoder_targets):
    with_lora(mm, encoder_targets)
    merged = mm.merged()  # peft's merge_and_unload, on a copy
    for ours, peft_merged in ((mm.llm, merged.llm), (mm.tower.encoder, merged.tower.encoder)):
        state, expected = merged_state(ours), peft_merged.state_dict()
        assert state.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), name
    state = merged_state(mm.llm)
    base = mm.llm.get_base_model()
    # Weights without LoRA are the model's own tensors, not copies.
    assert state["model.norm.weight"].data_ptr() == base.model.norm.weight.data_ptr()
    wrapped = base.model.layers[0].self_attn.q_proj.base_layer.weight
    assert state["model.layers.0.self_attn.q_proj.weight"].data_ptr() != wrapped.data_ptr()


def test_a_dora_adapter_is_refused(mm):
    import peft

    config = peft.LoraConfig(r=4, use_dora=True, target_modules=["q_proj"])
    mm.llm = peft.get_peft_model(mm.llm, config)
    with pytest.raises(ValueError, match=r"q_proj: adapter 'default' is not plain LoRA"):
        merged_state(mm.llm)
