"""Hostile chat input (issue 26, 3 and 4): chat templates that raise, records whose images
alone pass --max-length on the command line, and conversations too long to render whole."""

import pytest
from conftest import tiny_llm, tiny_tower
from test_conversation_data import GOOD, write_images, write_records

from vlm_vit.cli import main
from vlm_vit_llm.chat import adopt_chat_template, check_chat_template

RAISING = {
    "raise_exception": "{{ raise_exception('boom') }}",
    "SecurityError": "{% for m in messages %}{{ m.__class__.__mro__ }}{% endfor %}",
}


@pytest.mark.parametrize("kind", sorted(RAISING))
def test_a_chat_template_that_raises_is_named_when_adopted(tokenizer, kind):
    tokenizer.chat_template = RAISING[kind]
    with pytest.raises(ValueError, match=r"^the chat template of llm/ fails: (TemplateError: "
                       r"boom|SecurityError: access to attribute '__class__')"):
        adopt_chat_template(tokenizer, source="llm/")
    assert tokenizer.chat_template == RAISING[kind]  # not adopted
    with pytest.raises(ValueError, match="the chat template of the tokenizer fails"):
        check_chat_template(tokenizer, RAISING[kind])
    adopt_chat_template(tokenizer, "vicuna_v1")  # a preset renders the probe


@pytest.fixture
def llava_parts(tmp_path, tokenizer):
    """An encoder, an LLM folder, LLaVA records and their images."""
    tiny_tower().encoder.save_pretrained(tmp_path / "encoder")
    tiny_llm().save_pretrained(tmp_path / "llm")
    tokenizer.save_pretrained(tmp_path / "llm")
    images = write_images(tmp_path / "images")
    data = write_records(tmp_path / "data.jsonl", GOOD)
    common = ["llm", "train", "--data-format", "llava", "--data", str(data), "--image-folder",
              str(images), "--tower", str(tmp_path / "encoder"), "--llm", str(tmp_path / "llm"),
              "--steps", "1", "--batch-size", "2", "--num-workers", "0", "--device", "cpu"]
    return tmp_path, common


def test_train_with_a_raising_chat_template_fails_in_one_line(llava_parts, tokenizer, capsys):
    tmp_path, common = llava_parts
    tokenizer.chat_template = RAISING["raise_exception"]
    tokenizer.save_pretrained(tmp_path / "llm")
    assert main([*common, "--out", str(tmp_path / "run")]) == 1
    # transformers draws its own progress bar while the LLM loads; the rest is one line.
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith("Loading weights")]
    assert len(err) == 1, err
    assert err[0] == (f"vlm-vit llm: error: the chat template of {tmp_path / 'llm'} fails: "
                      "TemplateError: boom")
    assert not (tmp_path / "run" / "model").exists()


def test_max_length_drops_records_whose_images_alone_are_longer(llava_parts, capsys):
    # 16 tokens an image: record "two" (2 images, 32 tokens) cannot fit in 30.
    tmp_path, common = llava_parts
    assert main([*common, "--template", "plain", "--max-length", "30",
                 "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 record(s) of" in err and "--max-length 30" in err
    assert "(id two): its 2 image(s) take 32 tokens, more than max_length 30" in err
    assert main([*common, "--template", "plain", "--max-length", "30", "--strict",
                 "--out", str(tmp_path / "strict")]) == 1
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith("Loading weights")]
    assert len(err) == 1 and "(id two): its 2 image(s) take 32 tokens" in err[0]
