"""`vlm-vit llm merge` (issue 27, 7): a stage-2 model's LoRA folded into its weights, a plain
model out, from which stage 2 continues."""

import json

import pytest
import torch
from conftest import perturb_lora, photos, tiny_llm, tiny_tower
from test_llm_train import write_captions

from vlm_vit.cli import main
from vlm_vit_llm import MultimodalLM

PROMPTS = ["<image>\nwhat is in the image", "<image> the dog <image>"]


@pytest.fixture
def lora_model(tmp_path, tokenizer):
    """A saved model with LoRA on the LLM and the encoder, every adapter non-zero."""
    mm = MultimodalLM(tiny_tower(), tiny_llm(), tokenizer)
    mm.add_lora(r=4, encoder_targets="attn")
    torch.manual_seed(1)
    perturb_lora(mm)
    mm.save_pretrained(tmp_path / "stage2")
    return tmp_path / "stage2"


def logits(mm):
    images = photos(3)
    with torch.no_grad():
        return mm.eval()(PROMPTS, [[images[0]], [images[1], images[2]]]).logits


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("vlm-vit")]
    assert len(lines) == 1, err
    return lines[0]


def test_merge_writes_a_plain_model_with_the_lora_models_logits_and_stage_2_continues(
        lora_model, tmp_path, capsys, tokenizer):
    assert main(["llm", "merge", str(lora_model), "--out", str(tmp_path / "merged")]) == 0
    assert "LoRA merged" in capsys.readouterr().out
    merged_dir = tmp_path / "merged"
    config = json.loads((merged_dir / "multimodal_config.json").read_text())
    assert not config["llm_adapter"] and not config["vision_adapter"]
    assert not (merged_dir / "llm_adapter").exists()
    assert not (merged_dir / "vision_adapter").exists()

    with_lora = MultimodalLM.from_pretrained(lora_model)
    merged = MultimodalLM.from_pretrained(merged_dir)
    assert not hasattr(merged.llm, "peft_config")
    assert not hasattr(merged.tower.encoder, "peft_config")
    ours, theirs = logits(with_lora), logits(merged)
    base = MultimodalLM(tiny_tower(), tiny_llm(), tokenizer)  # the weights under the LoRA
    assert not torch.allclose(logits(base), ours, atol=1e-3)  # the adapters do count
    # float32 sums in another order (W + BA, then x @ W) with these large random weights
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)

    # Stage 2 on the LoRA model is refused, naming the merge; on the merged one it trains.
    write_captions(tmp_path / "data")
    train = ["llm", "train", "--data", str(tmp_path / "data"), "--captions",
             str(tmp_path / "data" / "captions.jsonl"), "--steps", "2", "--batch-size", "2",
             "--num-workers", "0", "--device", "cpu", "--quiet", "--stage", "2",
             "--lora-r", "4"]
    assert main([*train, str(lora_model), "--out", str(tmp_path / "refused")]) == 1
    assert one_error_line(capsys) == (
        f"vlm-vit llm: error: MODEL {lora_model} holds LoRA adapters; merge them first "
        f"(vlm-vit llm merge {lora_model} --out DIR), then train --stage 2 from DIR")
    assert main([*train, str(merged_dir), "--out", str(tmp_path / "s2")]) == 0
    assert "trained stage 2 for 2 steps" in capsys.readouterr().out
    again = json.loads((tmp_path / "s2" / "model" / "multimodal_config.json").read_text())
    assert again["llm_adapter"]


def test_merge_refuses_an_out_that_is_or_holds_the_model_and_a_model_without_lora(
        lora_model, tmp_path, capsys):
    for out, problem in ((lora_model, f"is inside the model folder {lora_model}"),
                         (tmp_path, f"holds the model {lora_model}, which writing --out would "
                          "replace")):
        assert main(["llm", "merge", str(lora_model), "--out", str(out)]) == 1
        assert one_error_line(capsys) == (
            f"vlm-vit llm: error: --out {out} {problem}; write the output elsewhere")
    assert (lora_model / "llm_adapter").is_dir()  # untouched

    assert main(["llm", "merge", str(lora_model), "--out", str(tmp_path / "m1")]) == 0
    capsys.readouterr()
    assert main(["llm", "merge", str(tmp_path / "m1"), "--out", str(tmp_path / "m2")]) == 1
    assert one_error_line(capsys) == (f"vlm-vit llm: error: MODEL {tmp_path / 'm1'} has no LoRA "
                                      "adapter: nothing to merge")
    assert not (tmp_path / "m2").exists()
