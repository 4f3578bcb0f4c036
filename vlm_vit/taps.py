"""Several named layers of one encoder run, each through its own pooler: the taps a 2026
multimodal model reads besides its tower's main output (Qwen3-VL's DeepStack mergers on
three intermediate layers, InternVL's layer -4, PE spatial's intermediate layer).

    tapped = TappedTower(tower, {"deepstack_0": (8, merger_0), "deepstack_1": (16, merger_1)})
    out = tapped(pixels)                  # out.tokens: tower(pixels); out.taps["deepstack_0"]
    tapped.num_tap_tokens("deepstack_0", (224, 224))

The encoder runs once, as deep as the deepest layer anyone reads. A tap reads the raw block
output at its hidden-state index (0: the embeddings, k: after block k, negative from the
end; as `VisionTower(feature_layer=...)`), with the tower's prefix handling (`keep_prefix`),
and its pooler sees what a `VisionTower(encoder, pooler, feature_layer=layer)` would hand it:
each tap's output equals that tower's, and its token count is exactly
`num_tap_tokens(name, size)`. Batches, packed lists of any sizes and clips go through as
`VisionTower.forward` takes them; tiled towers are not tapped.

`save_pretrained` writes the tower, then `taps.json` (each tap's layer and pooler spec) and
`taps.safetensors`; `from_pretrained` reads both back strictly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import vlm_vit.io.hub as hub
from vlm_vit.config import is_int
from vlm_vit.io.files import atomic_directory, read_json, write_safetensors
from vlm_vit.io.integrity import verify_files, write_manifest
from vlm_vit.io.native import check_state_dict
from vlm_vit.io.tensor_files import read_safetensors
from vlm_vit.poolers import build_pooler, pool_packed
from vlm_vit.tower import VisionTower, join_clips, no_graph_if_frozen

TAPS_CONFIG_NAME = "taps.json"
TAPS_WEIGHTS_NAME = "taps.safetensors"
MAX_TAPS = 64
TAP_KEYS = ("layer", "pooler")


@dataclass
class TappedOutput:
    """What `TappedTower` returns.

    Attributes:
        tokens: the tower's own output, as `VisionTower.forward` gives it.
        taps: per tap name, its pooler's output in the same form (`[B, M, D]` for a batch,
            a list of `[M_i, D]` for a list of images).
    """

    tokens: torch.Tensor | list[torch.Tensor]
    taps: dict[str, torch.Tensor | list[torch.Tensor]] = field(default_factory=dict)


class TappedTower(nn.Module):
    """A `VisionTower` and named taps `{name: (layer, pooler)}` on its encoder (see the module).

    Raises:
        ValueError: for no taps or more than `MAX_TAPS`, a name that is not a non-empty
            identifier, a layer out of the encoder's range, a pooler whose `in_dim` is not
            the encoder's width or that reads a prefix the tower drops, or a tiled tower.
    """

    def __init__(self, tower: VisionTower, taps: Mapping[str, tuple[int, nn.Module]]):
        super().__init__()
        if tower.tiling is not None:
            raise ValueError("a tiled tower (AnyRes) cannot be tapped: its views are stitched "
                             "after the pooler")
        if not isinstance(taps, Mapping) or not 0 < len(taps) <= MAX_TAPS:
            raise ValueError(f"taps must map 1 to {MAX_TAPS} names to (layer, pooler), got "
                             f"{len(taps) if isinstance(taps, Mapping) else type(taps).__name__}")
        self.tower = tower
        self.layers: dict[str, int] = {}
        poolers = {}
        for name, value in taps.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"tap name {name!r} is not an identifier (letters, digits, _)")
            if not isinstance(value, tuple) or len(value) != 2 or not is_int(value[0]):
                raise ValueError(f"tap {name!r}: give (layer, pooler), got {value!r}")
            layer, pooler = value
            tower.encoder.layer_index(layer)  # a bad index fails here
            width = getattr(pooler, "in_dim", None)
            if width is not None and width != tower.encoder.config.width:
                raise ValueError(f"tap {name!r}: its pooler takes width {width}, the encoder "
                                 f"gives {tower.encoder.config.width}")
            if getattr(pooler, "requires_class_token", False) and not tower.keep_prefix:
                raise ValueError(f"tap {name!r}: its pooler reads the class token, which the "
                                 "tower drops (keep_prefix=False)")
            self.layers[name] = layer
            poolers[name] = pooler
        self.taps = nn.ModuleDict(poolers)

    def num_tap_tokens(self, name: str, image_size: int | tuple[int, int] | None = None, *,
                       frames: int = 1) -> int | None:
        """Exactly how many tokens tap `name` gives per image of this size (None: a vector),
        as `VisionTower.num_image_tokens` counts the main output."""
        if name not in self.taps:
            raise KeyError(f"no tap {name!r}; taps: {sorted(self.taps)}")
        tower = self.tower
        tower.num_image_tokens(image_size, frames=frames)  # checks the size and the frames
        height, width = tower.encoder.config.image_size if image_size is None else \
            (image_size, image_size) if is_int(image_size) else image_size
        count = self.taps[name].num_output_tokens(tower.encoder.patch_embed.grid(height, width),
                                                  num_prefix_tokens=tower.num_prefix_tokens)
        if count is None or frames == 1:
            return count
        return -(-frames // tower.encoder.config.temporal_patch_size) * count

    def forward(self, pixel_values: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]
                ) -> TappedOutput:
        """Pixels as `VisionTower.forward` takes them (a batch, or a list of images and
        clips) to the tower's output and every tap's, from one encoder run."""
        tower, encoder = self.tower, self.tower.encoder
        main = tower._layers
        asked = self.run_layers(main)
        with no_graph_if_frozen(encoder):
            out = encoder(list(pixel_values) if isinstance(pixel_values, (list, tuple))
                          else pixel_values, feature_layers=asked)
        features = list(out.features)
        selected = {None: out.tokens if main is None else
                    torch.cat(features[:len(main)], dim=-1)}
        offset = len(main or [None])
        for index, name in enumerate(self.layers):
            selected[name] = features[offset + index]
        poolers = {None: tower.pooler, **self.taps}
        prefix = tower.num_prefix_tokens
        if isinstance(pixel_values, (list, tuple)):
            keep = None if tower.keep_prefix or not out.num_prefix_tokens else out.patch_mask()
            lengths = out.lengths if keep is None else \
                tuple(length - out.num_prefix_tokens for length in out.lengths)
            frames = out.frames or (1,) * len(lengths)
            pooled = {name: join_clips(pool_packed(
                poolers[name], tokens if keep is None else tokens[keep], lengths=lengths,
                grids=out.grids, num_prefix_tokens=prefix), frames)
                for name, tokens in selected.items()}
        else:
            pooled = {name: self.pool_batch(name, tokens, out)
                      for name, tokens in selected.items()}
        main_tokens = pooled.pop(None)
        return TappedOutput(main_tokens, pooled)

    def run_layers(self, main: list[int] | None) -> list[int]:
        """The hidden-state indices one encoder run is asked for: `main` (None: the final
        tokens, so the run goes to the last block), then every tap's layer, in tap order."""
        return [*(main or [self.tower.encoder.config.depth]), *self.layers.values()]

    def pool_batch(self, name: str | None, tokens: torch.Tensor, out: Any) -> torch.Tensor:
        """Tap `name`'s pooler (None: the tower's) on `tokens`, the raw block output
        `[B, T, D]` of the batch run `out` (an `EncoderOutput`), with the tower's prefix
        handling: what `forward` gives for that tap."""
        tower = self.tower
        start = 0 if tower.keep_prefix else out.num_prefix_tokens
        pooler = tower.pooler if name is None else self.taps[name]
        return pooler(tokens[:, start:], num_prefix_tokens=tower.num_prefix_tokens,
                      grid=out.grid)

    # -- saving ------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path, **options: Any) -> Path:
        """The tower (`VisionTower.save_pretrained`, with `options`), then the taps:
        `taps.json` and `taps.safetensors`, in the tower's manifest.

        Raises:
            ValueError: for a tap pooler not built by `build_pooler`.
        """
        specs = {}
        for name, pooler in self.taps.items():
            spec = getattr(pooler, "pooler_spec", None)
            if spec is None:
                raise ValueError(f"cannot save tap {name!r}: its {type(pooler).__name__} was "
                                 "not built by vlm_vit.build_pooler")
            specs[name] = {"layer": self.layers[name], "pooler": spec}
        with atomic_directory(directory) as temp:  # the tower and its taps appear at once
            self.tower.save_pretrained(temp, **options)
            (temp / TAPS_CONFIG_NAME).write_text(json.dumps(specs, indent=2) + "\n")
            write_safetensors({f"{name}.{key}": value for name, pooler in self.taps.items()
                               for key, value in pooler.state_dict().items()},
                              temp / TAPS_WEIGHTS_NAME)
            write_manifest(temp, [TAPS_CONFIG_NAME, TAPS_WEIGHTS_NAME], merge=True)
        return Path(directory)

    @classmethod
    def from_pretrained(cls, name: str | Path, **options: Any) -> TappedTower:
        """Reads what `save_pretrained` wrote, from a folder or a Hub name (`options` go to
        `VisionTower.from_pretrained`).

        Raises:
            FileNotFoundError, ValueError: naming the file and the field, for a missing or
                malformed `taps.json`, or weights that do not fit the taps' poolers.
        """
        directory = hub.resolve(name)
        path = directory / TAPS_CONFIG_NAME
        verify_files(directory, [path, directory / TAPS_WEIGHTS_NAME], options.get("verify"))
        raw = read_json(path)
        if not isinstance(raw, dict) or not 0 < len(raw) <= MAX_TAPS:
            raise ValueError(f"{path}: must map 1 to {MAX_TAPS} tap names to their layer and "
                             "pooler")
        poolers, layers = {}, {}
        for name, spec in raw.items():
            if not isinstance(spec, dict) or set(spec) != set(TAP_KEYS) or \
                    not is_int(spec["layer"]) or not isinstance(spec["pooler"], dict):
                raise ValueError(f"{path}: tap {name!r} must be {{\"layer\": int, \"pooler\": "
                                 f"{{...}}}}, got {spec!r}"[:300])
            pooler = spec["pooler"]
            try:
                poolers[name] = build_pooler(pooler["name"], in_dim=pooler["in_dim"],
                                             out_dim=pooler.get("out_dim"),
                                             **pooler.get("options", {}))
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"{path}: tap {name!r}: pooler: {error}") from None
            layers[name] = spec["layer"]
        tower = VisionTower.from_pretrained(directory, **options)
        weights = read_safetensors(directory / TAPS_WEIGHTS_NAME)
        for name, pooler in poolers.items():
            own = {key.removeprefix(f"{name}."): value for key, value in weights.items()
                   if key.startswith(f"{name}.")}
            check_state_dict(pooler, own, directory / TAPS_WEIGHTS_NAME)
            pooler.load_state_dict(own)
            parameter = next(tower.pooler.parameters(), None)
            if parameter is not None:
                pooler.to(parameter.dtype)
        try:
            return cls(tower, {name: (layers[name], poolers[name]) for name in poolers})
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
