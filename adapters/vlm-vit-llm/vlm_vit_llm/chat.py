"""Conversations into token ids and labels, through the tokenizer's own chat template.

    template = chat_template(tokenizer)                      # its own, else "vicuna_v1"
    ids, labels = tokenize_conversation(tokenizer, record.turns, template)

Labels cover every assistant turn, from its first character to its end-of-turn token
(`</s>`, `<|im_end|>`, ...), and nothing else: not the system text, the user turns, the image
placeholders or the template's own words around them. The spans come from the template
itself: an assistant turn's text is what rendering the conversation up to it adds to the
rendering up to the turn before with the generation prompt, so any template that renders a
conversation as a growing prefix works (Llama-3, Qwen2/ChatML, Gemma, Mistral, Vicuna ...).

Presets for tokenizers without a template (LLaVA-1.5's conversation styles):

- `plain` (LLaVA stage 1): the user turns' image placeholders only, then the answer and the
  end-of-sequence token; instructions and system text are dropped, as LLaVA's
  `preprocess_plain` does.
- `vicuna_v1` (LLaVA-1.5 stage 2): `SYSTEM USER: ... ASSISTANT: ...</s>USER: ...`.
- `chatml`: `<|im_start|>role\\n...<|im_end|>\\n` (Qwen2's layout, without its default
  system prompt).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from vlm_vit_llm.batch_types import IGNORE_INDEX
from vlm_vit_llm.records import Turn

logger = logging.getLogger(__name__)

VICUNA_SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the human's "
                 "questions.")

PRESETS = {
    "plain": (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'user' %}{{ '<image>' * m['content'].count('<image>') }}"
        "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}"
        "{% endfor %}"),
    "vicuna_v1": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
        "{% else %}" + VICUNA_SYSTEM + "{% endif %}"
        "{% for m in messages %}"
        "{% if m['role'] == 'user' %} USER: {{ m['content'] }}"
        "{% elif m['role'] == 'assistant' %} ASSISTANT: {{ m['content'] }}{{ eos_token }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %} ASSISTANT:{% endif %}"),
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
}
FALLBACK = "vicuna_v1"
AUTO = "auto"
# No token spans more characters than this (a generous bound: natural text averages about
# 4), so text past `MAX_CHARS_PER_TOKEN * max_length` characters cannot reach the first
# `max_length` tokens and is never rendered (`bounded_turns`).
MAX_CHARS_PER_TOKEN = 32
# Private-use characters put around each answer to find it in one rendering.
MARKS = ("\ue000", "\ue001")
# What a template must render when it is adopted (`check_chat_template`).
PROBE = (Turn("user", "<image>\nWhat is in the image?"), Turn("assistant", "A photo."))


def chat_template(tokenizer: Any, name: str = AUTO) -> str:
    """The Jinja chat template to render with.

    Args:
        tokenizer: the LLM's tokenizer.
        name: "auto" (the tokenizer's own template, else the `vicuna_v1` preset, logged), or
            a preset name (see the module docstring).

    Raises:
        ValueError: for an unknown name, or `chatml` with a tokenizer that lacks its tokens.
    """
    if name == AUTO:
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, str) and own:
            return own
        logger.info("the tokenizer has no chat template; using the %r preset", FALLBACK)
        name = FALLBACK
    if name not in PRESETS:
        raise ValueError(f"unknown chat template {name!r}; known: {[AUTO, *PRESETS]}")
    if name == "chatml":
        vocabulary = tokenizer.get_vocab()
        missing = [t for t in ("<|im_start|>", "<|im_end|>") if t not in vocabulary]
        if missing:
            raise ValueError(f"the chatml template needs the tokens {missing}, which the "
                             "tokenizer does not have")
    return PRESETS[name]


def check_chat_template(tokenizer: Any, template: str, source: str = "the tokenizer") -> None:
    """Renders `PROBE` (one image, one answer) and its generation prompt with `template`, so
    a template that cannot render a conversation (Jinja's `raise_exception(...)`, a
    `SecurityError` from the sandbox, an undefined name, a prefix that does not grow) is
    named when it is adopted, not mid-training.

    Args:
        source: whose template it is, for the message (the model's path or name).

    Raises:
        ValueError: `the chat template of SOURCE fails: ...`, in one line.
    """
    try:
        render_conversation(tokenizer, PROBE, template)
        _render(tokenizer, [{"role": "user", "content": PROBE[0].text}], template,
                generation_prompt=True)
    except Exception as error:  # Jinja's TemplateError and anything a template may raise
        message = " ".join(str(error).split())[:200]
        raise ValueError(f"the chat template of {source} fails: {type(error).__name__}"
                         + (f": {message}" if message else "")) from error


def adopt_chat_template(tokenizer: Any, name: str = AUTO, source: str = "the tokenizer") -> str:
    """Resolves `name` (see `chat_template`), checks it on a probe conversation
    (`check_chat_template`) and makes it the tokenizer's own template, so a model saved after
    training generates and exports with the template it learned.

    Raises:
        ValueError: for an unknown name, or a template that fails on the probe (naming
            `source`).
    """
    template = chat_template(tokenizer, name)
    check_chat_template(tokenizer, template, source)
    if getattr(tokenizer, "chat_template", None) != template:
        tokenizer.chat_template = template
        logger.info("the tokenizer's chat template is now the %r preset", name)
    return template


def _render(tokenizer: Any, messages: list[dict[str, str]], template: str,
            generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def bounded_turns(turns: Sequence[Turn], max_length: int | None) -> list[Turn]:
    """The turns that can reach the first `max_length` tokens, cut to `MAX_CHARS_PER_TOKEN *
    max_length` characters of text in all (so one 16 MB turn is never rendered or tokenised
    whole) and to `2 * max_length + 2` turns (every round renders at least one token, so
    later ones lie past the cut). None: all of them, whole.
    """
    if max_length is None:
        return list(turns)
    budget = MAX_CHARS_PER_TOKEN * max_length
    kept: list[Turn] = []
    for turn in turns[:2 * max_length + 2]:
        if budget <= 0:
            break
        kept.append(turn if len(turn.text) <= budget else Turn(turn.role, turn.text[:budget]))
        budget -= len(turn.text)
    return kept


def render_conversation(tokenizer: Any, turns: Sequence[Turn], template: str
                        ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans `[start, end)` of the assistant turns.

    Each span runs from where the turn starts to its end-of-turn token; whitespace the
    template writes after it (ChatML's newline) is not learned. A span is what rendering the
    conversation up to its turn adds to the rendering up to the turn before with the
    generation prompt. The conversation is rendered once (`_spans_from_one_render`); one
    whose rendering does not show that pattern is rendered prefix by prefix
    (`_render_by_prefix`, quadratic in the turns: bound them first with `bounded_turns`).

    Raises:
        ValueError: when the template does not render the conversation as a growing prefix
            (one that rewrites earlier turns cannot be learned turn by turn).
    """
    messages = [{"role": turn.role, "content": turn.text} for turn in turns]
    text = _render(tokenizer, messages, template)
    spans = _spans_from_one_render(tokenizer, messages, text, template)
    if spans is None:
        logger.debug("the chat template's rendering shows no per-turn pattern; rendering "
                     "%d turns prefix by prefix", len(turns))
        return _render_by_prefix(tokenizer, turns, template)
    return text, spans


def _first_span(tokenizer: Any, messages: list[dict[str, str]], index: int, text: str,
                template: str) -> tuple[int, int]:
    """The exact span of the assistant turn `messages[index]` within `text` (the whole
    conversation's rendering), from the renderings up to it.

    Raises:
        ValueError: when they are not prefixes of one another (see `render_conversation`).
    """
    before = _render(tokenizer, messages[:index], template, generation_prompt=True) \
        if index else ""
    through = _render(tokenizer, messages[:index + 1], template)
    if not (through.startswith(before) and text.startswith(through)):
        raise ValueError("the chat template does not render this conversation as a "
                         f"growing prefix (at turn {index}); give a template that does "
                         f"(one of {list(PRESETS)})")
    return len(before), len(through.rstrip())


def _spans_from_one_render(tokenizer: Any, messages: list[dict[str, str]], text: str,
                           template: str) -> list[tuple[int, int]] | None:
    """The assistant spans of `text` from one more rendering, with each answer between
    `MARKS`: where the marks fall is where each answer lies. The first answer's span is
    found exactly (`_first_span`); what the template writes between its span's start and
    the answer, and between the answer and the span's end (` ` and `</s>` in vicuna_v1),
    must then surround every answer, character for character.

    Returns:
        The spans, or None when the rendering does not show that pattern (a template that
        changes, drops or repeats an answer, or writes each turn differently): then only
        rendering prefix by prefix tells the spans.
    """
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not answers or any(mark in m["content"] for m in messages for mark in MARKS):
        return None
    opening, closing = MARKS
    marked = _render(tokenizer, [dict(m, content=opening + m["content"] + closing)
                                 if m["role"] == "assistant" else m for m in messages],
                     template)
    if marked.count(opening) != len(answers) or marked.count(closing) != len(answers) \
            or marked.replace(opening, "").replace(closing, "") != text:
        return None
    bounds, position = [], 0  # each answer's [start, end) in `text`
    for number in range(len(answers)):
        start = marked.find(opening, position)
        end = marked.find(closing, position)
        if not 0 <= start < end:  # marks out of order
            return None
        bounds.append((start - 2 * number, end - 2 * number - 1))
        position = end + 1
    first_start, first_end = _first_span(tokenizer, messages, answers[0], text, template)
    if not first_start <= bounds[0][0] <= bounds[0][1] <= first_end:
        return None
    lead, tail = text[first_start:bounds[0][0]], text[bounds[0][1]:first_end]
    spans, previous = [], 0
    for answer_start, answer_end in bounds:
        start, end = answer_start - len(lead), answer_end + len(tail)
        if start < previous or text[start:answer_start] != lead \
                or text[answer_end:end] != tail:
            return None
        if end > start:
            spans.append((start, end))
        previous = end
    if messages[-1]["role"] == "assistant" and previous != len(text.rstrip()):
        return None  # the last answer's span ends the rendering
    return spans


def _render_by_prefix(tokenizer: Any, turns: Sequence[Turn], template: str
                      ) -> tuple[str, list[tuple[int, int]]]:
    """`render_conversation` the slow way: two renderings of a prefix per assistant turn."""
    messages = [{"role": turn.role, "content": turn.text} for turn in turns]
    text = _render(tokenizer, messages, template)
    spans = []
    for index, turn in enumerate(turns):
        if turn.role != "assistant":
            continue
        start, end = _first_span(tokenizer, messages, index, text, template)
        if end > start:
            spans.append((start, end))
    return text, spans


def tokenize_conversation(tokenizer: Any, turns: Sequence[Turn], template: str,
                          max_length: int | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and labels aligned with them (the id on
    assistant tokens, `IGNORE_INDEX` elsewhere).

    The text is tokenised as a whole (so ids are those the model sees at inference) without
    adding special tokens (the template writes them); a token is learned when it starts
    inside an assistant span.

    Args:
        max_length: with it, only the turns that can reach the first `max_length` tokens
            are rendered and tokenised (`bounded_turns`): the first `max_length` ids and
            labels are those of the whole conversation (unless one word of more than
            `MAX_CHARS_PER_TOKEN * max_length` characters spans the cut), and a record of
            10,000 turns or a 16 MB turn costs what `max_length` tokens of text do.
    """
    text, spans = render_conversation(tokenizer, bounded_turns(turns, max_length), template)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    labels = [IGNORE_INDEX] * len(ids)
    span = 0
    for position, (start, _end) in enumerate(encoded["offset_mapping"]):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span < len(spans) and spans[span][0] <= start < spans[span][1]:
            labels[position] = ids[position]
    return ids, labels


def chat_prompt(tokenizer: Any, turns: Sequence[Turn], template: str) -> list[int]:
    """Token ids of a conversation up to the assistant's next answer (for `generate`)."""
    messages = [{"role": turn.role, "content": turn.text} for turn in turns]
    text = _render(tokenizer, messages, template, generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def structured_chat_template(template: str, image_token: str, drop_bos: bool = False) -> str:
    """`template`, taking transformers' structured content as well as plain strings (for an
    exported processor's `apply_chat_template`).

    A message whose content is a list of parts (`{"type": "image"}`, `{"type": "text",
    "text": ...}`, as transformers' multimodal chat documentation writes them) is rendered as
    the plain string of its parts joined by newlines, each image part its placeholder:
    `[image, text]` becomes `"<image>\\nWhat is this?"`, LLaVA's own layout. A string content
    renders exactly as `template` renders it. Another part type is refused by name.

    Args:
        template: a Jinja chat template that renders string contents.
        image_token: the placeholder an image part becomes.
        drop_bos: drop the beginning-of-sequence token the rendering starts with, for a
            tokenizer that adds its own: the text `processor(text=prompt)` tokenises then
            holds one, not two (transformers' LLaVA templates write none either).
    """
    token = json.dumps(image_token)  # a valid Jinja string literal
    prelude = (
        "{%- set structured = namespace(messages=[]) -%}"
        "{%- for message in messages -%}"
        "{%- if message['content'] is string or message['content'] is none -%}"
        "{%- set structured.messages = structured.messages + [message] -%}"
        "{%- else -%}"
        "{%- set parts = namespace(texts=[]) -%}"
        "{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'image' -%}"
        "{%- set parts.texts = parts.texts + [" + token + "] -%}"
        "{%- elif part['type'] == 'text' -%}"
        "{%- set parts.texts = parts.texts + [part['text']] -%}"
        "{%- else -%}"
        "{{- raise_exception('this model takes text and image parts, not ' ~ part['type']) -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- set structured.messages = structured.messages"
        " + [dict(message, content=parts.texts | join('\\n'))] -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- set messages = structured.messages %}")
    if not drop_bos:
        return prelude + template
    return (prelude + "{% set rendered %}" + template + "{% endset %}"
            "{%- if bos_token and rendered.startswith(bos_token) -%}"
            "{{- rendered[bos_token | length:] -}}"
            "{%- else -%}{{- rendered -}}{%- endif -%}")


def adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer puts its beginning-of-sequence token before a text by itself."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos is not None and list(tokenizer("a")["input_ids"][:1]) == [bos]
