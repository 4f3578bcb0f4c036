"""The analysis figures as PNG files. Only drawing happens here; the numbers come from
`attention`, `position` and `filters`.

matplotlib is imported inside the functions (it is in the `train` extra), and figures are
built with `matplotlib.figure.Figure`, not pyplot, so no global backend or state is touched.
Every figure has a fixed size in inches at `DPI`, so a PNG's pixel size is known in advance:
see `FIGURE_SIZES`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vlm_vit.io.files import atomic_write
from vlm_vit.optional import require

DPI = 100
#: (width, height) in inches per figure; the PNG is DPI times that in pixels.
FIGURE_SIZES = {
    "mean_attention_distance": (6.0, 4.5),  # 600 x 450
    "attention_rollout": (6.0, 3.0),  # 600 x 300: input and overlay side by side
    "position_similarity": (7.0, 6.0),  # 700 x 600: the mosaic and its colour bar
    "embedding_filters": (7.0, 4.5),  # 700 x 450: 4 rows of 7 as in the paper
}


def _figure(name: str):
    figure_module = require("matplotlib.figure", "train", "vlm-vit's analysis figures")
    return figure_module.Figure(figsize=FIGURE_SIZES[name], dpi=DPI)


def _save(figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, "wb") as handle:
        figure.savefig(handle, format="png", dpi=DPI)
    return path


def min_max(values: np.ndarray) -> np.ndarray:
    """Scales to [0, 1] for display; a constant array becomes zeros."""
    values = np.asarray(values, dtype=np.float64)
    low, high = values.min(), values.max()
    return (values - low) / (high - low) if high > low else np.zeros_like(values)


def tile(images: np.ndarray, columns: int, gap: int = 1, fill: float = np.nan) -> np.ndarray:
    """Lays out small images in a mosaic, `gap` pixels of `fill` between them.

    Args:
        images: `[k, h, w]` or `[k, h, w, 3]`.
        columns: images per mosaic row.

    Returns:
        `[rows * (h + gap) - gap, columns * (w + gap) - gap (, 3)]`, rows = ceil(k / columns).
    """
    count, height, width = images.shape[:3]
    rows = -(-count // columns)
    shape = (rows * (height + gap) - gap, columns * (width + gap) - gap, *images.shape[3:])
    mosaic = np.full(shape, fill, dtype=np.float64)
    for index, image in enumerate(images):
        top, left = (index // columns) * (height + gap), (index % columns) * (width + gap)
        mosaic[top:top + height, left:left + width] = image
    return mosaic


def plot_mean_attention_distance(distances: np.ndarray, path: Path,
                                 uniform: float | None = None) -> Path:
    """The paper's Figure 7 (right): one dot per head, layers along x.

    Args:
        distances: `[depth, heads]` in pixels.
        path: the PNG to write.
        uniform: the distance under uniform attention, drawn as a dashed line for scale.
    """
    distances = np.asarray(distances)
    depth, heads = distances.shape
    figure = _figure("mean_attention_distance")
    axes = figure.add_subplot()
    layers = np.repeat(np.arange(1, depth + 1), heads)
    colours = np.tile(np.arange(heads), depth)  # one colour per head, as the paper
    axes.scatter(layers, distances.reshape(-1), c=colours, cmap="viridis", s=18,
                 vmin=0, vmax=max(heads - 1, 1))
    top = float(distances.max())
    if uniform is not None:
        axes.axhline(uniform, color="grey", linestyle="--", linewidth=1,
                     label="uniform attention")
        axes.legend(loc="lower right", fontsize=8)
        top = max(top, uniform)
    axes.set_xlabel("network depth (layer)")
    axes.set_ylabel("mean attention distance (pixels)")
    axes.set_title(f"mean attention distance, {heads} heads per layer")
    axes.set_xticks(range(1, depth + 1))
    axes.set_xlim(0.5, depth + 0.5)
    axes.set_ylim(0, 1.1 * top if top > 0 else 1.0)
    figure.tight_layout()
    return _save(figure, path)


def plot_attention_rollout(image: np.ndarray, heatmap: np.ndarray, path: Path,
                           title: str = "") -> Path:
    """An input image beside the same image with its rollout map overlaid.

    Args:
        image: `[H, W, 3]` in [0, 1], as the encoder saw it.
        heatmap: `[H, W]`, the rollout map upsampled to the image (any scale: min-max
            normalised here).
        path: the PNG to write.
        title: shown above the figure, e.g. the file name.
    """
    figure = _figure("attention_rollout")
    left, right = figure.subplots(1, 2)
    left.imshow(np.clip(image, 0, 1))
    left.set_title("input")
    right.imshow(np.clip(image, 0, 1))
    right.imshow(min_max(heatmap), cmap="jet", alpha=0.5, vmin=0, vmax=1)
    right.set_title("attention rollout")
    for axes in (left, right):
        axes.set_axis_off()
    if title:
        figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    return _save(figure, path)


def plot_position_similarity(similarity: np.ndarray, grid: tuple[int, int], path: Path) -> Path:
    """The paper's Figure 7 (centre): for each patch, a small grid of its position
    embedding's cosine similarity with every patch, laid out at the patch's place.

    Args:
        similarity: `[N, N]` with N = rows * cols.
        grid: (rows, cols).
        path: the PNG to write.
    """
    rows, cols = grid
    small = np.asarray(similarity).reshape(rows * cols, rows, cols)
    mosaic = tile(small, columns=cols)  # gaps are NaN, drawn blank
    figure = _figure("position_similarity")
    axes = figure.add_subplot()
    shown = axes.imshow(mosaic, cmap="viridis", vmin=-1, vmax=1, interpolation="nearest")
    axes.set_xticks([c * (cols + 1) + (cols - 1) / 2 for c in range(cols)],
                    labels=[str(c + 1) for c in range(cols)], fontsize=6)
    axes.set_yticks([r * (rows + 1) + (rows - 1) / 2 for r in range(rows)],
                    labels=[str(r + 1) for r in range(rows)], fontsize=6)
    axes.tick_params(length=0)
    axes.set_xlabel("input patch column")
    axes.set_ylabel("input patch row")
    axes.set_title("position embedding similarity")
    figure.colorbar(shown, ax=axes, label="cosine similarity", shrink=0.8)
    figure.tight_layout()
    return _save(figure, path)


def plot_embedding_filters(components: np.ndarray, path: Path, columns: int = 7) -> Path:
    """The paper's Figure 7 (left): principal components of the patch embedding as pictures.

    Args:
        components: `[k, C, P, P]`; three channels are drawn as RGB, any other number as
            the grey of their mean. Each component is min-max normalised on its own.
        path: the PNG to write.
        columns: pictures per row (7: the paper's 4 x 7 for 28 components).
    """
    components = np.asarray(components)
    if components.shape[1] == 3:
        pictures = np.stack([min_max(c).transpose(1, 2, 0) for c in components])  # (k, P, P, 3)
    else:
        grey = np.stack([min_max(c.mean(0)) for c in components])  # (k, P, P)
        pictures = np.repeat(grey[..., None], 3, axis=-1)
    mosaic = tile(pictures, columns=min(columns, len(pictures)), fill=1.0)  # white gaps
    figure = _figure("embedding_filters")
    axes = figure.add_subplot()
    axes.imshow(mosaic, interpolation="nearest")
    axes.set_axis_off()
    axes.set_title(f"RGB embedding filters (first {len(components)} principal components)")
    figure.tight_layout()
    return _save(figure, path)
