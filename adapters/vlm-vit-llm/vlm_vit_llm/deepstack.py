"""DeepStack (Meng et al. 2024, as Qwen3-VL runs it): besides the merger's tokens, which
replace the image placeholders' embeddings, further mergers read intermediate encoder layers,
and their tokens are added to the language model's hidden states at the image positions after
its first decoder layers (the k-th merger's after layer k).

    deepstack = DeepStack(taps, llm.model.language_model)   # taps: hf_qwen3_vl.deepstack_taps
    features, taps = deepstack.image_features(mm, pixels)   # one encoder run for both
    with fed(deepstack, batch):                             # batch.deepstack_features
        llm(inputs_embeds=..., position_ids=...)            # the prefill takes them

The language model stays transformers' own `Qwen3VLTextModel`, which takes DeepStack as its
forward's `visual_pos_masks` (`[B, L]`) and `deepstack_visual_embeds` (one `[image tokens, D]`
per layer, in the order of the mask's True positions). `Qwen3VLModel` fills both only from its
own vision tower, which the bridge drops; a forward pre-hook on the language model fills them
instead, for calls made inside `fed` whose sequence is the batch's: a forward, a packed
forward, a generation's prefill, never its decoding steps (their image tokens are in the cache).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from vlm_vit.taps import TappedTower
from vlm_vit_llm.batch_types import Video


class DeepStack(nn.Module):
    """Qwen3-VL's DeepStack mergers, fed to `language_model` (a `Qwen3VLTextModel`).

    Args:
        taps: `{name: (hidden-state index, pooler)}` (`vlm_vit.convert.hf_qwen3_vl.
            deepstack_taps`), in the order of the decoder layers they feed.
        language_model: the module whose forward takes `visual_pos_masks` and
            `deepstack_visual_embeds`; a forward pre-hook is put on it.

    Raises:
        ValueError: for more taps than the language model has decoder layers.
    """

    def __init__(self, taps: Mapping[str, tuple[int, nn.Module]], language_model: nn.Module):
        super().__init__()
        depth = len(getattr(language_model, "layers", ()))
        if not 0 < len(taps) <= depth:
            raise ValueError(f"{len(taps)} DeepStack taps for a language model of {depth} "
                             "decoder layers: each tap feeds one of its first layers")
        self.layers = {name: layer for name, (layer, _) in taps.items()}
        self.mergers = nn.ModuleDict({name: pooler for name, (_, pooler) in taps.items()})
        self._fed: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        language_model.register_forward_pre_hook(self._feed, with_kwargs=True)

    def taps(self) -> dict[str, tuple[int, nn.Module]]:
        """The taps as `TappedTower` and `hf_qwen3_vl.write(deepstack=...)` take them."""
        return {name: (self.layers[name], merger) for name, merger in self.mergers.items()}

    def image_features(self, mm: Any, pixels: Sequence[Any]
                       ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """Each image's merged tokens `[M_i, D]` (what `mm.image_features` gives) and, per
        DeepStack layer, each image's tap tokens `[M_i, D]`, from one packed encoder run.

        Raises:
            ValueError: for a clip of more than one temporal patch (Qwen3-VL writes a
                timestamp before each: `vlm_vit_llm.timestamps` gives them one by one), or
                pixels that are not `[C, H, W]`.
        """
        if not pixels:
            return [], [[] for _ in self.mergers]
        temporal = mm.tower.encoder.config.temporal_patch_size or 1
        if any(isinstance(image, Video) and len(image.frames) > temporal for image in pixels):
            raise ValueError("Qwen3-VL writes a timestamp before each temporal patch of a clip: "
                             "give the clip in a prompt written as text, which prepare "
                             "timestamps (vlm_vit_llm.timestamps)")
        images = [image.frames if isinstance(image, Video) else image for image in pixels]
        if any(not isinstance(image, torch.Tensor) or image.ndim not in (3, 4)
               or (image.ndim == 4) != isinstance(pixels[index], Video)
               for index, image in enumerate(images)):
            raise ValueError("image pixels must be [C, H, W] each, a clip's [T, C, H, W]")
        parameter = next(mm.tower.parameters())
        images = [image.to(device=parameter.device, dtype=parameter.dtype) for image in images]
        out = TappedTower(mm.tower, self.taps())(images)
        return list(out.tokens), [list(out.taps[name]) for name in self.mergers]

    @staticmethod
    def in_batch_order(taps: list[list[torch.Tensor]], owners: Sequence[int],
                       pack: Sequence[Sequence[int]] | None = None
                       ) -> tuple[torch.Tensor, ...] | None:
        """Per DeepStack layer, every image's tap tokens end to end `[image tokens, D]` in the
        order the batch holds its images (`MultimodalBatch.image_features`): prompt by prompt
        (for packed rows, as `pack` lays the prompts out), each prompt's in placeholder order.

        Args:
            taps: per layer, per image (in `owners`' order), its tap tokens.
            owners: each image's prompt.
            pack: the packing plan, or None for one prompt per row.

        Returns:
            The tensors, or None for a batch without images.
        """
        if not owners:
            return None
        prompts = range(max(owners, default=-1) + 1) if pack is None else \
            [prompt for row in pack for prompt in row]
        rank = {prompt: place for place, prompt in enumerate(prompts)}
        order = sorted(range(len(owners)), key=lambda image: rank[owners[image]])  # stable
        return tuple(torch.cat([layer[image] for image in order]) for layer in taps)

    @contextmanager
    def feeding(self, image_mask: torch.Tensor, features: Sequence[torch.Tensor]
                ) -> Iterator[None]:
        """Within it, a language-model call over a sequence of `image_mask`'s shape, with an
        empty cache, takes `features` at the mask's True positions."""
        if len(features) != len(self.mergers):
            raise ValueError(f"{len(features)} DeepStack features for {len(self.mergers)} "
                             "taps")
        self._fed = (image_mask, list(features))
        try:
            yield
        finally:
            self._fed = None

    def _feed(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The forward pre-hook: DeepStack's arguments for the call the batch fed is."""
        if self._fed is None:
            return None
        mask, features = self._fed
        embeds = kwargs.get("inputs_embeds")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if embeds is None or tuple(embeds.shape[:2]) != tuple(mask.shape) or (
                cache is not None and cache.get_seq_length() > 0):
            return None  # a decoding step: the image tokens are in the cache already
        if kwargs.get("deepstack_visual_embeds") is not None:
            raise ValueError("the language model was given DeepStack features of its own and "
                             "the bridge's")
        return args, {**kwargs, "visual_pos_masks": mask, "deepstack_visual_embeds": features}


def fed(deepstack: DeepStack | None, batch: Any):
    """`deepstack.feeding` for a `MultimodalBatch` holding images, else nothing to do."""
    if deepstack is None or batch.deepstack_features is None or not batch.image_mask.any():
        return nullcontext()
    return deepstack.feeding(batch.image_mask, batch.deepstack_features)


def train_projectors(mm: Any) -> None:
    """`mm`'s projector trains fully, and its DeepStack mergers (Qwen3-VL's other
    projectors) where it has some: stage 1 and LoRA's set-up."""
    mm.tower.pooler.requires_grad_(True)
    if mm.deepstack is not None:
        mm.deepstack.mergers.requires_grad_(True)
