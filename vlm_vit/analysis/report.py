"""`analyze`: the paper's section 4.5 pictures of an encoder, with the numbers behind them.

Files written into the output folder:

    analysis.json                  every number below, and the list of figures
    mean_attention_distance.png    one dot per head per layer (Appendix D.7, Figure 7 right)
    position_similarity.png        position-embedding cosine similarity (Figure 7 centre)
    embedding_filters.png          top principal components of the patch embedding (Figure 7
                                   left)
    rollout/NNN_<name>.png         each input with its attention rollout overlaid (Figure 6)
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import vlm_vit.analysis.figures as figures
from vlm_vit.analysis.attention import IDENTITY_WEIGHT, patch_distances
from vlm_vit.analysis.collect import ImageAttention, iter_image_attention
from vlm_vit.analysis.filters import embedding_filters
from vlm_vit.analysis.position import patch_position_embeddings, position_similarity
from vlm_vit.io.files import atomic_write
from vlm_vit.model import VisionEncoder
from vlm_vit.processor import ImageProcessor

logger = logging.getLogger(__name__)

JSON_NAME = "analysis.json"
DISTANCE_FIGURE = "mean_attention_distance.png"
POSITION_FIGURE = "position_similarity.png"
FILTERS_FIGURE = "embedding_filters.png"
ROLLOUT_FOLDER = "rollout"
PREFIX_HANDLING = (
    "mean attention distance uses patch-to-patch attention only: the class and register "
    "tokens' rows and columns are dropped and each patch query's weights renormalised over "
    "the patches; prefix_attention gives the mean weight patch queries put on those tokens"
)
DECIMALS = 6  # enough for pixels and similarities, and keeps the JSON readable


def _numbers(values: torch.Tensor | np.ndarray) -> list:
    return np.round(np.asarray(values, dtype=np.float64), DECIMALS).tolist()


def _file_stem(name: str) -> str:
    stem = Path(name).stem if not name.startswith("images[") else "image"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", stem) or "image"


def _draw_rollout(item: ImageAttention, index: int, processor: ImageProcessor,
                  out_dir: Path) -> str:
    """Writes one image's rollout overlay; returns its path relative to `out_dir`."""
    mean = torch.tensor(processor.mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(processor.std, dtype=torch.float32)[:, None, None]
    image = (item.pixels.float() * std + mean).clamp(0, 1).permute(1, 2, 0)  # (H, W, 3)
    heatmap = F.interpolate(item.rollout[None, None], size=tuple(image.shape[:2]),
                            mode="bilinear", align_corners=False)[0, 0]  # (H, W)
    relative = f"{ROLLOUT_FOLDER}/{index:03d}_{_file_stem(item.name)}.png"
    figures.plot_attention_rollout(image.numpy(), heatmap.numpy(), out_dir / relative,
                                   title=Path(item.name).name)
    return relative


def analyze(
    encoder: VisionEncoder,
    images: Sequence[Any],
    out_dir: str | Path,
    processor: ImageProcessor | None = None,
    *,
    filter_count: int = 28,
    draw: bool = True,
    progress: bool = False,
) -> dict[str, Any]:
    """Inspects an encoder as the ViT paper's section 4.5 does, and writes the results.

    Attention maps come from the encoder's `output_attentions` path, so an encoder built
    for speed is inspected as it is. Images go through one at a time and only running sums
    and each image's small rollout map are kept, so memory does not grow with their number.
    Mean attention distance is averaged over queries, then images (each image counts the
    same); prefix tokens are handled as `PREFIX_HANDLING` says.

    Args:
        encoder: the encoder to inspect.
        images: files, PIL images, arrays or tensors, anything `processor` takes (a single
            path counts as one image).
        out_dir: where the figures and `analysis.json` go; created if needed.
        processor: the preprocessing (default: ImageNet normalisation at the encoder's
            image size).
        filter_count: principal components of the patch embedding to draw (28 in the paper).
        draw: write the PNG figures; False writes only `analysis.json`.
        progress: show a progress bar.

    Returns:
        What `analysis.json` holds: `mean_attention_distance` (one list per layer of one
        value per head, pixels), `prefix_attention` (same shape),
        `uniform_attention_distance` (the distance if every query attended uniformly to
        every patch, for scale), `attention_rollout`, `position_similarity`,
        `embedding_filters`, `images`, `encoder`, `figures` (paths relative to `out_dir`).

    Raises:
        ValueError: for no images, or images the processor or encoder refuse.
    """
    images = [images] if isinstance(images, (str, Path)) else list(images)
    if not images:
        raise ValueError("analyze needs at least one image")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = encoder.config
    if processor is None:
        logger.info("no processor given: imagenet normalisation at %s", config.image_size)
        processor = ImageProcessor.for_family("imagenet", size=config.image_size)

    attention = _attention_over_images(encoder, images, processor, out_dir, draw=draw,
                                       progress=progress)
    uniform = float(patch_distances(attention.grid, config.patch_size).double().mean())
    similarity, components, explained = _tables(encoder, filter_count)
    written = attention.figures
    if draw:
        figures.plot_mean_attention_distance(attention.distance.numpy(),
                                             out_dir / DISTANCE_FIGURE, uniform=uniform)
        drawn = [DISTANCE_FIGURE]
        if similarity is not None:
            figures.plot_position_similarity(similarity.numpy(), config.grid,
                                             out_dir / POSITION_FIGURE)
            drawn.append(POSITION_FIGURE)
        if components is not None:
            figures.plot_embedding_filters(components.numpy(), out_dir / FILTERS_FIGURE)
            drawn.append(FILTERS_FIGURE)
        written = [*drawn, *written]

    result = _result(encoder, attention, uniform, similarity, components, explained, written)
    with atomic_write(out_dir / JSON_NAME, "w") as handle:
        json.dump(result, handle)
    logger.info("analysed %d images: %d figures and %s in %s", len(attention.names),
                len(written), JSON_NAME, out_dir)
    return result


@dataclass
class _Attention:
    """What the images' attention comes to: per layer and head, means over images."""

    names: list[str]
    distance: torch.Tensor  # (depth, heads), pixels
    share: torch.Tensor  # (depth, heads), weight on prefix tokens
    grid: tuple[int, int]
    rollouts: list[dict[str, Any]]
    figures: list[str]  # each image's rollout figure, when drawn


def _attention_over_images(encoder: VisionEncoder, images: list[Any],
                           processor: ImageProcessor, out_dir: Path, *, draw: bool,
                           progress: bool) -> _Attention:
    """Runs the images one at a time, keeping running sums and each small rollout map."""
    distance_sum = share_sum = None  # (depth, heads) running sums over images, float64
    names, rollouts, written = [], [], []
    grid = None
    items = iter_image_attention(encoder, tqdm(images, desc="analysing", unit="image",
                                               disable=not progress), processor)
    for index, item in enumerate(items):
        distance_sum = item.distance if distance_sum is None else distance_sum + item.distance
        share_sum = item.prefix_share if share_sum is None else share_sum + item.prefix_share
        grid = grid or item.grid
        names.append(item.name)
        entry = {"image": item.name, "grid": list(item.grid), "map": _numbers(item.rollout)}
        if draw:
            entry["figure"] = _draw_rollout(item, index, processor, out_dir)
            written.append(entry["figure"])
        rollouts.append(entry)
    count = len(names)
    return _Attention(names, distance_sum / count, share_sum / count, grid, rollouts, written)


def _tables(encoder: VisionEncoder, filter_count: int
            ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The position table's similarity (None for a tower without one: RoPE) and the patch
    embedding's principal filters with their explained variance (None unless it is one
    convolution over the pixels, `[D, C, P, P]`: not a hybrid's 1x1 over ResNet features or a
    video tower's Conv3d)."""
    config = encoder.config
    similarity = components = explained = None
    with torch.no_grad():
        if getattr(encoder, "pos_embed", None) is not None:
            positions = patch_position_embeddings(encoder.pos_embed, config.grid,
                                                  config.class_token)
            similarity = position_similarity(positions.float().cpu())
        proj = getattr(encoder.patch_embed, "proj", None)
        weight = getattr(proj, "weight", None)
        if weight is not None and weight.ndim == 4 and weight.shape[1] == config.in_channels:
            components, explained = embedding_filters(weight.float().cpu(), filter_count)
    return similarity, components, explained


def _result(encoder: VisionEncoder, attention: _Attention, uniform: float,
            similarity: torch.Tensor | None, components: torch.Tensor | None,
            explained: torch.Tensor | None, written: list[str]) -> dict[str, Any]:
    """What `analysis.json` holds (see `analyze`); the position similarity and the filters
    are null for a tower that has no position table or no RGB patch convolution."""
    config = encoder.config
    return {
        "images": attention.names,
        "encoder": {"image_size": list(config.image_size), "patch_size": config.patch_size,
                    "grid": list(attention.grid), "depth": config.depth, "heads": config.heads,
                    "num_prefix_tokens": encoder.num_prefix_tokens,
                    "class_token": config.class_token},
        "prefix_handling": PREFIX_HANDLING,
        "mean_attention_distance": _numbers(attention.distance),
        "prefix_attention": _numbers(attention.share),
        "uniform_attention_distance": round(uniform, DECIMALS),
        "attention_rollout": {
            "source": "class_token" if config.class_token else "mean_of_patch_rows",
            "identity_weight": IDENTITY_WEIGHT,
            "maps": attention.rollouts,
        },
        "position_similarity": None if similarity is None else {
            "grid": list(config.grid), "matrix": _numbers(similarity)},
        "embedding_filters": None if components is None else {
            "components": _numbers(components), "explained_variance_ratio": _numbers(explained)},
        "figures": written,
    }
