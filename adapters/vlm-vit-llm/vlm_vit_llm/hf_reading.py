"""What the readers of transformers' multimodal folders share (LLaVA-1.5 in
`vlm_vit_llm.llava_reader`, LLaVA-NeXT and OneVision in `vlm_vit_llm.llava_next`): bounded
echoes of a config's values, the causal LM with its head tied as transformers ties it, and the
processor's settings as transformers saved them."""

from __future__ import annotations

import copy
import reprlib
from pathlib import Path
from typing import Any

from vlm_vit.io.files import read_json

MAX_ECHO = 120  # characters of a config's value an error message repeats


def bounded(value: Any) -> str:
    """`value` (an error's message as a string, anything else as its repr) cut to a few
    hundred characters: a hostile config's values are echoed, never whole."""
    text = str(value) if isinstance(value, BaseException) else reprlib.repr(value)
    text = " ".join(text.split())  # one line
    return text if len(text) <= MAX_ECHO else text[:MAX_ECHO - 3] + "..."


def causal_lm(model: Any, config: Any, missing_keys: Any, source: str):
    """The causal LM of `config.text_config` on the model's language model and head
    (shared), its head tied to the embeddings exactly when transformers tied `model`'s.

    transformers 5 ties by the top-level `tie_word_embeddings` (`_tied_weights_keys`); the
    LLaVA and OneVision configs take the text config's when the top level's is off, the
    LLaVA-NeXT config does not (`LlavaNextConfig` keeps its own default, off); and a
    checkpoint holding both matrices with different values is left untied. Reading the tie
    off the loaded model follows all three rules; the text config's own flag would tie a
    LLaVA-NeXT folder's trained separate head to the embeddings.

    Raises:
        ValueError: when the head is not tied but the weights hold none (transformers would
            start it at random).
    """
    import transformers

    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if not tied and "lm_head.weight" in set(missing_keys):
        raise ValueError(f"{source}: tie_word_embeddings is off (top level "
                         f"{config.tie_word_embeddings}, text_config "
                         f"{getattr(config.text_config, 'tie_word_embeddings', None)}) but the "
                         "weights hold no lm_head.weight: the output head would be random")
    text_config = copy.deepcopy(config.text_config)
    text_config.tie_word_embeddings = tied
    # Not on the meta device: the rotary tables are buffers no state dict carries.
    llm = transformers.AutoModelForCausalLM.from_config(text_config, dtype=model.dtype)
    state = {f"{llm.base_model_prefix}.{name}": tensor
             for name, tensor in model.model.language_model.state_dict().items()}
    state.update({f"lm_head.{name}": tensor for name, tensor in model.lm_head.state_dict().items()})
    llm.load_state_dict(state, strict=True, assign=True)
    llm.tie_weights()
    return llm.eval()


def processor_field(directory: Path, name: str) -> Any:
    path = directory / "processor_config.json"
    return read_json(path).get(name) if path.is_file() else None


def image_processor_settings(directory: Path) -> tuple[dict[str, Any], Path]:
    """The image processor's settings as transformers reads them, and their file:
    `processor_config.json`'s nested `image_processor` (where transformers 5 saves them),
    else `preprocessor_config.json` (where earlier versions did).

    Raises:
        ValueError: naming the folder when it holds neither.
    """
    nested = directory / "processor_config.json"
    if nested.is_file():
        settings = read_json(nested).get("image_processor")
        if isinstance(settings, dict):
            return settings, nested
    alone = directory / "preprocessor_config.json"
    if alone.is_file():
        return read_json(alone), alone
    raise ValueError(f"{directory}: no image processor (neither processor_config.json with "
                     "'image_processor' nor preprocessor_config.json): the pixels the model "
                     "was trained on are unknown")


def video_processor_settings(directory: Path) -> tuple[dict[str, Any], Path] | None:
    """The video processor's settings as transformers reads them, and their file:
    `processor_config.json`'s nested `video_processor`, else `video_preprocessor_config.json`,
    else the image processor's `preprocessor_config.json` (transformers' fallback); None when
    the folder holds none of them."""
    nested = directory / "processor_config.json"
    if nested.is_file():
        settings = read_json(nested).get("video_processor")
        if isinstance(settings, dict):
            return settings, nested
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (directory / name).is_file():
            return read_json(directory / name), directory / name
    return None


def tensor_shapes(directory: Path) -> dict[str, list[int]]:
    """Every tensor's name and shape in the folder's safetensors, from their headers (no
    tensor is read): `model.safetensors`, or the shards `model.safetensors.index.json` names
    (each inside `directory`)."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: weight_map is not a mapping of names to files")
        files = sorted({str(name) for name in weight_map.values()})
    else:
        files = ["model.safetensors"]
    shapes = {}
    for name in files:
        # Named inside the folder (the Hub cache's files are links to its blobs: not resolved)
        relative = Path(name)
        path = directory / relative
        if relative.is_absolute() or ".." in relative.parts or not path.is_file():
            raise ValueError(f"{directory}: weights file {bounded(name)} is not a file inside "
                             "the folder")
        with safe_open(path, framework="pt") as handle:
            names = handle.keys()  # a list; the handle itself is not iterable
            shapes.update({key: list(handle.get_slice(key).get_shape()) for key in names})
    return shapes


def checked_image_token(tokenizer: Any, directory: Path, index: int, source: str,
                        default: str = "<image>") -> str:
    """The folder's image placeholder (the tokenizer's `image_token`, else the processor's,
    else `default`), checked to be the token `image_token_index` names.

    Raises:
        ValueError: naming `source`, when the tokenizer gives the placeholder another id.
    """
    image_token = getattr(tokenizer, "image_token", None) or processor_field(
        directory, "image_token") or default
    found = tokenizer.convert_tokens_to_ids(image_token)
    if found != index:
        raise ValueError(f"{source}: image_token_index {index}, but the tokenizer gives "
                         f"{bounded(image_token)} the id {found}")
    return image_token


def projector_state(projector: Any) -> dict[str, Any]:
    """transformers' LLaVA projector (`linear_1`, act, `linear_2`) as `mlp2x_gelu`'s keys."""
    return {f"{ours}.{kind}": getattr(getattr(projector, theirs), kind)
            for ours, theirs in (("0", "linear_1"), ("2", "linear_2"))
            for kind in ("weight", "bias")}


def check_causal_lm(text_config: Any, source: str) -> None:
    """Refuses, before any weight is read, a text config transformers has no causal LM for
    (the bridge runs the language model as `AutoModelForCausalLM`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(text_config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{source}: text_config model_type {bounded(model_type)} has no "
                         "causal LM in transformers (AutoModelForCausalLM), which the bridge "
                         "runs")
