"""Post-projector image embeddings in the layout vLLM takes as precomputed multimodal input
(`LLM(..., enable_mm_embeds=True)`; `multi_modal_data={"image": ...}`), so a server can run
the language model alone on what this encoder computed.

    from vlm_vit_llm import MultimodalLM
    from vlm_vit_llm.embeddings import image_embeddings, save_embeddings

    mm = MultimodalLM.from_pretrained("llava-hf/llava-1.5-7b-hf")
    save_embeddings(image_embeddings(mm, ["a.jpg", "b.jpg"]), "embeds.safetensors")

Layouts, by the model's kind (vLLM's documented embedding inputs; facts from its docs):

- `fixed` (LLaVA-1.5 and any untiled tower of a fixed size): `image_embeds`
  `[images, tokens, hidden]`; vLLM expands each image's one placeholder to `tokens`.
- `per_image` (LLaVA-NeXT / OneVision: each image's tokens depend on its size):
  `image_embeds.<i>` `[tokens_i, hidden]` per image and `image_sizes` `[images, 2]`
  (height, width), the list vLLM takes for images of different sizes.
- `qwen_vl` (Qwen2-VL, Qwen2.5-VL): `image_embeds` `[all images' tokens, hidden]`, end to end,
  and `image_grid_thw` `[images, 3]`: each image's temporal, height and width patches (before
  the merge), as `{"image_embeds": ..., "image_grid_thw": ...}`. Qwen3-VL's tokens carry
  their DeepStack features too: `[all images' tokens, (1 + levels) * hidden]`, each token's
  merger output then its DeepStack mergers' in layer order, which vLLM's Qwen3-VL splits
  (`visual_dim`, `multiscale_dim`) and adds after its first decoder layers. Clips (`Video`)
  go apart, as vLLM's video input (`multi_modal_data["video"]`): `video_embeds`,
  `video_grid_thw` and, for a model whose positions follow time (Qwen2.5-VL),
  `second_per_grid_ts` (each clip's seconds per temporal patch); the metadata's `videos`
  lists which of the inputs were clips.

Each image's placeholder count (`placeholder_tokens`) is what the model's processor inserts
for it. The file's metadata names the layout, the transformers class and those counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlm_vit.io.encode_cache import weights_digest
from vlm_vit.io.files import atomic_write
from vlm_vit_llm.batch_types import TiledImage, Video
from vlm_vit_llm.mrope import clip_rate, multimodal_rope, token_grid
from vlm_vit_llm.peft_helpers import split_peft
from vlm_vit_llm.pixels import as_pixels

LAYOUTS = ("fixed", "per_image", "qwen_vl")
VIDEO_TENSORS = ("video_embeds", "video_grid_thw", "second_per_grid_ts")  # vLLM's video input
MAX_IMAGES = 4096  # per call: the embeddings are held in memory together


@dataclass
class ImageEmbeddings:
    """Embeddings of several images in one vLLM layout.

    Attributes:
        layout: one of `LAYOUTS`.
        tensors: the named tensors of that layout (see the module docstring).
        placeholder_tokens: per image, the positions it takes in the LLM.
        model_class: the transformers class the embeddings are for (vLLM's model).
    """

    layout: str
    tensors: dict[str, torch.Tensor]
    placeholder_tokens: list[int]
    model_class: str
    metadata: dict[str, str] = field(default_factory=dict)

    def vllm_input(self) -> Any:
        """What goes in `multi_modal_data["image"]`: the tensor (`fixed`), the list of
        tensors (`per_image`), or the dict of `image_embeds` and `image_grid_thw` (Qwen);
        None when every input was a clip (`vllm_data`)."""
        if self.layout == "fixed":
            return self.tensors["image_embeds"]
        if self.layout == "per_image":
            return [self.tensors[f"image_embeds.{index}"]
                    for index in range(len(self.placeholder_tokens))]
        if "image_embeds" not in self.tensors:
            return None
        return {"image_embeds": self.tensors["image_embeds"],
                "image_grid_thw": self.tensors["image_grid_thw"]}

    def vllm_data(self) -> dict[str, Any]:
        """vLLM's whole `multi_modal_data`: the images' input under "image" and the clips'
        (`video_embeds`, `video_grid_thw`, `second_per_grid_ts` where the model has it)
        under "video", each only when there is one."""
        images = self.vllm_input()
        video = {name: tensor for name, tensor in self.tensors.items()
                 if name in VIDEO_TENSORS}
        return ({} if images is None else {"image": images}) | ({"video": video} if video else {})


@torch.inference_mode()
def image_embeddings(mm: Any, images: list[Any], cache: Any = None) -> ImageEmbeddings:
    """Each image's post-projector tokens (`MultimodalLM.image_features`, one tower call) in
    the layout of `mm`'s kind.

    Args:
        mm: a `MultimodalLM` (ours, or read from transformers).
        images: files, PIL images, arrays or pixel tensors, as `prepare` takes them.
        cache: a `vlm_vit.io.encode_cache.EncodeCache`: the tokens of images given as files
            are taken from it when it holds them for this tower and processor, and stored
            in it otherwise (the tower then runs on the others only).

    Raises:
        ValueError: for no images, more than `MAX_IMAGES`, or an image `prepare` refuses.
    """
    if not images:
        raise ValueError("no images to embed")
    if len(images) > MAX_IMAGES:
        raise ValueError(f"{len(images)} images in one call; at most {MAX_IMAGES}: split them")
    pixels = [as_pixels(image, mm.tower, mm.processor, index, mm.video_processor)
              for index, image in enumerate(images)]
    features = _features(mm, images, pixels, cache)
    counts = [int(tokens.shape[0]) for tokens in features]
    llm = split_peft(mm.llm)[0]
    model_class = _served_class(mm, llm)
    metadata = {} if getattr(mm, "deepstack", None) is None else \
        {"deepstack_levels": str(len(mm.deepstack.mergers))}
    if multimodal_rope(getattr(llm, "config", None)):
        tensors, clips = _qwen_tensors(mm, llm, pixels, features)
        if clips:
            metadata["videos"] = json.dumps(clips)
        layout = "qwen_vl"
    elif mm.tower.tiling is not None or len(set(counts)) > 1:
        tensors = {f"image_embeds.{index}": tokens for index, tokens in enumerate(features)}
        tensors["image_sizes"] = torch.tensor([list(_size(one)) for one in pixels])
        layout = "per_image"
    else:
        tensors = {"image_embeds": torch.stack(features)}
        layout = "fixed"
    return ImageEmbeddings(layout, tensors, counts, model_class, metadata)


def _qwen_tensors(mm: Any, llm: Any, pixels: list[Any], features: list[torch.Tensor]
                  ) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The `qwen_vl` layout's tensors: images' and clips' tokens and grids apart (a clip's
    seconds per temporal patch too, where the model's positions follow time), and which
    inputs were clips."""
    merge = getattr(mm.tower.pooler, "merge_size", 1)
    clips = [index for index, one in enumerate(pixels) if isinstance(one, Video)]
    tensors = {}
    for kind, rows in (("image", [i for i in range(len(pixels)) if i not in clips]),
                       ("video", clips)):
        if rows:
            grids = [token_grid(mm.tower, pixels[row]) for row in rows]
            tensors[f"{kind}_embeds"] = torch.cat([features[row] for row in rows])
            tensors[f"{kind}_grid_thw"] = torch.tensor([[t, h * merge, w * merge]
                                                        for t, h, w in grids])
    vision = getattr(llm.config, "vision_config", None)
    if clips and getattr(vision, "tokens_per_second", None) is not None:  # Qwen2.5-VL
        temporal = mm.tower.encoder.config.temporal_patch_size or 1
        tensors["second_per_grid_ts"] = torch.tensor(
            [temporal / clip_rate(pixels[row]) for row in clips])
    return tensors, clips


def _compute(mm: Any, pixels: list[Any]) -> list[torch.Tensor]:
    """Each image's post-projector tokens from one tower call; with DeepStack (Qwen3-VL)
    each token's merger output followed by its DeepStack mergers', in layer order."""
    deepstack = getattr(mm, "deepstack", None)
    if deepstack is None:
        return mm.image_features(pixels)
    features, taps = deepstack.image_features(mm, pixels)
    return [torch.cat([tokens, *(layer[index] for layer in taps)], dim=-1)
            for index, tokens in enumerate(features)]


def _features(mm: Any, images: list[Any], pixels: list[Any], cache: Any) -> list[torch.Tensor]:
    """Each image's tokens on the CPU in float32: from `cache` (files only) or the tower."""
    files = [Path(image) if isinstance(image, (str, Path)) else None for image in images]
    deepstack = getattr(mm, "deepstack", None)
    context = None if cache is None else cache.context(
        mm.tower, mm.processor, outputs="post-projector tokens",
        deepstack=None if deepstack is None else weights_digest(deepstack))
    features: list[torch.Tensor | None] = [None] * len(images)
    for index, file in enumerate(files):
        if context is not None and file is not None:
            hit = cache.get(context, file.read_bytes())
            features[index] = None if hit is None else hit["tokens"]
    missing = [index for index, tokens in enumerate(features) if tokens is None]
    computed = _compute(mm, [pixels[index] for index in missing]) if missing else []
    for index, tokens in zip(missing, computed, strict=True):
        features[index] = tokens.float().cpu()
        if context is not None and files[index] is not None:
            cache.put(context, files[index].read_bytes(), {"tokens": features[index]})
    return features


def _served_class(mm: Any, llm: Any) -> str:
    """The transformers class a server runs for `mm`: the folder's own for a Qwen-VL model,
    else the LLaVA class `llm export` writes for its tower."""
    if multimodal_rope(getattr(llm, "config", None)):
        return (getattr(llm.config, "architectures", None) or [type(llm).__name__])[0]
    if mm.tower.tiling is None:
        return "LlavaForConditionalGeneration"
    from vlm_vit_llm.llava_next import model_class

    return model_class(mm.tower.tiling).__name__


def _size(pixels: Any) -> tuple[int, int]:
    """An image's (height, width) as vLLM's `image_sizes` takes it: the original size of a
    tiled image, else its preprocessed size."""
    if isinstance(pixels, TiledImage):
        return tuple(pixels.size)
    return tuple(pixels.shape[-2:])


def save_embeddings(embeddings: ImageEmbeddings, path: str | Path) -> Path:
    """Writes the tensors and their metadata to one safetensors file, atomically."""
    from safetensors.torch import save

    metadata = {"layout": embeddings.layout, "model_class": embeddings.model_class,
                "placeholder_tokens": json.dumps(embeddings.placeholder_tokens),
                **embeddings.metadata}
    path = Path(path)
    data = save({name: tensor.contiguous() for name, tensor in embeddings.tensors.items()},
                metadata=metadata)
    with atomic_write(path, "wb") as handle:
        handle.write(data)
    return path


def write_embeddings(mm: Any, images: list[Any], path: str | Path,
                     cache_dir: str | Path | None = None) -> str:
    """`image_embeddings` of `images` saved to `path` (`vlm-vit llm embed`), through the
    cache in `cache_dir` when given; a line saying what was written."""
    cache = None
    if cache_dir is not None:
        from vlm_vit.io.encode_cache import EncodeCache

        cache = EncodeCache(cache_dir)
    embedded = image_embeddings(mm, images, cache)
    written = save_embeddings(embedded, path)
    cached = "" if cache is None else f"; cache: {cache.hits} hit(s), {cache.misses} miss(es)"
    clips = len(json.loads(embedded.metadata.get("videos", "[]")))
    inputs = f"{len(images) - clips} image(s)" + (f", {clips} clip(s)" if clips else "")
    return (f"wrote {written}: {inputs}, layout {embedded.layout} for "
            f"{embedded.model_class}, placeholder tokens {embedded.placeholder_tokens}{cached}")


def load_embeddings(path: str | Path) -> ImageEmbeddings:
    """Reads what `save_embeddings` wrote.

    Raises:
        ValueError: naming the file, for a file without this module's metadata.
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    try:
        layout, counts = metadata.pop("layout"), json.loads(metadata.pop("placeholder_tokens"))
        model_class = metadata.pop("model_class")
    except (KeyError, ValueError):
        raise ValueError(f"{path}: not an embeddings file vlm-vit-llm wrote (no layout, "
                         "model_class or placeholder_tokens in its metadata)") from None
    if layout not in LAYOUTS or not isinstance(counts, list):
        raise ValueError(f"{path}: layout {layout[:40]!r} is not one of {LAYOUTS}")
    return ImageEmbeddings(layout, tensors, counts, model_class, metadata)


__all__ = ["LAYOUTS", "ImageEmbeddings", "image_embeddings", "load_embeddings",
           "save_embeddings", "write_embeddings"]
