"""Saves and exports: a new save replaces the old one whole, and every weight folder is
verified on load (issue 26: stale weights, unverified folders)."""

import pytest
import torch
from conftest import tiny_llm, tiny_tower
from safetensors.torch import load_file

from vlm_vit.io.integrity import IntegrityError
from vlm_vit.testing import flip_bytes
from vlm_vit_llm import MultimodalLM, export_llava
from vlm_vit_llm.chat import adopt_chat_template


def _nudge_projector(mm, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in mm.tower.pooler.parameters():
            parameter.add_(torch.randn_like(parameter))


def _pooler_state(mm):
    return {name: tensor.clone() for name, tensor in mm.tower.pooler.state_dict().items()}


def test_a_second_save_over_the_first_loads_the_second(mm, tmp_path):
    folder = tmp_path / "model"
    mm.save_pretrained(folder)
    (folder / "notes.txt").write_text("mine")  # the user's own file is carried over
    _nudge_projector(mm, seed=1)
    second = _pooler_state(mm)
    mm.save_pretrained(folder)
    loaded = MultimodalLM.from_pretrained(folder)
    for name, tensor in loaded.tower.pooler.state_dict().items():
        assert torch.equal(tensor, second[name]), name
    assert (folder / "notes.txt").read_text() == "mine"


def test_a_save_without_adapters_over_one_with_them_leaves_no_adapter(mm, tmp_path):
    folder = tmp_path / "model"
    lora = MultimodalLM(tiny_tower(), tiny_llm(), mm.tokenizer).add_lora(
        r=4, encoder_targets="attn")
    lora.save_pretrained(folder)
    assert (folder / "llm_adapter").is_dir() and (folder / "vision_adapter").is_dir()
    mm.save_pretrained(folder)
    assert not (folder / "llm_adapter").exists()
    assert not (folder / "vision_adapter").exists()


def test_an_export_over_an_earlier_export_keeps_none_of_its_tokenizer(
        mm, tmp_path, tokenizer_dir, chatml_tokenizer):
    folder = tmp_path / "llava"
    adopt_chat_template(mm.tokenizer, "plain")
    export_llava(mm, folder)
    first_template = (folder / "chat_template.jinja").read_text()
    # An export by transformers 4 also held the SentencePiece model.
    (folder / "tokenizer.model").write_bytes((tokenizer_dir / "tokenizer.model").read_bytes())
    chatml_tokenizer.chat_template = None  # the second model has no template of its own
    other = MultimodalLM(tiny_tower(), tiny_llm(vocab_size=512), chatml_tokenizer)
    export_llava(other, folder)
    export_llava(other, tmp_path / "fresh")  # what the second export alone writes
    assert not (folder / "tokenizer.model").exists()
    # The export writes a template (its own, else vicuna_v1's, issue 27): the second one's.
    second_template = (folder / "chat_template.jinja").read_text()
    assert second_template != first_template
    assert second_template == (tmp_path / "fresh" / "chat_template.jinja").read_text()
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(folder)) == len(chatml_tokenizer)


def test_a_resumed_cli_run_leaves_its_own_final_model(tmp_path, tokenizer, capsys):
    """`llm train --steps 2`, then `--steps 4 --resume`: `RUN/model` is step 4's, not 2's."""
    from test_llm_train import write_captions

    from vlm_vit.cli import main

    tiny_tower().encoder.save_pretrained(tmp_path / "encoder")
    tiny_llm().save_pretrained(tmp_path / "llm")
    tokenizer.save_pretrained(tmp_path / "llm")
    write_captions(tmp_path / "data")
    run = tmp_path / "run"
    common = ["llm", "train", "--data", str(tmp_path / "data"), "--captions",
              str(tmp_path / "data" / "captions.jsonl"), "--batch-size", "2",
              "--num-workers", "0", "--device", "cpu", "--lr", "1e-2", "--warmup-steps", "0",
              "--checkpoint-every", "2", "--tower", str(tmp_path / "encoder"),
              "--llm", str(tmp_path / "llm"), "--out", str(run)]
    assert main([*common, "--steps", "2"]) == 0
    pooler = run / "model" / "tower" / "pooler.safetensors"
    step_2 = load_file(pooler)
    assert main([*common, "--steps", "4", "--resume"]) == 0
    assert f"model in {run / 'model'}" in capsys.readouterr().out
    step_4 = load_file(pooler)
    assert any(not torch.equal(step_4[name], step_2[name]) for name in step_2)
    final = MultimodalLM.from_pretrained(run / "model").tower.pooler.state_dict()
    assert all(torch.equal(final[name], step_4[name]) for name in step_4)


@pytest.mark.parametrize("folder", ["llm", "llm_adapter", "vision_adapter"])
def test_flipped_bytes_in_any_weight_folder_are_refused_on_load(mm, tmp_path, folder):
    mm.add_lora(r=4, encoder_targets="attn")
    mm.save_pretrained(tmp_path / "model")
    weights = sorted((tmp_path / "model" / folder).glob("*.safetensors"))
    assert weights, folder
    flip_bytes(weights[0], -8, 8)
    with pytest.raises(IntegrityError, match=str(weights[0])):
        MultimodalLM.from_pretrained(tmp_path / "model")
    MultimodalLM.from_pretrained(tmp_path / "model", verify=False)  # loads when asked to


def test_a_file_planted_in_a_weight_folder_is_refused(mm, tmp_path):
    mm.save_pretrained(tmp_path / "model")
    planted = tmp_path / "model" / "llm" / "model-00002-of-00002.safetensors"
    planted.write_bytes((tmp_path / "model" / "llm" / "model.safetensors").read_bytes())
    with pytest.raises(IntegrityError, match="not listed"):
        MultimodalLM.from_pretrained(tmp_path / "model")
