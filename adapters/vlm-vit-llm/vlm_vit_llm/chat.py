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

import logging
from collections.abc import Sequence
from typing import Any

from vlm_vit_llm.model import IGNORE_INDEX
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


def render_conversation(tokenizer: Any, turns: Sequence[Turn], template: str
                        ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans `[start, end)` of the assistant turns.

    Each span runs from where the turn starts to its end-of-turn token; whitespace the
    template writes after it (ChatML's newline) is not learned.

    Raises:
        ValueError: when the template does not render the conversation as a growing prefix
            (one that rewrites earlier turns cannot be learned turn by turn).
    """
    messages = [{"role": turn.role, "content": turn.text} for turn in turns]
    text = _render(tokenizer, messages, template)
    spans = []
    for index, turn in enumerate(turns):
        if turn.role != "assistant":
            continue
        before = _render(tokenizer, messages[:index], template, generation_prompt=True) \
            if index else ""
        through = _render(tokenizer, messages[:index + 1], template)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError("the chat template does not render this conversation as a "
                             f"growing prefix (at turn {index}); give a template that does "
                             f"(one of {list(PRESETS)})")
        end = len(through.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return text, spans


def tokenize_conversation(tokenizer: Any, turns: Sequence[Turn], template: str
                          ) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and labels aligned with them (the id on
    assistant tokens, `IGNORE_INDEX` elsewhere).

    The text is tokenised as a whole (so ids are those the model sees at inference) without
    adding special tokens (the template writes them); a token is learned when it starts
    inside an assistant span.
    """
    text, spans = render_conversation(tokenizer, turns, template)
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
