"""`VisionTower`: pixels to the tokens an LLM receives (encoder, layer choice, pooler)."""

from __future__ import annotations

import contextlib
import itertools
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

import vlm_vit.io.hub as hub
from vlm_vit.config import check_bool, is_int
from vlm_vit.io.files import atomic_directory, read_json, write_safetensors
from vlm_vit.io.integrity import verify_files, write_manifest
from vlm_vit.io.native import CONFIG_NAME, check_state_dict
from vlm_vit.io.tensor_files import read_safetensors
from vlm_vit.model import VisionEncoder
from vlm_vit.poolers import build_pooler, pool_packed
from vlm_vit.poolers.base import TokenWise
from vlm_vit.presets import parse_dtype
from vlm_vit.processor import PROCESSOR_CONFIG_NAME, ImageProcessor
from vlm_vit.processor.anyres import (
    Tiling,
    as_tiling,
    finish_grid,
    num_views,
    pack_features,
    stitch_views,
)
from vlm_vit.processor.anyres import num_image_tokens as tiled_tokens
from vlm_vit.registry import UnknownNameError

POOLER_WEIGHTS_NAME = "pooler.safetensors"
TILING_WEIGHTS_NAME = "tiling.safetensors"  # the tiling's `image_newline`, when it has one


def no_graph_if_frozen(module: nn.Module) -> contextlib.AbstractContextManager:
    """`torch.no_grad()` when no parameter of `module` trains (its activations need no
    autograd graph: projector-only training), else nothing."""
    frozen = torch.is_grad_enabled() and not any(p.requires_grad for p in module.parameters())
    return torch.no_grad() if frozen else contextlib.nullcontext()


class VisionTower(nn.Module):
    """An encoder, the layer(s) to read, and a pooler or projector.

    Args:
        encoder: the `VisionEncoder`.
        pooler: a pooler (see `vlm_vit.poolers`), e.g. `build_pooler("mlp2x_gelu", ...)`.
        feature_layer: None for the final tokens (after the final norm); an int or a list of
            hidden-state indices for raw block outputs (LLaVA: -2); a list is concatenated
            on the channel axis. The encoder runs only as deep as the deepest one.
        keep_prefix: hand the pooler the prefix tokens (class and register) before the
            patch tokens; default False: the patch tokens only, as LLaVA does. A pooler
            that reads the class token, or keeps the prefix tokens in its output (`all`
            with `keep_prefix=True`), needs True.
        processor: the encoder's preprocessing (an `ImageProcessor`), saved with the tower
            and read back by `from_pretrained` and `load_processor`; `load_tower` sets the
            checkpoint's own.
        tiling: AnyRes (`vlm_vit.processor.Tiling`, LLaVA-NeXT / OneVision): `forward` then
            takes each image's views and size (`forward_tiled`); default: the processor's.
            With `tiling.newline` the tower holds `image_newline` `[out_dim]`, saved with it.

    Raises:
        ValueError: when the pooler cannot work on what the tower gives it (a pooler that
            keeps or reads the prefix tokens in a tower that drops them), or the tiling
            differs from the processor's, or the pooler gives no square grid per tile.
    """

    def __init__(self, encoder: VisionEncoder, pooler: nn.Module,
                 feature_layer: int | list[int] | None = None, keep_prefix: bool = False,
                 processor: ImageProcessor | None = None, tiling: Tiling | None = None):
        super().__init__()
        self.encoder = encoder
        self.processor = processor
        self.pooler = pooler
        self.feature_layer = list(feature_layer) if isinstance(feature_layer, (list, tuple)) \
            else feature_layer
        self.keep_prefix = check_bool("keep_prefix", keep_prefix)
        self.feature_cache = None  # vlm_vit.io.feature_cache.cache_tower_features sets it
        for layer in self._layers or []:
            encoder.layer_index(layer)  # a bad index fails here, not at the first batch
        if getattr(pooler, "requires_class_token", False):
            if not encoder.config.class_token:
                raise ValueError("this pooler reads the class token, and the encoder has none; "
                                 "use 'mean' or 'attention_pool'")
            if not keep_prefix:
                raise ValueError("this pooler reads the class token, which the tower drops "
                                 "(keep_prefix=False); build the tower with keep_prefix=True")
        if getattr(pooler, "keep_prefix", False) and not keep_prefix:
            raise ValueError("the pooler keeps the prefix tokens (its keep_prefix=True), "
                             "which the tower drops before it (VisionTower keep_prefix=False); "
                             "build the tower with keep_prefix=True too")
        in_dim = getattr(pooler, "in_dim", None)
        if in_dim is not None and in_dim != self.feature_dim:
            raise ValueError(f"the pooler takes width {in_dim}, but the tower gives "
                             f"{self.feature_dim} (feature_layer={feature_layer!r})")
        own = getattr(processor, "tiling", None)
        self.tiling = as_tiling(tiling) if tiling is not None else own
        if processor is not None and own != self.tiling:
            raise ValueError(f"the tower tiles by {self.tiling} but its processor by {own}; "
                             "give the processor the same tiling (and size)")
        newline = None
        if self.tiling is not None:
            self.tile_side = self._tile_side()
            width = getattr(pooler, "out_dim", None)
            if self.tiling.newline:
                if width is None:
                    raise ValueError("a tiling with newline needs a pooler with an out_dim")
                newline = nn.Parameter(torch.randn(width) / math.sqrt(width))  # LLaVA-NeXT's
        self.register_parameter("image_newline", newline)

    def _tile_side(self) -> int:
        """Tokens per tile side after the pooler: tiling packs square grids of them."""
        tile = self.tiling.tile_size
        count = self.pooler.num_output_tokens(self.encoder.patch_embed.grid(tile, tile),
                                              num_prefix_tokens=self.num_prefix_tokens)
        side = math.isqrt(count or 0)
        if self.num_prefix_tokens or not count or side * side != count:
            raise ValueError(f"tiling needs a square grid of tokens per {tile}x{tile} tile "
                             f"and no prefix tokens (keep_prefix=False); the pooler gives "
                             f"{count} with {self.num_prefix_tokens} prefix tokens")
        return side

    @property
    def _layers(self) -> list[int] | None:
        if self.feature_layer is None:
            return None
        return self.feature_layer if isinstance(self.feature_layer, list) else [self.feature_layer]

    @property
    def feature_dim(self) -> int:
        """The width of the tokens handed to the pooler."""
        return self.encoder.config.width * len(self._layers or [None])

    @property
    def blocks_used(self) -> int:
        """How many of the encoder's blocks run (the rest never see an image)."""
        if self._layers is None:
            return self.encoder.config.depth
        return max(self.encoder.layer_index(layer) for layer in self._layers)

    @property
    def num_prefix_tokens(self) -> int:
        """Prefix tokens handed to the pooler (0 unless `keep_prefix`)."""
        return self.encoder.num_prefix_tokens if self.keep_prefix else 0

    def select(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """The tokens handed to the pooler, `[B, prefix? + N, feature_dim]`, and the grid."""
        if self.feature_cache is not None:
            return self.feature_cache.select(self, pixel_values, self._select)
        return self._select(pixel_values)

    def _select(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        with no_graph_if_frozen(self.encoder):
            out = self.encoder(pixel_values, feature_layers=self._layers)
        tokens = out.tokens if self._layers is None else torch.cat(out.features, dim=-1)
        if not self.keep_prefix:
            tokens = tokens[:, out.num_prefix_tokens:]
        return tokens, out.grid

    def select_packed(self, images: list[torch.Tensor] | tuple[torch.Tensor, ...]
                      ) -> tuple[torch.Tensor, tuple[int, ...], tuple[tuple[int, int], ...],
                                 tuple[int, ...]]:
        """For a list of `[C, H_i, W_i]` images (or clips), encoded in one packed pass: the
        tokens handed to the pooler `[total, feature_dim]`, tokens and grid per segment,
        and segments per input (a clip's temporal slices; `PackedOutput.frames`)."""
        if self.feature_cache is not None:
            return self.feature_cache.select_packed(self, images, self._select_packed)
        return self._select_packed(images)

    def _select_packed(self, images: list[torch.Tensor] | tuple[torch.Tensor, ...]
                       ) -> tuple[torch.Tensor, tuple[int, ...], tuple[tuple[int, int], ...],
                                  tuple[int, ...]]:
        with no_graph_if_frozen(self.encoder):
            out = self.encoder(list(images), feature_layers=self._layers)
        tokens = out.tokens if self._layers is None else torch.cat(out.features, dim=-1)
        lengths = out.lengths
        if not self.keep_prefix and out.num_prefix_tokens:
            tokens = tokens[out.patch_mask()]
            lengths = tuple(length - out.num_prefix_tokens for length in lengths)
        return tokens, lengths, out.grids, out.frames or (1,) * len(lengths)

    def forward(self, pixel_values: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...],
                image_sizes: Any = None) -> torch.Tensor | list[torch.Tensor]:
        """Pixels `[B, C, H, W]` to `[B, M, out_dim]` tokens (or `[B, out_dim]` vectors).

        A list of `[C, H_i, W_i]` images of any sizes is encoded in one packed pass and
        pooled image by image (`vlm_vit.poolers.pool_packed`): a list of `[M_i, out_dim]`
        tensors, M_i = `num_image_tokens((H_i, W_i))` (or of `[out_dim]` vectors). A clip
        `[frames, C, H, W]` in the list (an encoder with temporal patches) gives its temporal
        slices' tokens end to end, `num_image_tokens((H, W), frames=frames)`. With `image_sizes`, a
        list of each image's tiled views: see `forward_tiled`.
        """
        if image_sizes is not None:
            return self.forward_tiled(pixel_values, image_sizes)
        if self.tiling is not None and isinstance(pixel_values, (list, tuple)):
            raise ValueError("a tiled tower takes a list of views with image_sizes (each "
                             "image's (height, width): ImageProcessor.tile gives both)")
        if isinstance(pixel_values, (list, tuple)):
            tokens, lengths, grids, frames = self.select_packed(pixel_values)
            return join_clips(pool_packed(self.pooler, tokens, lengths=lengths, grids=grids,
                                          num_prefix_tokens=self.num_prefix_tokens), frames)
        tokens, grid = self.select(pixel_values)
        return self.pooler(tokens, num_prefix_tokens=self.num_prefix_tokens, grid=grid)

    def forward_tiled(self, views: list[torch.Tensor] | tuple[torch.Tensor, ...],
                      image_sizes: Any) -> list[torch.Tensor]:
        """AnyRes: each image's views `[V_i, C, t, t]` (base first, as `ImageProcessor.tile`
        gives them) and its original (height, width) to its tokens `[M_i, out_dim]`,
        M_i = `num_image_tokens((height, width))`. Every view of every image is encoded and
        pooled in one batch; each image is then packed as LLaVA-NeXT does: the base view's
        tokens, then the tiles' grid stitched, unpadded, (OneVision) shrunk, a newline after
        each row (`vlm_vit.processor.anyres.pack_features`).

        Raises:
            ValueError: without a tiling, or when views and sizes disagree.
        """
        if self.tiling is None:
            raise ValueError("image_sizes is for a tiled tower; this one has no tiling")
        views = list(views)
        sizes = [tuple(int(side) for side in size) for size in image_sizes]
        tile = self.tiling.tile_size
        if not views or len(views) != len(sizes):
            raise ValueError(f"{len(views)} images of views for {len(sizes)} image sizes")
        for index, (image, size) in enumerate(zip(views, sizes, strict=True)):
            expected = num_views(self.tiling, size)
            if image.ndim != 4 or image.shape[0] != expected or image.shape[2:] != (tile, tile):
                raise ValueError(f"image {index} of size {size}: views of shape "
                                 f"{list(image.shape)}, its tiling needs [{expected}, C, {tile}, "
                                 f"{tile}]")
        tokens, grid = self.select(torch.cat(views))
        counts = [len(v) for v in views]
        if not isinstance(self.pooler, TokenWise):
            pooled = self.pooler(tokens, num_prefix_tokens=0, grid=grid)  # [sum V_i, s*s, D]
            return [pack_features(part, self.tiling, size, self.image_newline)
                    for part, size in zip(pooled.split(counts), sizes, strict=True)]
        return self._project_kept(tokens.split(counts), sizes)

    def _project_kept(self, features: tuple[torch.Tensor, ...], sizes: list[tuple[int, int]]
                      ) -> list[torch.Tensor]:
        """A token-wise pooler maps only the tokens unpadding keeps, all in one call: the
        same tokens as projecting every view first (LLaVA-NeXT's order), less work (a photo's
        tiles are up to a third padding)."""
        if features[0].shape[-1] != self.pooler.in_dim:
            raise ValueError(f"tokens have width {features[0].shape[-1]}, the pooler expects "
                             f"{self.pooler.in_dim}")
        stitched = [stitch_views(part, self.tiling, size)
                    for part, size in zip(features, sizes, strict=True)]
        kept = [(len(base), tuple(grid.shape[:2])) for base, grid in stitched]
        mapped = self.pooler.map_tokens(torch.cat(
            [torch.cat([base, grid.reshape(-1, grid.shape[-1])]) for base, grid in stitched]))
        parts = mapped.split([count + rows * cols for count, (rows, cols) in kept])
        side = math.isqrt(features[0].shape[1])
        return [finish_grid(part[:count], part[count:].unflatten(0, grid), self.tiling, side,
                            self.image_newline) for part, (count, grid) in zip(parts, kept,
                                                                              strict=True)]

    def num_image_tokens(self, image_size: int | tuple[int, int] | None = None, *,
                         frames: int = 1) -> int | None:
        """Exactly how many tokens `forward` returns per image of this size (None: a vector);
        with a tiling, per original image size (any, each side at least 1).

        Args:
            image_size: (height, width), or one side of a square; default: the encoder's.
            frames: 1 for an image; a clip's frame count (an untiled tower with temporal
                patches, `temporal_patch_size`: its slices' tokens end to end).

        Raises:
            ValueError: for a size that is not a multiple of the patch size (untiled), a size
                that is not (height, width) (a clip's frames go in `frames`), or a clip the
                tower cannot encode.
        """
        if image_size is None:
            image_size = self.encoder.config.image_size
        if not is_int(image_size) and len(image_size) != 2:
            raise ValueError(f"image_size {tuple(image_size)} is not (height, width) or one "
                             f"side; a clip's frame count goes in frames=, as in "
                             f"num_image_tokens((height, width), frames=count)")
        temporal = self.encoder.config.temporal_patch_size
        if not is_int(frames) or frames < 1 or \
                frames > 1 and (temporal is None or self.tiling is not None):
            raise ValueError(f"a clip of {frames!r} frames needs a positive frame count and "
                             "an untiled tower with temporal patches (temporal_patch_size)")
        if frames > 1:
            return -(-frames // temporal) * self.num_image_tokens(image_size)
        height, width = (image_size, image_size) if is_int(image_size) else image_size
        if self.tiling is not None:
            return tiled_tokens(self.tiling, (height, width), self.tile_side)
        grid = self.encoder.patch_embed.grid(height, width)
        return self.pooler.num_output_tokens(grid, num_prefix_tokens=self.num_prefix_tokens)

    # -- saving ------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path, *, max_shard_size: int | str = "5GB",
                        model_card: bool = True) -> Path:
        """Writes the encoder (as `VisionEncoder.save_pretrained`, so `load_encoder` still
        reads it, sharded above `max_shard_size`, with a model card unless `model_card` is
        False or one exists), the selection and pooler spec in `config.json`, the pooler
        weights, and the processor when the tower has one.

        Raises:
            ValueError: for a pooler not built by `build_pooler` (its spec is unknown).
        """
        spec = getattr(self.pooler, "pooler_spec", None)
        if spec is None:
            raise ValueError(f"cannot save a {type(self.pooler).__name__} pooler that was not "
                             "built by vlm_vit.build_pooler: its name and options are unknown")
        directory = Path(directory)
        tower = {"feature_layer": self.feature_layer, "keep_prefix": self.keep_prefix,
                 "pooler": spec}
        if self.tiling is not None:
            tower["tiling"] = self.tiling.to_dict()
        with atomic_directory(directory) as temp:  # every file appears at once
            self.encoder.save_pretrained(temp, extra_config={"tower": tower},
                                         max_shard_size=max_shard_size, model_card=model_card)
            write_safetensors(self.pooler.state_dict(), temp / POOLER_WEIGHTS_NAME)
            written = [POOLER_WEIGHTS_NAME]
            if self.image_newline is not None:
                write_safetensors({"image_newline": self.image_newline.detach()},
                                  temp / TILING_WEIGHTS_NAME)
                written.append(TILING_WEIGHTS_NAME)
            write_manifest(temp, written, merge=True)  # beside the encoder's
            if self.processor is not None:
                self.processor.save_pretrained(temp)
        return directory

    @classmethod
    def from_pretrained(cls, name: str | Path, *, dtype: str | torch.dtype | None = None,
                        verify: bool | None = None, **encoder_overrides) -> VisionTower:
        """Reads a tower written by `save_pretrained`, bit-exactly.

        Args:
            name: the tower's directory, or a Hub name of one, as `load_tower` takes.
            dtype: cast the weights, the pooler's too: a `torch.dtype` or its usual string
                (`vlm_vit.presets.parse_dtype`; default: as stored).
            verify: check the weights against `manifest.json`, as in
                `VisionEncoder.from_pretrained`; False skips it.
            **encoder_overrides: `EncoderConfig` fields, as in `VisionEncoder.from_pretrained`.

        Raises:
            FileNotFoundError, ValueError: naming the missing or malformed file; the tower
                section is checked (`read_tower_config`) before anything is built.
        """
        dtype = parse_dtype(dtype)
        directory = hub.resolve(name)
        config_path = directory / CONFIG_NAME
        tower = read_tower_config(read_json(config_path), config_path)
        spec = tower["pooler"]
        try:  # first: its sizes are bounded before the encoder's weights are read
            pooler = build_pooler(spec["name"], in_dim=spec["in_dim"], out_dim=spec["out_dim"],
                                  **spec["options"])
        except (ValueError, UnknownNameError) as error:
            raise ValueError(f"{config_path}: tower.pooler: {error}") from None
        encoder = VisionEncoder.from_pretrained(directory, dtype=dtype, verify=verify,
                                                **encoder_overrides)
        weights = directory / POOLER_WEIGHTS_NAME
        verify_files(directory, [weights], verify)
        state = read_safetensors(weights)
        check_state_dict(pooler, state, weights)
        pooler.load_state_dict(state)
        if dtype is not None:
            pooler.to(dtype)
        processor = ImageProcessor.from_pretrained(directory) \
            if (directory / PROCESSOR_CONFIG_NAME).is_file() else None
        try:
            built = cls(encoder, pooler, feature_layer=tower["feature_layer"],
                        keep_prefix=tower["keep_prefix"], processor=processor,
                        tiling=tower["tiling"])
        except ValueError as error:
            raise ValueError(f"{config_path}: tower: {error}") from None
        if built.image_newline is not None:
            built._load_newline(directory, verify, dtype)
        return built

    def _load_newline(self, directory: Path, verify: bool | None,
                      dtype: torch.dtype | None) -> None:
        """Reads `image_newline` from `tiling.safetensors`, strictly."""
        path = directory / TILING_WEIGHTS_NAME
        verify_files(directory, [path], verify)
        state = read_safetensors(path)
        shapes = {name: list(tensor.shape) for name, tensor in state.items()}
        expected = {"image_newline": list(self.image_newline.shape)}
        if shapes != expected:
            raise ValueError(f"{path} holds {shapes}; the tower's tiling needs {expected}")
        newline = state["image_newline"]  # as stored, bit for bit, unless a dtype is asked
        self.image_newline.data = newline if dtype is None else newline.to(dtype)


def join_clips(pooled: list[torch.Tensor], frames: tuple[int, ...]) -> list[torch.Tensor]:
    """Per input, its segments' pooled tokens end to end (a clip's temporal slices; an image
    is one segment).

    Raises:
        ValueError: for a pooler that gives one vector per segment and a clip among them.
    """
    if len(frames) == len(pooled):  # no clip
        return pooled
    if pooled[0].ndim != 2:
        raise ValueError("a pooler that returns one vector per image cannot pool a clip's "
                         "slices into one sequence")
    starts = [0, *itertools.accumulate(frames)]
    return [torch.cat(pooled[start:stop]) for start, stop in itertools.pairwise(starts)]


TOWER_KEYS = ("feature_layer", "keep_prefix", "pooler", "tiling")
POOLER_SPEC_KEYS = ("name", "in_dim", "out_dim", "options")


def read_tower_config(raw: dict[str, Any], source: object) -> dict[str, Any]:
    """The `tower` section of a tower's `config.json`, checked field by field.

    It holds `feature_layer` (null, an int, or a list of ints), `keep_prefix` (true or
    false; older towers hold `drop_prefix`, its negation: `_legacy_drop_prefix`) and
    `pooler`: `{"name": str, "in_dim": int, "out_dim": int or null, "options": {...}}`, as
    `VisionTower.save_pretrained` writes it, and `tiling` when the tower tiles
    (`Tiling.to_dict`). The pooler's sizes are bounded by `build_pooler`.

    Args:
        raw: the whole parsed `config.json`.
        source: the file, named in errors.

    Returns:
        The section, with `out_dim` and `options` filled in when left out.

    Raises:
        ValueError: naming `source` and the field (`tower.pooler.name`, ...) for a section
            that is missing, of the wrong type, or has unknown keys.
    """
    tower = raw.get("tower")
    if tower is None:
        raise ValueError(f"{source} has no 'tower' section: it holds an encoder only (use "
                         "load_encoder, or build a VisionTower)")
    tower = _legacy_drop_prefix(tower, source)
    _check_object("tower", tower, TOWER_KEYS, source)
    for key in ("pooler", "keep_prefix"):
        if key not in tower:
            raise ValueError(f"{source}: tower.{key} is missing")
    if not isinstance(tower["keep_prefix"], bool):
        raise ValueError(f"{source}: tower.keep_prefix must be true or false, got "
                         f"{tower['keep_prefix']!r}")
    layer = tower.get("feature_layer")
    layers = layer if isinstance(layer, list) and layer else [layer]
    if layer is not None and not all(is_int(index) for index in layers):
        raise ValueError(f"{source}: tower.feature_layer must be null, an int or a non-empty "
                         f"list of ints (hidden-state indices), got {layer!r}")
    spec = tower["pooler"]
    _check_object("tower.pooler", spec, POOLER_SPEC_KEYS, source)
    for key in ("name", "in_dim"):
        if key not in spec:
            raise ValueError(f"{source}: tower.pooler.{key} is missing")
    if not isinstance(spec["name"], str):
        raise ValueError(f"{source}: tower.pooler.name must be a string, got {spec['name']!r}")
    options = spec.get("options", {})
    if not isinstance(options, dict):
        raise ValueError(f"{source}: tower.pooler.options must be a JSON object of the "
                         f"pooler's options, got {options!r}")
    pooler = {"name": spec["name"], "in_dim": spec["in_dim"], "out_dim": spec.get("out_dim"),
              "options": options}
    try:
        tiling = as_tiling(tower.get("tiling"))
    except ValueError as error:
        raise ValueError(f"{source}: tower.{error}") from None
    return {"feature_layer": layer, "keep_prefix": tower["keep_prefix"], "pooler": pooler,
            "tiling": tiling}


def _legacy_drop_prefix(tower: Any, source: object) -> Any:
    """Towers saved before issue 41 wrote `drop_prefix` (the negation of `keep_prefix`):
    read as `keep_prefix`, so they still load; both at once is refused."""
    if not isinstance(tower, dict) or "drop_prefix" not in tower:
        return tower
    tower = dict(tower)
    drop = tower.pop("drop_prefix")
    if "keep_prefix" in tower:
        raise ValueError(f"{source}: tower has both keep_prefix and drop_prefix (its older "
                         "name, negated); keep keep_prefix only")
    if not isinstance(drop, bool):
        raise ValueError(f"{source}: tower.drop_prefix must be true or false, got {drop!r}")
    tower["keep_prefix"] = not drop
    return tower


def _check_object(name: str, value: Any, keys: tuple[str, ...], source: object) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{source}: {name} must be a JSON object with {', '.join(keys)}, got "
                         f"{value!r}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ValueError(f"{source}: {name} has unknown keys {', '.join(unknown)}; known: "
                         f"{', '.join(keys)}")
