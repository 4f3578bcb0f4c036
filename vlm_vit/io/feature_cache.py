"""The tokens a frozen tower hands its pooler, cached per image (LLaVA stage 1 trains only
the projector, so its encoder computes the same features every epoch and every rerun).

    cache = EncodeCache("~/.cache/vlm-vit/features", max_bytes=50 * 2**30)
    cache_tower_features(tower, cache)   # tower.select / select_packed now read it first
    cache_tower_features(tower, None)    # and stop

An entry is keyed by the pixels the encoder sees (each image's preprocessed tensor: its
bytes, shape and dtype) and by `EncodeCache.context`: the encoder's weights, its config and
the processor, the layers, `keep_prefix`, the device type, the parameters' dtype, and
autocast's state at the call. A hit returns the bytes the encoder gave when the entry was
written, so two runs over the same cache (a rerun, a resumed run, another learning rate)
see bit-identical features. The images a batch misses are encoded together in one call, as
the uncached tower would encode them; an entry written from another batch can differ from
a fresh call in the last bits (CPU kernels are not bit-invariant to a batch's order: up to
6e-8 on a tiny CLIP tower), so a run from the cache equals one without it within rounding.

Only a frozen encoder can be cached (a trained one changes its features every step): a
parameter that requires grad at a call raises. The context is computed when the cache is
attached: attach it after the weights are final (the trainer's resume loads only what trains).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from vlm_vit.io.encode_cache import CacheContext, EncodeCache

OUTPUTS = "pooler inputs"  # what the entries hold, in the key (encode's entries hold others)


def cache_tower_features(tower: Any, cache: EncodeCache | None) -> None:
    """Makes `tower.select` and `tower.select_packed` read and fill `cache` (None: stop).

    Raises:
        ValueError: when a parameter of the tower's encoder requires grad.
    """
    if cache is None:
        tower.feature_cache = None
        return
    _check_frozen(tower.encoder)
    layers = tower.feature_layer if isinstance(tower.feature_layer, list) else \
        [tower.feature_layer]
    context = cache.context(tower.encoder, tower.processor, outputs=OUTPUTS, layers=layers,
                            keep_prefix=tower.keep_prefix)
    tower.feature_cache = FeatureCache(cache, context)


def _check_frozen(encoder: torch.nn.Module) -> None:
    trained = [name for name, parameter in encoder.named_parameters() if parameter.requires_grad]
    if trained:
        raise ValueError(f"the feature cache needs a frozen encoder; {len(trained)} of its "
                         f"parameters train (first {trained[0]!r}): freeze it (stage 1) or "
                         "train without the cache")


def _pixels_key(pixels: torch.Tensor) -> bytes:
    """What identifies an image's pixels: dtype, shape and bytes."""
    value = pixels.detach().cpu().contiguous()
    header = f"{value.dtype}|{tuple(value.shape)}|".encode()
    return hashlib.sha256(header + value.view(torch.uint8).numpy().tobytes()).digest()


class FeatureCache:
    """`select` and `select_packed` of a tower, through an `EncodeCache` (see the module).

    Args:
        cache: the store.
        context: the key's context without autocast (added per call).
    """

    def __init__(self, cache: EncodeCache, context: CacheContext) -> None:
        self.cache, self.base = cache, context
        self._contexts: dict[str, CacheContext] = {}

    def _context(self, device: torch.device) -> CacheContext:
        kind = device.type
        state = (f"autocast {torch.get_autocast_dtype(kind)}"
                 if torch.is_autocast_enabled(kind) else "no autocast")
        if state not in self._contexts:
            digest = hashlib.sha256(f"{self.base.digest}|{state}".encode()).hexdigest()
            self._contexts[state] = CacheContext(digest, {**self.base.parts, "autocast": state})
        return self._contexts[state]

    def select(self, tower: Any, pixel_values: torch.Tensor, compute: Any
               ) -> tuple[torch.Tensor, tuple[int, int]]:
        """`tower.select` for `[B, C, H, W]` pixels: each row's tokens from the cache, the
        rows it misses computed in one `compute` call and stored."""
        _check_frozen(tower.encoder)
        context = self._context(pixel_values.device)
        keys = [_pixels_key(row) for row in pixel_values]
        found = [self.cache.get(context, key) for key in keys]
        missing = [index for index, entry in enumerate(found) if entry is None]
        if missing:
            tokens, grid = compute(pixel_values[missing] if len(missing) < len(keys)
                                   else pixel_values)
            for row, index in enumerate(missing):
                entry = {"tokens": tokens[row], "grid": torch.tensor(grid)}
                self.cache.put(context, keys[index], entry)
                found[index] = {name: value.detach() for name, value in entry.items()}
        if len(missing) < len(keys):  # else the computed batch, exactly as uncached
            tokens = torch.stack([entry["tokens"].to(pixel_values.device) for entry in found])
        grid = tuple(int(side) for side in found[0]["grid"])
        return tokens, grid

    def select_packed(self, tower: Any, images: list[torch.Tensor], compute: Any
                      ) -> tuple[torch.Tensor, tuple[int, ...], tuple[tuple[int, int], ...],
                                 tuple[int, ...]]:
        """`tower.select_packed` for a list of images (or clips): each input's segments from
        the cache, the inputs it misses packed into one `compute` call and stored."""
        _check_frozen(tower.encoder)
        images = list(images)
        context = self._context(images[0].device)
        keys = [_pixels_key(image) for image in images]
        found = [self.cache.get(context, key) for key in keys]
        missing = [index for index, entry in enumerate(found) if entry is None]
        if missing:
            tokens, lengths, grids, frames = compute([images[index] for index in missing])
            parts = iter(tokens.split(list(lengths)))
            segments = iter(zip(lengths, grids, strict=True))
            for index, count in zip(missing, frames, strict=True):
                own = [next(segments) for _ in range(count)]
                entry = {"tokens": torch.cat([next(parts) for _ in range(count)]),
                         "lengths": torch.tensor([length for length, _ in own]),
                         "grids": torch.tensor([list(grid) for _, grid in own])}
                self.cache.put(context, keys[index], entry)
                found[index] = {name: value.detach() for name, value in entry.items()}
        tokens = torch.cat([entry["tokens"].to(images[0].device) for entry in found])
        lengths = tuple(int(length) for entry in found for length in entry["lengths"])
        grids = tuple((int(rows), int(cols)) for entry in found for rows, cols in entry["grids"])
        frames = tuple(len(entry["lengths"]) for entry in found)
        return tokens, lengths, grids, frames
