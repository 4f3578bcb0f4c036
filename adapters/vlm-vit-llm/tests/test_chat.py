"""Chat templates: what is rendered, and which tokens are learned (token by token)."""

import pytest
import torch
from conftest import photos, tiny_llm, tiny_tower

from vlm_vit_llm import IGNORE_INDEX, MultimodalLM
from vlm_vit_llm.chat import chat_prompt, chat_template, render_conversation, tokenize_conversation
from vlm_vit_llm.records import Turn

# A 3-round, 2-image record.
TURNS = [Turn("user", "<image>\nWhat is in the picture?"), Turn("assistant", "two blue dogs"),
         Turn("user", "And here? <image>"), Turn("assistant", "the green tree"),
         Turn("user", "How many dogs are there?"), Turn("assistant", "There are two.")]
ANSWERS = ["two blue dogs", "the green tree", "There are two."]
VICUNA_SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the human's "
                 "questions.")

# What each template must render, written out by hand, and the end-of-turn token learned.
EXPECTED = {
    "vicuna_v1": (
        "<s>" + VICUNA_SYSTEM + " USER: <image>\nWhat is in the picture? ASSISTANT: two blue "
        "dogs</s> USER: And here? <image> ASSISTANT: the green tree</s> USER: How many dogs "
        "are there? ASSISTANT: There are two.</s>", "</s>", " ASSISTANT:"),
    "chatml": (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<image>\nWhat is in the picture?<|im_end|>\n"
        "<|im_start|>assistant\ntwo blue dogs<|im_end|>\n"
        "<|im_start|>user\nAnd here? <image><|im_end|>\n"
        "<|im_start|>assistant\nthe green tree<|im_end|>\n"
        "<|im_start|>user\nHow many dogs are there?<|im_end|>\n"
        "<|im_start|>assistant\nThere are two.<|im_end|>\n", "<|im_end|>",
        "<|im_start|>assistant\n"),
}


@pytest.fixture(params=["vicuna_v1", "chatml"])
def family(request):
    """(tokenizer, template name): the SentencePiece Llama with the vicuna preset, and the
    byte-level BPE tokenizer with its own (Qwen2-style ChatML) template."""
    if request.param == "vicuna_v1":
        tokenizer = request.getfixturevalue("chat_tokenizer")
        return tokenizer, "vicuna_v1"
    return request.getfixturevalue("chatml_tokenizer"), "auto"


def _runs(labels):
    """The contiguous runs of learned positions, as (start, end)."""
    runs, start = [], None
    for position, label in enumerate([*labels, IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = position
        elif label == IGNORE_INDEX and start is not None:
            runs.append((start, position))
            start = None
    return runs


def test_the_label_mask_covers_each_answer_and_its_end_of_turn_token(family):
    tokenizer, name = family
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    key = "vicuna_v1" if name == "vicuna_v1" else "chatml"
    text, end_of_turn, header = EXPECTED[key]
    template = chat_template(tokenizer, name)
    rendered, _ = render_conversation(tokenizer, TURNS, template)
    assert rendered == text

    ids, labels = tokenize_conversation(tokenizer, TURNS, template)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    # Token by token: three runs, each exactly one answer and its end-of-turn token, right
    # after the template's assistant header; every other token is ignored.
    runs = _runs(labels)
    assert len(runs) == 3
    for (start, end), answer in zip(runs, ANSWERS, strict=True):
        assert labels[start:end] == ids[start:end]
        assert tokenizer.decode(ids[start:end]).strip() == answer + end_of_turn
        assert tokenizer.convert_ids_to_tokens(ids[end - 1]) == end_of_turn
        assert tokenizer.decode(ids[:start]).endswith(header.rstrip(" "))
    learned = {position for start, end in runs for position in range(start, end)}
    assert all(labels[p] == IGNORE_INDEX for p in range(len(ids)) if p not in learned)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert ids.count(image_id) == 2
    assert all(labels[p] == IGNORE_INDEX for p, i in enumerate(ids) if i == image_id)


def test_through_the_model_the_images_expand_and_stay_unlearned(chatml_tokenizer):
    mm = MultimodalLM(tiny_tower(), tiny_llm(vocab_size=512), chatml_tokenizer)
    template = chat_template(mm.tokenizer)
    ids, labels = tokenize_conversation(mm.tokenizer, TURNS, template)
    images = photos(2)
    batch = mm.prepare([ids], [images], token_labels=[labels])
    per_image = mm.tower.num_image_tokens()
    assert int(batch.image_mask.sum()) == 2 * per_image
    assert batch.labels.shape[1] == len(ids) + 2 * (per_image - 1)
    assert (batch.labels[batch.image_mask] == IGNORE_INDEX).all()
    learned = [label for label in labels if label != IGNORE_INDEX]
    assert batch.labels[batch.labels != IGNORE_INDEX].tolist() == learned
    # The loss is the LLM's own on those labels.
    with torch.no_grad():
        ours = mm([ids], [images], token_labels=[labels]).loss
        logits = mm.llm(inputs_embeds=mm.embed(batch), attention_mask=batch.attention_mask,
                        position_ids=batch.position_ids).logits
        expected = torch.nn.functional.cross_entropy(
            logits[0, :-1], batch.labels[0, 1:], ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(ours, expected)


def test_the_generation_prompt_is_the_rendering_up_to_the_next_answer(chatml_tokenizer):
    template = chat_template(chatml_tokenizer)
    ids = chat_prompt(chatml_tokenizer, TURNS[:1], template)
    assert chatml_tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<image>\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n")


def test_plain_keeps_the_images_and_the_answer(chat_tokenizer):
    chat_tokenizer.add_tokens(["<image>"], special_tokens=True)
    turns = [Turn("user", "<image>\nRender a clear and concise summary of the photo."),
             Turn("assistant", "two blue dogs")]
    text, spans = render_conversation(chat_tokenizer, turns, chat_template(chat_tokenizer,
                                                                            "plain"))
    assert text == "<s><image>two blue dogs</s>"
    assert [text[a:b] for a, b in spans] == ["two blue dogs</s>"]


def test_without_a_template_the_fallback_is_vicuna_and_unknown_names_are_refused(
        chat_tokenizer):
    assert chat_tokenizer.chat_template is None
    assert chat_template(chat_tokenizer) == chat_template(chat_tokenizer, "vicuna_v1")
    with pytest.raises(ValueError, match="unknown chat template 'llava'"):
        chat_template(chat_tokenizer, "llava")
    with pytest.raises(ValueError, match="needs the tokens"):
        chat_template(chat_tokenizer, "chatml")


def test_a_template_that_rewrites_earlier_turns_is_refused(chatml_tokenizer):
    # Drops every assistant turn but the last (as some reasoning templates drop thoughts).
    rewriting = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                 "{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ValueError, match="growing prefix"):
        render_conversation(chatml_tokenizer, TURNS, rewriting)


@pytest.mark.parametrize("name", ["plain", "vicuna_v1", "chatml", "own"])
def test_structured_template_renders_strings_as_before_and_parts_as_llavas_layout(
        name, chat_tokenizer, chatml_tokenizer):
    """Issue 27, 3: the exported template takes transformers' structured content; a string
    content renders exactly as the template itself renders it."""
    from vlm_vit_llm.chat import structured_chat_template

    tokenizer = chatml_tokenizer if name in ("chatml", "own") else chat_tokenizer
    template = chat_template(tokenizer, "auto" if name == "own" else name)
    structured = structured_chat_template(template, "<image>")
    plain = [{"role": t.role, "content": t.text} for t in TURNS]
    parts = [{"role": "user", "content": [{"type": "image"},
                                          {"type": "text", "text": "What is in the picture?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "two blue dogs"}]},
             {"role": "user", "content": [{"type": "text", "text": "And here?"},
                                          {"type": "image"}]},
             *plain[3:]]
    as_strings = [*plain[:2], {"role": "user", "content": "And here?\n<image>"}, *plain[3:]]

    def render(messages, with_template, prompt=False):
        return tokenizer.apply_chat_template(messages, chat_template=with_template,
                                             tokenize=False, add_generation_prompt=prompt)

    for prompt in (False, True):
        assert render(plain, structured, prompt) == render(plain, template, prompt)
        assert render(parts, structured, prompt) == render(as_strings, template, prompt)
    with pytest.raises(Exception, match="text and image parts, not video"):
        render([{"role": "user", "content": [{"type": "video"}]}], structured)
