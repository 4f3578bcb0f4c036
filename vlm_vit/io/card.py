"""Model cards: the `README.md` with YAML metadata that the Hugging Face Hub shows and
indexes, written beside a saved encoder, tower or multimodal model unless one exists."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlm_vit.config import EncoderConfig, available_variants
from vlm_vit.io.files import atomic_write

CARD_NAME = "README.md"
PLACEHOLDER = "ORG/NAME"  # in the usage line; `push_to_hub` puts the repository there


def variant_name(config: EncoderConfig) -> str | None:
    """The named variant whose architecture `config` is (at any image size), or None."""
    for name in available_variants():
        try:
            if EncoderConfig.from_name(name, image_size=config.image_size) == config:
                return name
        except ValueError:  # a size this variant's patches do not divide
            continue
    return None


def _yaml(metadata: dict[str, Any]) -> str:
    """A flat YAML mapping (strings, numbers, lists of strings), each scalar JSON-quoted
    (JSON strings are valid YAML), so no value can break the header."""
    lines = []
    for key, value in metadata.items():
        if isinstance(value, list):
            lines.append(f"{key}:")
            lines.extend(f"- {json.dumps(str(item))}" for item in value)
        else:
            lines.append(f"{key}: {json.dumps(value)}")
    return "\n".join(lines)


def model_card(metadata: dict[str, Any], title: str, facts: dict[str, Any],
               usage: str) -> str:
    """A card: YAML metadata, a title, a table of facts and a usage snippet."""
    rows = "\n".join(f"| {name} | {value} |" for name, value in facts.items())
    return (f"---\n{_yaml(metadata)}\n---\n\n# {title}\n\n| | |\n|---|---|\n{rows}\n\n"
            f"## Use\n\n```python\n{usage}\n```\n")


def write_card(directory: str | Path, text: str) -> Path | None:
    """Writes `README.md` atomically unless the directory already has one (a user's card is
    never replaced); returns the path written, or None."""
    path = Path(directory) / CARD_NAME
    if path.exists():
        return None
    with atomic_write(path, "w") as handle:
        handle.write(text)
    return path


def write_model_card(directory: str | Path, config: EncoderConfig,
                     extra_config: dict[str, Any] | None = None,
                     base_model: str | None = None) -> Path | None:
    """The card of a saved encoder, or of a tower when `extra_config` has a `tower` section.

    Args:
        directory: the saved model.
        config: the encoder's architecture.
        extra_config: the rest of `config.json` (a tower's selection and pooler).
        base_model: the Hub name it came from, when known (`base_model` in the metadata).
    """
    tower = (extra_config or {}).get("tower")
    height, width = config.image_size
    facts = {"variant": variant_name(config) or "custom", "image size": f"{height} x {width}",
             "patch size": config.patch_size, "width": config.width, "depth": config.depth,
             "heads": config.heads}
    tags = ["vision-transformer", "image-feature-extraction", "vlm-vit"]
    if tower:
        pooler = tower.get("pooler", {})
        facts.update({"pooler": pooler.get("name"), "pooler output": pooler.get("out_dim"),
                      "feature layer": tower.get("feature_layer"),
                      "prefix tokens kept": tower.get("keep_prefix")})
        tags.append("vision-tower")
        usage = ("import vlm_vit\n\ntower = vlm_vit.load_tower(\"" + PLACEHOLDER + "\")\n"
                 "tokens = tower(pixel_values)  # the pooler's output")
    else:
        usage = ("import vlm_vit\n\nencoder = vlm_vit.load_encoder(\"" + PLACEHOLDER + "\")\n"
                 "out = encoder(pixel_values)  # out.patch_tokens, out.hidden_states")
    metadata: dict[str, Any] = {"library_name": "vlm-vit", "pipeline_tag":
                                "image-feature-extraction", "tags": tags}
    if base_model:
        metadata["base_model"] = base_model
    kind = "vision tower" if tower else "ViT encoder"
    return write_card(directory, model_card(metadata, f"{facts['variant']} {kind} (vlm-vit)",
                                            facts, usage))
