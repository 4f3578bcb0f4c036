"""Pieces the subcommands share: the public `vlm_vit.commands`, under the name the CLI's
modules (and plugins written before it) import."""

from __future__ import annotations

from vlm_vit.commands import (
    PICKLE_SUFFIXES,
    add_strategy_arguments,
    check_device,
    check_output_apart,
    image_size,
    is_variant,
    not_a_variant_either,
    reading_checkpoint,
    refusing_pickles,
    variant_or_checkpoint,
)

__all__ = [
    "PICKLE_SUFFIXES",
    "add_strategy_arguments",
    "check_device",
    "check_output_apart",
    "image_size",
    "is_variant",
    "not_a_variant_either",
    "reading_checkpoint",
    "refusing_pickles",
    "variant_or_checkpoint",
]
