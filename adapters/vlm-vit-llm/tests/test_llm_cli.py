"""`vlm-vit llm ...`: the plugin's subcommands, reached through the core CLI's entry point."""

import json
import re

import pytest
from conftest import tiny_llm

from vlm_vit.cli import main


def train_args(parts, *extra):
    return ["llm", "train", "--data", str(parts / "data"), "--captions",
            str(parts / "data" / "captions.jsonl"), "--steps", "3", "--batch-size", "2",
            "--num-workers", "0", "--device", "cpu", *extra]


def test_train_both_stages_then_generate_and_export(parts, capsys):
    from transformers import LlavaForConditionalGeneration

    assert main(train_args(parts, "--tower", str(parts / "encoder"), "--llm",
                           str(parts / "llm"), "--out", str(parts / "s1"))) == 0
    assert "trained stage 1 for 3 steps" in capsys.readouterr().out
    stage_1 = parts / "s1" / "model"
    assert json.loads((stage_1 / "multimodal_config.json").read_text())["llm_adapter"] is False

    assert main(train_args(parts, str(stage_1), "--stage", "2", "--lora-r", "4",
                           "--lora-encoder", "attn", "--out", str(parts / "s2"))) == 0
    capsys.readouterr()
    stage_2 = parts / "s2" / "model"
    config = json.loads((stage_2 / "multimodal_config.json").read_text())
    assert config["llm_adapter"] and config["vision_adapter"]

    assert main(["llm", "generate", str(stage_2), "--image", str(parts / "data" / "0.png"),
                 "--max-new-tokens", "4"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1

    assert main(["llm", "export", str(stage_2), "--out", str(parts / "llava")]) == 0
    assert "LlavaForConditionalGeneration" in capsys.readouterr().out
    LlavaForConditionalGeneration.from_pretrained(parts / "llava")


@pytest.mark.parametrize(("args", "message"), [
    (["--out", "run"], "give MODEL (a saved multimodal model), or both --tower and --llm"),
    (["--tower", "nowhere", "--llm", "nowhere", "--out", "run"],
     "--llm: nowhere does not exist (and is not a Hugging Face Hub name like org/name)"),
    (["--tower", "nowhere", "--llm", "no-org/no-llm", "--out", "run"],
     "--llm: no-org/no-llm is not a local path, and no-org/no-llm is not in the Hugging Face "
     "cache at "),
])
def test_a_user_error_is_one_line_and_exit_1(parts, capsys, args, message, monkeypatch):
    monkeypatch.chdir(parts)
    assert main(train_args(parts, *args)) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vlm-vit llm: error: {message}")


def test_generate_refuses_a_prompt_without_its_placeholder(parts, capsys):
    assert main(train_args(parts, "--tower", str(parts / "encoder"), "--llm",
                           str(parts / "llm"), "--out", str(parts / "s1"))) == 0
    capsys.readouterr()
    assert main(["llm", "generate", str(parts / "s1" / "model"), "--image",
                 str(parts / "data" / "0.png"), "--prompt", "no placeholder"]) == 1
    assert ("--prompt has 0 '<image>' placeholder(s) but 1 --image(s): 'no placeholder'"
            in capsys.readouterr().err)


def test_train_on_llava_conversations_then_chat(parts, tmp_path, capsys, chat_tokenizer):
    from test_conversation_data import BAD, GOOD, write_images, write_records

    tiny_llm(vocab_size=512).save_pretrained(tmp_path / "chat_llm")
    chat_tokenizer.save_pretrained(tmp_path / "chat_llm")
    images = write_images(tmp_path / "images")
    data = write_records(tmp_path / "data.json", [*GOOD, BAD[1][0]], lines=False)
    common = ["llm", "train", "--data-format", "llava", "--data", str(data), "--image-folder",
              str(images), "--steps", "2", "--batch-size", "2", "--num-workers", "0",
              "--device", "cpu"]
    assert main([*common, "--tower", str(parts / "encoder"), "--llm", str(tmp_path / "chat_llm"),
                 "--template", "plain", "--out", str(tmp_path / "s1")]) == 0
    captured = capsys.readouterr()
    assert "trained stage 1 for 2 steps" in captured.out
    assert "skipped 1 bad record(s) of 5" in captured.err and "(id many)" in captured.err
    assert main([*common, str(tmp_path / "s1" / "model"), "--stage", "2",
                 "--lora-r", "4", "--template", "vicuna_v1", "--group-by-length",
                 "--grad-checkpointing", "--max-length", "120",
                 "--out", str(tmp_path / "s2")]) == 0
    run_config = json.loads((tmp_path / "s2" / "run_config.json").read_text())
    assert run_config["train"]["group_by_length"] and run_config["train"]["grad_checkpointing"]
    capsys.readouterr()
    assert main(["llm", "generate", str(tmp_path / "s2" / "model"), "--chat", "--image",
                 str(images / "0.png"), "--prompt", "<image>\nWhat is it?",
                 "--max-new-tokens", "3"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1

    # Bad input: one line, exit 1.
    assert main([*common, str(tmp_path / "s1" / "model"), "--strict",
                 "--out", str(tmp_path / "s3")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(id many): 2 '<image>' placeholder(s) but 1 image(s)" in err[0]
    no_folder = [a for a in common if a not in ("--image-folder", str(images))]
    assert main([*no_folder, str(tmp_path / "s1" / "model"),
                 "--out", str(tmp_path / "s4")]) == 1
    assert "--data-format llava needs --image-folder DIR" in capsys.readouterr().err


@pytest.mark.parametrize("quiet", [True, False])
def test_train_quiet_hides_the_progress_bar(parts, quiet, capsys):
    """Issue 27, 9: `--quiet` on `llm train`, as on the core's pretrain and finetune."""
    assert main(train_args(parts, "--tower", str(parts / "encoder"), "--llm", str(parts / "llm"),
                           "--out", str(parts / "s1"), *(["--quiet"] if quiet else []))) == 0
    captured = capsys.readouterr()
    bars = [line for line in captured.err.split("\r") if re.search(r"\d+/\d+ \[", line)]
    assert bool(bars) != quiet, captured.err  # transformers' loading bars too
    assert "trained stage 1 for 3 steps" in captured.out


def test_generate_names_the_prompt_text_of_a_chat_prompt_without_its_placeholder(parts, capsys):
    """Issue 27, 9: with --chat the model is given token ids; the error still names the
    prompt's text and the placeholder, in one line."""
    assert main(train_args(parts, "--tower", str(parts / "encoder"), "--llm",
                           str(parts / "llm"), "--out", str(parts / "s1"), "--quiet")) == 0
    capsys.readouterr()
    assert main(["llm", "generate", str(parts / "s1" / "model"), "--chat", "--image",
                 str(parts / "data" / "0.png"), "--prompt", "what is\nthis"]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("vlm-vit")]
    assert len(lines) == 1, err
    assert lines[0] == ("vlm-vit llm: error: --prompt has 0 '<image>' placeholder(s) but 1 "
                        "--image(s): 'what is\\nthis'")


def test_packed_training_through_the_cli_follows_the_padded_losses(parts, tmp_path, capsys,
                                                                   chat_tokenizer, caplog):
    """`llm train --packing` (issue 30): the same records in the same batches give the same
    losses as the padded run, step by step; bad packing flags are one line."""
    import csv

    from test_conversation_data import GOOD, write_images, write_records

    tiny_llm(vocab_size=512).save_pretrained(tmp_path / "chat_llm")
    chat_tokenizer.save_pretrained(tmp_path / "chat_llm")
    images = write_images(tmp_path / "images")
    data = write_records(tmp_path / "data.json", GOOD, lines=False)
    common = ["llm", "train", "--data-format", "llava", "--data", str(data), "--image-folder",
              str(images), "--steps", "2", "--batch-size", "3", "--num-workers", "0",
              "--device", "cpu", "--tower", str(parts / "encoder"), "--llm",
              str(tmp_path / "chat_llm"), "--template", "vicuna_v1", "--quiet"]
    losses = {}
    caplog.set_level("INFO", logger="vlm_vit_llm.packing")
    for name, extra in {"padded": [], "packed": ["--packing"]}.items():
        assert main([*common, *extra, "--out", str(tmp_path / name)]) == 0, \
            capsys.readouterr().err
        with open(tmp_path / name / "metrics.csv") as handle:
            losses[name] = [float(row["loss"]) for row in csv.DictReader(handle)]
    assert len(losses["packed"]) == 2
    assert any("packed attention on" in r.getMessage() for r in caplog.records)  # it packed
    for packed, padded in zip(losses["packed"], losses["padded"], strict=True):
        assert abs(packed - padded) < 1e-5, losses
    capsys.readouterr()
    assert main([*common, "--packing", "--max-tokens-per-batch", "0", "--out",
                 str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--max-tokens-per-batch must be positive, got 0")


def test_packed_training_prints_the_attention_path_it_chose(parts, capsys):
    """`llm train --packing` says at default verbosity which attention path keeps the
    records apart, and why (issue 47)."""
    assert main(train_args(parts, "--tower", str(parts / "encoder"), "--llm",
                           str(parts / "llm"), "--steps", "1", "--quiet", "--packing",
                           "--out", str(parts / "packed"))) == 0, capsys.readouterr().err
    out = capsys.readouterr().out.splitlines()
    assert ("packing: attention varlen_sdpa (an sdpa LLM with full attention in every layer: "
            "records kept apart by cu_seqlens, one causal SDPA per record)") in out, out
