"""Where the `llm` commands find what their arguments name: files that must exist, and
models given as a path or a Hub name (moved unchanged from `cli`)."""

from __future__ import annotations

from pathlib import Path


def existing(path: Path, what: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    return path


def flagged(error: FileNotFoundError, what: str) -> FileNotFoundError:
    """`error` again, its message led by the flag `what` (a `NotCachedError` keeps its
    problem and its advice apart)."""
    from vlm_vit.io import hub

    if isinstance(error, hub.NotCachedError):
        return hub.NotCachedError(f"{what}: {error.problem}", error.fetch)
    return type(error)(f"{what}: {error}")


def model_path(value: str | Path, what: str) -> Path:
    """A local path, or a model name (`org/name[@revision]`, `hf-hub:org/name`) from the
    Hugging Face cache, fetched if allowed (`vlm_vit.io.hub`): a multimodal model, an LLM and
    its tokenizer, or a tower."""
    from vlm_vit.io import hub

    if Path(value).exists():
        return Path(value)
    try:
        return hub.locate(str(value), patterns=hub.LLM_PATTERNS).directory
    except FileNotFoundError as error:  # NotCachedError too: one line, naming the flag
        raise flagged(error, what) from error


def load_multimodal(value: str | Path, what: str, *, trainable: bool = False):
    """A saved `MultimodalLM` from a path or name; a weight file that would need code to load
    (a pickled `pytorch_model.bin` or adapter) is refused in one line naming it."""
    from vlm_vit.commands import refusing_pickles
    from vlm_vit_llm.model import MultimodalLM

    directory = model_path(value, what)
    with refusing_pickles(directory, what):
        return MultimodalLM.from_pretrained(directory, trainable=trainable)
