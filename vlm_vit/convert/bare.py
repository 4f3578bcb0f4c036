"""The one rule for what a checkpoint's tensors cannot prove (a bare state dict).

A state dict proves its sizes (width, depth, patch size, MLP width, table length), whether
it has a class token, registers and biases: readers take those from the tensors. It does
not prove the number of heads (a fused `qkv` weight `[3 D, D]` is the same for every
split of D), nor settings that are code (an activation, a RoPE base). Such a value is, in
this order:

1. the caller's (`load_encoder(path, heads=...)`, `Checkpoint.given`);
2. the checkpoint's own config (a reader's business, before it calls `resolve`);
3. a family's table of known architectures, only when the proven sizes identify one value:
   every known architecture with those sizes agrees on it;
4. else refused, one line naming the argument to pass and the config that records it.

Nothing is guessed from a width alone (`width // 64` gives 20 heads for ViT-H/14's 16).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def resolve(name: str, proven: dict[str, Any], known: Mapping[tuple, tuple[Any, str]],
            given: Mapping[str, Any], rules: list[str], *, source: object, family: str,
            recorded_by: str, example: str = "") -> Any:
    """The value of `name` that the tensors cannot prove (see the module docstring).

    Args:
        name: the `EncoderConfig` field, also the `load_encoder` argument (`heads`, `act`).
        proven: what the tensors prove, in the order of `known`'s keys, e.g.
            `{"width": 768, "depth": 12, "mlp_width": 3072, "class_token": True}`.
        known: the family's known architectures: `tuple(proven.values())` -> (the value,
            an architecture with it, named in the rule). Shapes that known architectures
            share with different values are left out of it, so they are refused; empty
            where no size identifies the value (an activation).
        given: the caller's `EncoderConfig` overrides (`Checkpoint.given`).
        rules: where the rule applied is recorded.
        source: the checkpoint, named in the refusal.
        family: the checkpoint family, for the refusal ("timm ViT").
        recorded_by: what records the value instead, for the refusal
            ("a timm config.json beside it with model_args.num_heads or its architecture").
        example: how to pass it, for the refusal (default `load_encoder(path, name=...)`).

    Raises:
        ValueError: naming `source`, the proven sizes, `name=` and `recorded_by`, when no
            argument gives the value and the sizes identify no known architecture.
    """
    if name in given:
        rules.append(f"{name}={given[name]!r} as given")
        return given[name]
    shown = ", ".join(f"{field} {value}" for field, value in proven.items())
    entry = known.get(tuple(proven.values()))
    if entry is not None:
        value, architecture = entry
        rules.append(f"{name}={value!r}: the tensors ({shown}) are {architecture}'s")
        return value
    why = f"its tensors ({shown}) are no known architecture's" if known else \
        "no size identifies it"
    raise ValueError(f"{source}: a {family} state dict does not record {name}, and {why}; "
                     f"pass {name}= ({example or f'load_encoder(path, {name}=...)'}) or give "
                     f"{recorded_by}")
