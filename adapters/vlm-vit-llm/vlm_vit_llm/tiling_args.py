"""Command-line AnyRes for `vlm-vit llm train` (`--anyres`), apart from the CLI so it can be
tested and reused:

    add_anyres_argument(group)
    anyres = anyres_from_args(args)      # an AnyRes or None: bad values fail before loading
    tower = tiled_tower(tower, anyres, saved_tiling(directory), source="--tower ...")

A preset counts its canvases in tiles, so it fits any tower: a tile is the tower's input
side (336 for CLIP ViT-L/14-336, where `llava-next` is LLaVA-NeXT's 336x672, 672x336, ...).
Explicit canvases are in pixels. A tower that tiles already keeps its tiling, and refuses
`--anyres`: its tiling is what it was saved (and maybe trained) with.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

FLAG = "--anyres"
# LLaVA-NeXT's image_grid_pinpoints (transformers' LlavaNextConfig default: 336x672, 672x336,
# 672x672, 1008x336, 336x1008) as (rows, columns) of its 336-pixel tiles.
PRESETS = {"llava-next": ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))}
# OneVision's image_grid_pinpoints (transformers' LlavaOnevisionImageProcessor default):
# every grid of 1..6 rows by 1..6 columns of its 384-pixel tiles, rows first.
ONEVISION_SIDE = 6
ONEVISION_PREFIX = "anyres_max_"  # OneVision's vision_aspect_ratio, anyres_max_N
CANVAS = re.compile(r"([0-9]{1,6})x([0-9]{1,6})")  # HEIGHTxWIDTH in pixels
SHOWN = 60  # characters of a bad value an error quotes


@dataclasses.dataclass(frozen=True)
class AnyRes:
    """What `--anyres` asks for, before the tower's tile size is known.

    Attributes:
        text: the flag's value, as given (named in errors).
        canvases: (height, width) of each canvas, in tiles when `in_tiles`, else in pixels.
        in_tiles: a preset's canvases, counted in tiles.
        max_feature_tiles: OneVision's N of `anyres_max_N`, or None (LLaVA-NeXT).
    """

    text: str
    canvases: tuple[tuple[int, int], ...]
    in_tiles: bool = False
    max_feature_tiles: int | None = None

    def tiling(self, tile_size: int):
        """The `vlm_vit.processor.Tiling` for tiles of `tile_size` pixels.

        Raises:
            ValueError: naming the flag, for a canvas that is not a multiple of the tile or
                needs too many tiles.
        """
        from vlm_vit.processor import Tiling

        pinpoints = [(rows * tile_size, columns * tile_size) if self.in_tiles else (rows, columns)
                     for rows, columns in self.canvases]
        try:
            return Tiling(pinpoints=pinpoints, tile_size=tile_size,
                          max_feature_tiles=self.max_feature_tiles)
        except ValueError as error:
            raise ValueError(f"{FLAG} {_shown(self.text)}: {error}") from None


def add_anyres_argument(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """Adds `--anyres` to `group` (`llm train`'s model options)."""
    group.add_argument(
        FLAG, default=None, metavar="PRESET_OR_PINPOINTS",
        help="AnyRes tiling for a new model from --tower (LLaVA-NeXT / OneVision): "
        "llava-next (LLaVA-NeXT's canvases of 1x2, 2x1, 2x2, 3x1 and 1x3 tiles), anyres_max_N "
        "(OneVision's canvases of 1..6 by 1..6 tiles, and a grid of more than about N tiles' "
        "tokens shrunk to N; OneVision's is anyres_max_9), or canvases in pixels, "
        "HEIGHTxWIDTH,... (336x672,672x336,672x672); a tile is the tower's input size. A "
        "saved tiled tower given to --tower keeps its tiling (its projector and "
        "image_newline start new), and refuses --anyres; a saved MODEL keeps its own tiling, "
        "or none")


def parse_anyres(text: str) -> AnyRes:
    """`--anyres`'s value: a preset name, `anyres_max_N`, or comma-separated HEIGHTxWIDTH
    canvases in pixels.

    Raises:
        ValueError: one line naming the flag and the value, for anything else.
    """
    from vlm_vit.processor.anyres import MAX_PINPOINTS, MAX_TILES

    value = text.strip()
    if value in PRESETS:
        return AnyRes(text, PRESETS[value], in_tiles=True)
    if value.startswith(ONEVISION_PREFIX):
        digits = value.removeprefix(ONEVISION_PREFIX)
        if not (re.fullmatch(r"[0-9]{1,3}", digits) and 1 <= int(digits) <= MAX_TILES):
            raise ValueError(f"{FLAG} {_shown(text)}: OneVision's anyres_max_N needs N in "
                             f"1..{MAX_TILES} (OneVision's own is anyres_max_9)")
        grids = tuple((rows, columns) for rows in range(1, ONEVISION_SIDE + 1)
                      for columns in range(1, ONEVISION_SIDE + 1))
        return AnyRes(text, grids, in_tiles=True, max_feature_tiles=int(digits))
    parts = value.split(",")
    if not re.match(r"[0-9]", value) or len(parts) > MAX_PINPOINTS:  # neither form
        raise ValueError(f"{FLAG} {_shown(text)} is not a preset ({', '.join(PRESETS)}, "
                         f"anyres_max_N) nor at most {MAX_PINPOINTS} canvases HEIGHTxWIDTH in "
                         "pixels, comma-separated (336x672,672x336,672x672)")
    canvases = []
    for part in parts:
        match = CANVAS.fullmatch(part.strip())
        canvas = (int(match[1]), int(match[2])) if match else (0, 0)
        if 0 in canvas:
            raise ValueError(f"{FLAG} {_shown(text)}: canvas {_shown(part)} is not "
                             "HEIGHTxWIDTH in positive pixels (336x672)")
        canvases.append(canvas)
    return AnyRes(text, tuple(canvases))


def anyres_from_args(args: argparse.Namespace) -> AnyRes | None:
    """The `AnyRes` `--anyres` asks for (None without it), checked before anything loads.

    Raises:
        ValueError: naming the flag, for a bad value, or with MODEL (a saved model keeps
            its tower's tiling).
    """
    text = getattr(args, "anyres", None)
    if text is None:
        return None
    if getattr(args, "model", None) is not None:
        raise ValueError(f"{FLAG} is for a new model from --tower and --llm; MODEL "
                         f"{args.model} keeps its tower's tiling (or none)")
    return parse_anyres(text)


def saved_tiling(directory: Path):
    """The tiling a saved tower's `config.json` records (`tower.tiling`), or None: a tower
    saved without a processor keeps it there alone.

    Raises:
        ValueError: naming the file, for a malformed tiling.
    """
    from vlm_vit.io.files import read_json
    from vlm_vit.io.native import CONFIG_NAME
    from vlm_vit.processor.anyres import as_tiling

    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        return None
    tower = read_json(path).get("tower")
    if not isinstance(tower, dict):
        return None
    try:
        return as_tiling(tower.get("tiling"))
    except ValueError as error:
        raise ValueError(f"{path}: tower.{error}") from None


def tiled_tower(tower: Any, anyres: AnyRes | None, saved: Any, source: str) -> Any:
    """`tower` with the tiling it should have: its own (from its processor, or `saved`, the
    one its folder records), else `anyres`'s, else none. Tiling added here comes with a new
    random `image_newline`, as the projector it belongs to is new.

    Args:
        tower: the `VisionTower` as loaded, with a new projector.
        anyres: what `--anyres` asks for, or None.
        saved: the tiling the tower's folder records (`saved_tiling`), or None.
        source: how errors name the tower (`--tower PATH`).

    Raises:
        ValueError: naming `--anyres` for a tower that tiles already, or a tiling the tower
            or its processor cannot take (a non-square input, a pooler without a square grid
            per tile).
    """
    from vlm_vit import VisionTower

    own = tower.tiling or saved
    if own is not None and anyres is not None:
        raise ValueError(f"{FLAG} {_shown(anyres.text)}: {source} tiles already "
                         f"({describe(own)}) and keeps its tiling; drop {FLAG}, or give an "
                         "untiled tower")
    if tower.tiling is not None or (own is None and anyres is None):
        return tower
    if own is not None:
        tiling, failed = own, f"{source}: its saved tiling ({describe(own)}) does not fit"
    else:
        flag = f"{FLAG} {_shown(anyres.text)}"
        tiling, failed = anyres.tiling(_tile_size(tower, flag)), f"{flag}: cannot tile {source}"
    processor = tower.processor
    try:
        if processor is not None:
            processor = dataclasses.replace(processor, tiling=tiling)
        return VisionTower(tower.encoder, tower.pooler, feature_layer=tower.feature_layer,
                           keep_prefix=tower.keep_prefix, processor=processor, tiling=tiling)
    except ValueError as error:
        raise ValueError(f"{failed}: {error}") from None


def describe(tiling: Any) -> str:
    """A tiling in a few words: its canvases, tile and OneVision's N."""
    canvases = ",".join(f"{height}x{width}" for height, width in tiling.pinpoints)
    most = tiling.max_feature_tiles
    return f"canvases {_shown(canvases)} of {tiling.tile_size}-pixel tiles" + \
        (f", anyres_max_{most}" if most is not None else "")


def _tile_size(tower: Any, flag: str) -> int:
    """The tower's input side: its processor's size, else its encoder's image size."""
    processor = tower.processor
    size = tuple(processor.size) if processor is not None else \
        tuple(tower.encoder.config.image_size)
    if size[0] != size[1]:
        raise ValueError(f"{flag}: tiles are square, and the tower takes {size[0]}x{size[1]} "
                         "images")
    return int(size[0])


def _shown(text: str) -> str:
    """`text`, cut short for an error line."""
    return text if len(text) <= SHOWN else text[:SHOWN] + "..."
