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


def long_record(turns: int) -> list:
    """A conversation of `turns` short turns with two images at the start."""
    from vlm_vit_llm.records import Turn

    words = ["two blue dogs", "the green tree", "a red square", "one yellow star"]
    record = [Turn("user", "<image>\nWhat is in the picture?"), Turn("assistant", words[0]),
              Turn("user", "And here? <image>"), Turn("assistant", words[1])]
    for number in range(4, turns, 2):
        record += [Turn("user", f"How many dogs are there? {number}"),
                   Turn("assistant", f"There are {number}. {words[number % 4]}")]
    return record[:turns]


@pytest.fixture(params=["vicuna_v1", "chatml"])
def family(request):
    """(tokenizer with the image token, template)."""
    from vlm_vit_llm.chat import chat_template

    if request.param == "vicuna_v1":
        tokenizer = request.getfixturevalue("chat_tokenizer")
    else:
        tokenizer = request.getfixturevalue("chatml_tokenizer")
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    return tokenizer, chat_template(tokenizer, request.param if request.param != "chatml"
                                    else "auto")


def _by_prefix(monkeypatch):
    """The renderer as it was before issue 26: prefix by prefix for every turn."""
    from vlm_vit_llm import chat

    monkeypatch.setattr(chat, "_spans_from_one_render", lambda *args: None)


def test_one_render_gives_the_ids_and_labels_of_prefix_by_prefix(family, monkeypatch):
    from vlm_vit_llm.chat import tokenize_conversation

    tokenizer, template = family
    turns = long_record(60)
    ids, labels = tokenize_conversation(tokenizer, turns, template)
    # 16 tokens: 34 turns, 512 characters of text at most are rendered.
    cut_ids, cut_labels = tokenize_conversation(tokenizer, turns, template, max_length=16)
    _by_prefix(monkeypatch)
    old_ids, old_labels = tokenize_conversation(tokenizer, turns, template)
    assert (ids, labels) == (old_ids, old_labels)
    assert sum(label != -100 for label in labels) > 100  # every answer is learned
    assert len(cut_ids) >= 16 and len(cut_ids) < len(ids)
    assert (cut_ids[:16], cut_labels[:16]) == (old_ids[:16], old_labels[:16])


def test_a_2400_turn_conversation_renders_once_and_its_kept_part_in_well_under_a_second(
        family, monkeypatch):
    import time

    from vlm_vit_llm import chat

    tokenizer, template = family
    turns = long_record(2400)
    rendered = []  # messages per rendering: prefix by prefix, 2.9 million (9 s)
    render = chat._render
    monkeypatch.setattr(chat, "_render", lambda tokenizer, messages, *args, **kwargs: (
        rendered.append(len(messages)) or render(tokenizer, messages, *args, **kwargs)))
    ids, labels = chat.tokenize_conversation(tokenizer, turns, template)
    assert sum(rendered) <= 2 * len(turns) + 4, rendered[:10]
    started = time.perf_counter()
    cut_ids, cut_labels = chat.tokenize_conversation(tokenizer, turns, template, max_length=256)
    assert time.perf_counter() - started < 0.5
    assert (cut_ids[:256], cut_labels[:256]) == (ids[:256], labels[:256])
    assert len(cut_ids) < len(ids) // 4


def test_a_16_mb_turn_is_never_rendered_or_tokenised_whole(family, monkeypatch):
    from vlm_vit_llm import chat
    from vlm_vit_llm.records import Turn

    tokenizer, template = family
    answer = "two blue dogs " * 1_200_000  # 16.8 MB
    turns = [Turn("user", "<image>\nWhat is it?"), Turn("assistant", answer)]
    longest = []
    render = chat._render
    monkeypatch.setattr(chat, "_render", lambda tokenizer, messages, *args, **kwargs: (
        longest.append(max(len(m["content"]) for m in messages) if messages else 0)
        or render(tokenizer, messages, *args, **kwargs)))
    ids, labels = chat.tokenize_conversation(tokenizer, turns, template, max_length=64)
    assert max(longest) <= chat.MAX_CHARS_PER_TOKEN * 64
    assert 64 <= len(ids) <= chat.MAX_CHARS_PER_TOKEN * 64
    # The kept ids are the whole turn's (checked on a turn the old way can still tokenise).
    short = [turns[0], Turn("assistant", "two blue dogs " * 2000)]
    cut = chat.tokenize_conversation(tokenizer, short, template, max_length=64)
    whole = chat.tokenize_conversation(tokenizer, short, template)
    assert [part[:64] for part in cut] == [part[:64] for part in whole]
    assert (ids[:64], labels[:64]) == tuple(part[:64] for part in whole)


def test_the_collate_keeps_the_images_of_the_turns_it_renders(chat_tokenizer):
    from vlm_vit_llm import MultimodalLM
    from vlm_vit_llm.chat import MAX_CHARS_PER_TOKEN
    from vlm_vit_llm.records import Turn
    from vlm_vit_llm.train import ConversationCollate, ConversationItem

    mm = MultimodalLM(tiny_tower(), tiny_llm(vocab_size=512), chat_tokenizer)
    collate = ConversationCollate(mm, template="plain", max_length=40)
    long = "two blue dogs " * (MAX_CHARS_PER_TOKEN * 40 // 14 + 1)  # past the text bound
    turns = [Turn("user", "<image>\nWhat?"), Turn("assistant", long),
             Turn("user", "And <image>?"), Turn("assistant", "the green tree")]
    pixels = [mm.processor.preprocess_one(image) for image in __import__(
        "conftest").photos(2)]
    ids, labels, kept = collate.encode(ConversationItem("r", turns, pixels))
    assert len(kept) == 1 and len(ids) + 15 <= 40 and any(label != -100 for label in labels)
