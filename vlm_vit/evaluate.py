"""Frozen-feature evaluation: few-shot least squares, a linear probe and k-NN.

The encoder is never trained here; each metric fits a cheap classifier on its frozen features.

- Few-shot accuracy as Dosovitskiy et al. 2021 (section 4.1, "Metrics") measure it: "a
  regularized least-squares regression problem that maps the (frozen) representation of a
  subset of training images to {-1, 1}^K target vectors", solved in closed form, with
  big_vision's recipe (`evaluators/fewshot_lsr.py`, `configs/common_fewshot.py`): features
  standardised with the training statistics, a constant bias feature of 100 (so the bias is
  almost unregularised), and a fixed l2 of 2^10 rather than a value tuned per dataset.
- A linear probe: scikit-learn's multinomial logistic regression on standardised features.
- k-NN: cosine similarity, the k nearest training images vote with weight exp(sim / T)
  (Caron et al. 2021, DINO, section 4.1 and `eval_knn.py`).

`evaluate_folder` (a class-labelled folder) and `evaluate_shards` (labelled WebDataset tar
shards) encode the images once and hand the features to `evaluate_features`, which splits
them and runs every metric. Both split by each image's key (`key_order`): its path relative to
the folder (`class/name.png`), which is also what `vlm-vit shards` records in a sample's json,
so a folder and its shards give the same split and the same numbers.

Shapes: N images, D the feature width, K classes.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from vlm_vit.files import class_folders
from vlm_vit.model import VisionEncoder
from vlm_vit.processor import ImageProcessor

logger = logging.getLogger(__name__)

#: big_vision's fixed ridge strength for few-shot least squares (`common_fewshot.py`).
DEFAULT_L2 = 2.0**10
#: big_vision's constant bias feature: large, so the ridge penalty barely touches the bias.
BIAS_CONSTANT = 100.0
#: Added to the training standard deviation so constant features do not divide by zero.
STD_EPS = 1e-5
POOLINGS = ("cls", "mean")

Array = np.ndarray | torch.Tensor


# -- input checks --------------------------------------------------------------------------


def _features(x: Any, name: str) -> np.ndarray:
    """A finite `[N, D]` float64 array from a tensor or array, errors naming `name`."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty [N, D] matrix, got shape {list(x.shape)}")
    if not np.issubdtype(x.dtype, np.number) or np.issubdtype(x.dtype, np.complexfloating):
        raise ValueError(f"{name} must hold real numbers, got dtype {x.dtype}")
    x = x.astype(np.float64, copy=False)
    bad = int(np.count_nonzero(~np.isfinite(x)))
    if bad:
        raise ValueError(f"{name} has {bad} non-finite values (NaN or inf)")
    return x


def _labels(y: Any, name: str, count: int) -> np.ndarray:
    """A 1D label array of length `count` (ints, strings: any sortable values)."""
    if isinstance(y, torch.Tensor):
        y = y.detach().cpu().numpy()
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"{name} must be 1D, got shape {list(y.shape)}")
    if len(y) != count:
        raise ValueError(f"{name} has {len(y)} labels for {count} feature rows")
    return y


def _check_inputs(train_x, train_y, test_x, test_y):
    """Checks shapes and labels; returns features, label indices and the sorted classes.

    Returns:
        (train_x [N, D], train_index [N], test_x [M, D], test_index [M], classes [K]), the
        indices being positions in `classes`.
    """
    train_x, test_x = _features(train_x, "train_x"), _features(test_x, "test_x")
    if train_x.shape[1] != test_x.shape[1]:
        raise ValueError(f"train_x has width {train_x.shape[1]} but test_x has width "
                         f"{test_x.shape[1]}")
    train_y = _labels(train_y, "train_y", len(train_x))
    test_y = _labels(test_y, "test_y", len(test_x))
    classes = np.unique(train_y)
    if len(classes) < 2:
        raise ValueError(f"need at least 2 classes in the training labels, got "
                         f"{len(classes)} ({classes.tolist()})")
    unseen = np.setdiff1d(np.unique(test_y), classes)
    if len(unseen):
        raise ValueError(f"test labels {unseen.tolist()} have no training examples (training "
                         f"classes: {classes.tolist()})")
    return (train_x, np.searchsorted(classes, train_y), test_x,
            np.searchsorted(classes, test_y), classes)


def standardize(train_x: np.ndarray, *others: np.ndarray) -> list[np.ndarray]:
    """Centres and scales every feature with the training mean and standard deviation.

    The standard deviation gets `STD_EPS` added (as big_vision does), so a feature that is
    constant on the training set maps to 0 there instead of dividing by zero.

    Args:
        train_x: `[N, D]` training features, which give the statistics.
        *others: further `[M, D]` matrices (the test set) standardised the same way.

    Returns:
        The standardised training matrix followed by the others.
    """
    mean = train_x.mean(axis=0, keepdims=True)
    std = train_x.std(axis=0, keepdims=True) + STD_EPS
    return [(x - mean) / std for x in (train_x, *others)]


# -- few-shot least squares (ViT paper section 4.1, big_vision fewshot_lsr) ----------------


def plus_minus_one_targets(label_index: np.ndarray, num_classes: int) -> np.ndarray:
    """The paper's {-1, 1}^K regression targets: +1 in the label's column, -1 elsewhere.

    Args:
        label_index: `[N]` class indices in `0..num_classes - 1`.
        num_classes: K.

    Returns:
        `[N, K]` float64.
    """
    label_index = np.asarray(label_index)
    if label_index.size and (label_index.min() < 0 or label_index.max() >= num_classes):
        raise ValueError(f"class indices must lie in 0..{num_classes - 1}, got "
                         f"{label_index.min()}..{label_index.max()}")
    targets = -np.ones((len(label_index), num_classes))
    targets[np.arange(len(label_index)), label_index] = 1.0
    return targets


def sample_shots(labels: Array, shots: int, seed: int = 0, *,
                 keys: Sequence[str] | None = None) -> np.ndarray:
    """Picks `shots` random examples of every class, as big_vision does (a seeded
    permutation per class, its first `shots`); with `keys`, the first `shots` of each class
    in `key_order` instead, so the pick depends on the examples' names, not their order.

    Args:
        labels: `[N]` training labels.
        shots: examples to take per class.
        seed: the sampling seed.
        keys: `[N]` a name per example (see `key_order`).

    Returns:
        The sorted row indices, `shots` per class.

    Raises:
        ValueError: when `shots < 1` or a class has fewer than `shots` examples.
    """
    labels = _labels(labels, "labels", len(labels))
    if isinstance(shots, bool) or not isinstance(shots, (int, np.integer)) or shots < 1:
        raise ValueError(f"shots must be a positive int, got {shots!r}")
    shuffle = _class_shuffle(len(labels), seed, keys)
    picked = []
    for label in np.unique(labels):
        rows = np.flatnonzero(labels == label)
        if len(rows) < shots:
            raise ValueError(f"{shots}-shot sampling needs {shots} training examples of every "
                             f"class, but class {label.tolist()!r} has {len(rows)}")
        picked.append(shuffle(rows)[:shots])
    return np.sort(np.concatenate(picked))


def key_order(keys: Sequence[str], seed: int = 0) -> np.ndarray:
    """The rows ordered by a seeded hash of their keys: the order in which, within each
    class, `stratified_split` holds images out and `sample_shots` picks them when given keys.

    A key's hash is the first 8 bytes of BLAKE2b over the UTF-8 text `f"{seed}:{key}"`, read
    as a big-endian integer; equal hashes fall back to the keys' text, and equal keys to
    their rows. The order is thus a function of the keys and the seed alone, not of the
    order the images were read in.

    Args:
        keys: `[N]` a name per row; `evaluate_folder` and `evaluate_shards` use the image's
            path relative to the folder (`class/name.png`; the `path` that `vlm-vit shards`
            records in a sample's json), else a shard sample's `__key__`.
        seed: the hash's seed.

    Returns:
        `[N]` row indices, first to last.
    """
    def rank(row: int) -> tuple[int, str]:
        text = f"{seed}:{keys[row]}".encode("utf-8", "surrogateescape")
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big"), keys[row]

    return np.array(sorted(range(len(keys)), key=rank), dtype=np.int64)


def _class_shuffle(count: int, seed: int, keys: Sequence[str] | None):
    """A function that puts a class's rows in their sampling order: a seeded permutation
    (one generator over the classes in turn), or `key_order` with `keys`."""
    if keys is None:
        rng = np.random.default_rng(seed)
        return rng.permutation
    keys = [str(key) for key in keys]
    if len(keys) != count:
        raise ValueError(f"got {len(keys)} keys for {count} labels")
    position = np.empty(count, dtype=np.int64)
    position[key_order(keys, seed)] = np.arange(count)
    return lambda rows: rows[np.argsort(position[rows], kind="stable")]


class LeastSquaresClassifier:
    """A closed-form ridge regression onto {-1, 1}^K targets; predicts the argmax column.

    Fit with `fit_least_squares`.

    Attributes:
        weights: `[D + 1, K]`, the last row for the constant bias feature.
        mean, std: `[1, D]` training statistics used to standardise inputs.
        classes: `[K]` the label of each column.
    """

    def __init__(self, weights: np.ndarray, mean: np.ndarray, std: np.ndarray,
                 classes: np.ndarray) -> None:
        self.weights, self.mean, self.std, self.classes = weights, mean, std, classes

    def scores(self, x: Array) -> np.ndarray:
        """The regression outputs `[M, K]` for `[M, D]` features."""
        x = _features(x, "x")
        if x.shape[1] != self.mean.shape[1]:
            raise ValueError(f"x has width {x.shape[1]}, the classifier was fit on width "
                             f"{self.mean.shape[1]}")
        return _with_bias((x - self.mean) / self.std) @ self.weights

    def predict(self, x: Array) -> np.ndarray:
        """The predicted labels `[M]`."""
        return self.classes[self.scores(x).argmax(axis=1)]


def _with_bias(x: np.ndarray) -> np.ndarray:
    """Appends the constant bias feature: `[N, D]` to `[N, D + 1]`."""
    return np.pad(x, ((0, 0), (0, 1)), constant_values=BIAS_CONSTANT)


def fit_least_squares(train_x: Array, train_y: Array, *,
                      l2: float = DEFAULT_L2) -> LeastSquaresClassifier:
    """Solves the paper's regularised least squares in closed form (float64).

    With X the standardised features plus the bias column and Y the {-1, 1} targets,
    W = (X^T X + l2 I)^-1 X^T Y, computed as X^T (X X^T + l2 I)^-1 Y when there are fewer
    examples than features (the usual few-shot case: the same W, a smaller system).

    Args:
        train_x: `[N, D]` features.
        train_y: `[N]` labels, at least 2 classes.
        l2: the ridge strength, > 0.

    Returns:
        The fitted classifier.
    """
    train_x = _features(train_x, "train_x")
    train_y = _labels(train_y, "train_y", len(train_x))
    if not (math.isfinite(float(l2)) and l2 > 0):
        raise ValueError(f"l2 must be a finite number > 0, got {l2!r}")
    classes = np.unique(train_y)
    if len(classes) < 2:
        raise ValueError(f"need at least 2 classes in train_y, got {classes.tolist()}")
    mean = train_x.mean(axis=0, keepdims=True)
    std = train_x.std(axis=0, keepdims=True) + STD_EPS
    x = _with_bias((train_x - mean) / std)  # (N, D + 1)
    targets = plus_minus_one_targets(np.searchsorted(classes, train_y), len(classes))  # (N, K)
    count, dim = x.shape
    if count >= dim:
        weights = np.linalg.solve(x.T @ x + l2 * np.eye(dim), x.T @ targets)
    else:
        weights = x.T @ np.linalg.solve(x @ x.T + l2 * np.eye(count), targets)
    return LeastSquaresClassifier(weights, mean, std, classes)


def few_shot_accuracy(train_x: Array, train_y: Array, test_x: Array, test_y: Array, *,
                      shots: int | None = None, l2: float = DEFAULT_L2,
                      seed: int = 0, train_keys: Sequence[str] | None = None) -> float:
    """Few-shot accuracy by regularised least squares (ViT paper section 4.1).

    Args:
        train_x, train_y: `[N, D]` training features and their `[N]` labels.
        test_x, test_y: `[M, D]` test features and labels; every test label must occur in
            the training labels.
        shots: examples per class drawn from the training set (`sample_shots`); None uses
            them all.
        l2: the ridge strength; big_vision's fixed 2^10 by default (it is not tuned per
            dataset, so few-shot numbers stay comparable across datasets and runs).
        seed: the seed of the shot sampling.
        train_keys: `[N]` a name per training image: the shots are then picked by
            `key_order` (see `sample_shots`).

    Returns:
        The fraction of test images whose argmax regression output is their class.

    Raises:
        ValueError: for mismatched shapes, fewer than 2 classes, test classes without
            training examples, or a class with fewer than `shots` examples.
    """
    train_x, train_index, test_x, test_index, classes = _check_inputs(train_x, train_y,
                                                                      test_x, test_y)
    if shots is not None:
        # errors name the label
        rows = sample_shots(classes[train_index], shots, seed, keys=train_keys)
        train_x, train_index = train_x[rows], train_index[rows]
    classifier = fit_least_squares(train_x, train_index, l2=l2)
    return float(np.mean(classifier.predict(test_x) == test_index))


# -- linear probe and k-NN ------------------------------------------------------------------


def linear_probe_accuracy(train_x: Array, train_y: Array, test_x: Array, test_y: Array, *,
                          C: float = 1.0, max_iter: int = 1000) -> float:
    """Accuracy of a logistic-regression probe on standardised frozen features.

    Args:
        train_x, train_y, test_x, test_y: as in `few_shot_accuracy`.
        C: scikit-learn's inverse L2 strength.
        max_iter: L-BFGS iterations; not converging is logged as a warning.

    Returns:
        The test accuracy.

    Raises:
        ImportError: without scikit-learn (the `train` extra).
        ValueError: as `few_shot_accuracy`, or for C <= 0 or max_iter < 1.
    """
    train_x, train_index, test_x, test_index, _ = _check_inputs(train_x, train_y, test_x,
                                                                test_y)
    if not C > 0:
        raise ValueError(f"C must be > 0, got {C!r}")
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter!r}")
    from vlm_vit.optional import require

    linear_model = require("sklearn.linear_model", "train", "the linear probe")
    exceptions = require("sklearn.exceptions", "train", "the linear probe")
    train_x, test_x = standardize(train_x, test_x)
    probe = linear_model.LogisticRegression(C=C, max_iter=max_iter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", exceptions.ConvergenceWarning)
        probe.fit(train_x, train_index)
    if any(issubclass(w.category, exceptions.ConvergenceWarning) for w in caught):
        logger.warning("the linear probe did not converge in %d iterations; its accuracy may "
                       "be low (raise max_iter)", max_iter)
    return float(np.mean(probe.predict(test_x) == test_index))


def knn_accuracy(train_x: Array, train_y: Array, test_x: Array, test_y: Array, *,
                 k: int = 20, temperature: float = 0.07, chunk_size: int = 1024) -> float:
    """Weighted k-NN accuracy on cosine similarity (the DINO protocol).

    Each test image's k most similar training images vote for their class with weight
    exp(similarity / temperature); the class with the largest total wins.

    Args:
        train_x, train_y, test_x, test_y: as in `few_shot_accuracy`.
        k: neighbours; capped at the number of training images (logged).
        temperature: the vote temperature (DINO: 0.07).
        chunk_size: test images compared at once (bounds memory at chunk_size x N).

    Returns:
        The test accuracy.

    Raises:
        ValueError: as `few_shot_accuracy`, or for k < 1, temperature <= 0 or
            chunk_size < 1.
    """
    train_x, train_index, test_x, test_index, classes = _check_inputs(train_x, train_y,
                                                                      test_x, test_y)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    if k > len(train_x):
        logger.info("k=%d is more than the %d training images; using k=%d", k, len(train_x),
                    len(train_x))
        k = len(train_x)
    train = torch.nn.functional.normalize(torch.from_numpy(train_x).float(), dim=1)  # (N, D)
    test = torch.nn.functional.normalize(torch.from_numpy(test_x).float(), dim=1)  # (M, D)
    train_labels = torch.from_numpy(train_index)
    correct = 0
    for start in range(0, len(test), chunk_size):
        similarity = test[start:start + chunk_size] @ train.T  # (m, N)
        top, rows = similarity.topk(k, dim=1)  # (m, k)
        # exp((s - max) / T): the same argmax as exp(s / T) without overflow.
        weights = ((top - top[:, :1]) / temperature).exp()
        votes = torch.zeros(len(top), len(classes))  # (m, K)
        votes.scatter_add_(1, train_labels[rows], weights)
        predicted = votes.argmax(dim=1).numpy()
        correct += int(np.sum(predicted == test_index[start:start + chunk_size]))
    return correct / len(test)


# -- features from an encoder ---------------------------------------------------------------


def _batches(images, batch_size: int, processor: ImageProcessor):
    """Yields (pixels, labels or None) and says how many batches there will be."""
    if isinstance(images, (list, tuple, np.ndarray, torch.Tensor)):
        if isinstance(images, torch.Tensor) and images.ndim != 4:
            raise ValueError(f"a tensor of images must be [B, C, H, W], got shape "
                             f"{list(images.shape)}")
        if len(images) == 0:
            raise ValueError("got no images to encode")
        total = -(-len(images) // batch_size)

        def generate():
            for start in range(0, len(images), batch_size):
                chunk = images[start:start + batch_size]
                yield processor(chunk if isinstance(chunk, torch.Tensor) else list(chunk)), None
        return generate(), total

    def unpack():
        for index, batch in enumerate(images):
            if isinstance(batch, torch.Tensor):
                yield batch, None
            elif isinstance(batch, dict) and "pixel_values" in batch:
                yield batch["pixel_values"], batch.get("labels", batch.get("label"))
            elif isinstance(batch, (list, tuple)) and len(batch) == 2:
                yield batch[0], batch[1]
            else:
                raise ValueError(f"batch {index} from the loader is a {type(batch).__name__}; "
                                 "expected pixel values [B, C, H, W], (pixels, labels) or a "
                                 "dict with 'pixel_values' and 'labels'")
    return unpack(), len(images) if hasattr(images, "__len__") else None


def _default_processor(encoder: VisionEncoder) -> ImageProcessor:
    """ImageNet normalisation at the encoder's image size, for callers that give none."""
    size = encoder.config.image_size
    logger.info("no processor given: imagenet normalisation at %dx%d", *size)
    return ImageProcessor.for_family("imagenet", size=size)


def extract_features(
    encoder: VisionEncoder,
    images_or_loader: Sequence | torch.Tensor | Iterable,
    *,
    pooling: str = "cls",
    batch_size: int = 32,
    processor: ImageProcessor | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Encodes images under `torch.inference_mode()` and pools one vector per image.

    Args:
        encoder: the frozen encoder; it runs in eval mode (its mode is restored after).
        images_or_loader: either images (a list of anything `ImageProcessor` takes: paths,
            PIL images, arrays, tensors; or a `[B, C, H, W]` tensor of raw images in [0, 1]),
            preprocessed `batch_size` at a time; or any other iterable of already
            preprocessed batches (a `DataLoader`): each a pixel tensor `[B, C, H, W]`, a
            `(pixels, labels)` pair, or a dict with `pixel_values` and `labels`.
        pooling: "cls", the class token after the final norm (the paper's representation,
            eq. 4); or "mean", the mean of the final patch tokens (prefix tokens excluded).
            A model without a class token raises for "cls" rather than quietly measuring
            a different representation: ask for "mean".
        batch_size: images per forward pass (images only; a loader batches itself).
        processor: preprocessing for images; default imagenet normalisation at the
            encoder's image size.
        device: where to run; default the encoder's device. The encoder is moved there.
        progress: show a progress bar.

    Returns:
        `[N, D]` float32 CPU features, and the `[N]` labels the loader gave (None for
        images or label-less batches).

    Raises:
        ValueError: for an unknown pooling, "cls" on a model without a class token, a batch
            size below 1, no images, or a loader batch of an unknown shape.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    if pooling == "cls" and not encoder.config.class_token:
        raise ValueError("pooling 'cls' needs a class token, and this encoder has none "
                         "(class_token=False); use pooling='mean'")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if isinstance(images_or_loader, (str, os.PathLike)):
        raise ValueError(f"got the single path {str(images_or_loader)!r}; pass a list of "
                         "images (or use evaluate_folder for a class-labelled folder)")
    from vlm_vit.poolers import build_pooler

    pooler = build_pooler(pooling, in_dim=encoder.config.width)
    processor = processor or _default_processor(encoder)
    parameter = next(encoder.parameters())
    device = torch.device(device) if device is not None else parameter.device
    encoder.to(device)
    was_training = encoder.training
    encoder.eval()
    batches, total = _batches(images_or_loader, batch_size, processor)
    features, labels, unlabelled = [], [], 0
    try:
        with torch.inference_mode():
            for pixels, batch_labels in tqdm(batches, total=total, desc="extracting features",
                                             unit="batch", disable=not progress):
                out = encoder(pixels.to(device=device, dtype=parameter.dtype))
                pooled = pooler(out.tokens, num_prefix_tokens=out.num_prefix_tokens,
                                grid=out.grid)  # (B, D)
                features.append(pooled.float().cpu())
                if batch_labels is None:
                    unlabelled += 1
                else:
                    labels.append(torch.as_tensor(batch_labels).reshape(-1).cpu())
    finally:
        encoder.train(was_training)
    if not features:
        raise ValueError("the loader gave no batches")
    if labels and unlabelled:
        raise ValueError(f"{unlabelled} of {len(features)} loader batches had no labels")
    features = torch.cat(features)
    labels = torch.cat(labels) if labels else None
    if labels is not None and len(labels) != len(features):
        raise ValueError(f"the loader gave {len(labels)} labels for {len(features)} images")
    return features, labels


# -- a class-labelled folder ----------------------------------------------------------------


def read_class_folder(root: str | Path) -> tuple[list[Path], np.ndarray, list[str]]:
    """The images of a class-labelled folder (`vlm_vit.files.class_folders`), with the labels
    as an `[N]` array."""
    files, labels, classes = class_folders(root)
    return files, np.asarray(labels), classes


def stratified_split(labels: Array, test_fraction: float, seed: int = 0, *,
                     keys: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A seeded split keeping each class's share: round(n * test_fraction) of its n images
    to test, at least 1 and at most n - 1, so every class is in both parts. Which ones: the
    first of a seeded permutation of each class; with `keys`, the first of each class in
    `key_order(keys, seed)`, so the split is a function of the images' names.

    Returns:
        The sorted train and test row indices.

    Raises:
        ValueError: for a fraction outside (0, 1) or a class with fewer than 2 images.
    """
    labels = _labels(labels, "labels", len(labels))
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction}")
    shuffle = _class_shuffle(len(labels), seed, keys)
    train, test = [], []
    for label in np.unique(labels):
        rows = shuffle(np.flatnonzero(labels == label))
        if len(rows) < 2:
            raise ValueError(f"class {label.tolist()!r} has {len(rows)} image; each class needs at "
                             "least 2 (one to train on, one to test)")
        count = min(max(round(len(rows) * test_fraction), 1), len(rows) - 1)
        test.append(rows[:count])
        train.append(rows[count:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _resolve_pooling(encoder: VisionEncoder, pooling: str | None) -> str:
    """The pooling asked for, or "cls" when the encoder has a class token and "mean" otherwise
    (logged)."""
    if pooling is None:
        pooling = "cls" if encoder.config.class_token else "mean"
        logger.info("pooling: %s", pooling)
    elif pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    return pooling


def _checked_shots(shots: Sequence[int]) -> list[int]:
    shots = list(shots)
    for count in shots:
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
            raise ValueError(f"shots must be positive ints, got {shots}")
    return shots


def split_for_shots(labels: np.ndarray, class_names: Sequence[str], shots: Sequence[int],
                    test_fraction: float, seed: int, keys: Sequence[str] | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """`stratified_split`, refusing shots that the smallest class's training part cannot give.

    Args:
        labels: `[N]` class indices into `class_names`.
        class_names: the name of each class index (for the error).
        shots, test_fraction, seed, keys: as in `evaluate_features`.

    Returns:
        The sorted train and test row indices.

    Raises:
        ValueError: as `stratified_split`, or when max(shots) is more than a class has.
    """
    train, test = stratified_split(labels, test_fraction, seed, keys=keys)
    present, counts = np.unique(labels[train], return_counts=True)
    if shots and max(shots) > counts.min():
        name = class_names[int(present[np.argmin(counts)])]
        raise ValueError(f"{max(shots)}-shot needs {max(shots)} training images per class, but "
                         f"class {name!r} has {counts.min()} after the split (test_fraction "
                         f"{test_fraction}); ask for fewer shots")
    return train, test


def evaluate_features(
    features: np.ndarray,
    labels: np.ndarray,
    class_names: Sequence[str],
    *,
    shots: Sequence[int] = (1, 5, 10),
    test_fraction: float = 0.5,
    seed: int = 0,
    l2: float = DEFAULT_L2,
    C: float = 1.0,
    k: int = 20,
    temperature: float = 0.07,
    keys: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Every metric on encoded images: a stratified split (`split_for_shots`), few-shot once
    per entry of `shots` (seeded by `seed`), and the linear probe and k-NN on the whole
    training part.

    With `keys`, the rows are first put in the keys' sorted order, and the split and the
    shots follow `key_order`: the same named images give the same numbers in whatever order
    they come.

    Args:
        features: `[N, D]` one vector per image.
        labels: `[N]` class indices into `class_names`.
        class_names: the name of each class index; only the classes that have images are
            reported (and count towards chance).
        shots: examples per class for few-shot accuracy; each must fit the smallest class's
            training part.
        test_fraction: each class's share held out for testing.
        seed: the split and shot-sampling seed.
        l2: few-shot ridge strength. C: the linear probe's. k, temperature: the k-NN's.
        keys: `[N]` a name per image (see `key_order`); None: a seeded permutation of the
            rows splits them.

    Returns:
        A JSON-able dict: `classes`, `num_train`, `num_test`, `feature_dim`, `seed`,
        `test_fraction`, `chance`, `few_shot` (accuracy per shots, keyed by the shots as a
        string), `l2`, `linear_probe`, `linear_probe_C`, `knn`, `knn_k` (after capping),
        `knn_temperature`. Accuracies are fractions in [0, 1].
    """
    shots = _checked_shots(shots)
    features, labels = np.asarray(features), np.asarray(labels)
    train_keys = None
    if keys is not None:
        keys = np.asarray([str(key) for key in keys])
        if len(keys) != len(labels):
            raise ValueError(f"got {len(keys)} keys for {len(labels)} images")
        order = np.argsort(keys, kind="stable")  # the rows in one order, however read
        features, labels, keys = features[order], labels[order], keys[order]
        repeated = len(keys) - len(np.unique(keys))
        if repeated:
            logger.warning("%d images share a key with another (e.g. %r); their split depends "
                           "on the order they are read in", repeated,
                           str(keys[np.flatnonzero(keys[1:] == keys[:-1])[0]]))
    train, test = split_for_shots(labels, class_names, shots, test_fraction, seed,
                                  None if keys is None else keys.tolist())
    if keys is not None:
        train_keys = keys[train].tolist()
    present = np.unique(labels)
    split = (features[train], labels[train], features[test], labels[test])
    few_shot = {str(count): few_shot_accuracy(*split, shots=count, l2=l2, seed=seed,
                                              train_keys=train_keys)
                for count in shots}
    return {
        "classes": [class_names[int(index)] for index in present],
        "num_train": len(train),
        "num_test": len(test),
        "feature_dim": int(features.shape[1]),
        "seed": seed,
        "test_fraction": test_fraction,
        "chance": 1 / len(present),
        "few_shot": few_shot,
        "l2": l2,
        "linear_probe": linear_probe_accuracy(*split, C=C),
        "linear_probe_C": C,
        "knn": knn_accuracy(*split, k=k, temperature=temperature),
        "knn_k": min(k, len(train)),
        "knn_temperature": temperature,
    }


def evaluate_folder(
    encoder: VisionEncoder,
    root: str | Path,
    *,
    processor: ImageProcessor | None = None,
    shots: Sequence[int] = (1, 5, 10),
    test_fraction: float = 0.5,
    seed: int = 0,
    pooling: str | None = None,
    batch_size: int = 32,
    device: str | torch.device | None = None,
    l2: float = DEFAULT_L2,
    C: float = 1.0,
    k: int = 20,
    temperature: float = 0.07,
    progress: bool = True,
) -> dict[str, Any]:
    """Every metric on a class-labelled folder, split into train and test.

    The folder is read by `read_class_folder`; the split and the shots are checked before
    anything is encoded; every image is encoded once and `evaluate_features` does the rest,
    each image's key being its path relative to `root` (`class/name.png`, see `key_order`).

    Args:
        encoder: the frozen encoder.
        root: one sub-folder per class.
        processor: as in `extract_features`.
        shots, test_fraction, seed, l2, C, k, temperature: as in `evaluate_features`.
        pooling: "cls" or "mean"; None picks "cls" when the encoder has a class token and
            "mean" otherwise (logged, and recorded in the result).
        batch_size, device, progress: as in `extract_features`.

    Returns:
        `data` and `pooling`, then what `evaluate_features` returns.
    """
    pooling = _resolve_pooling(encoder, pooling)
    shots = _checked_shots(shots)
    files, labels, classes = read_class_folder(root)
    keys = [path.relative_to(root).as_posix() for path in files]
    split_for_shots(labels, classes, shots, test_fraction, seed, keys)  # fails before encoding
    features, _ = extract_features(encoder, files, pooling=pooling, batch_size=batch_size,
                                   processor=processor, device=device, progress=progress)
    return {"data": str(root), "pooling": pooling, **evaluate_features(
        features.numpy(), labels, classes, shots=shots, test_fraction=test_fraction,
        seed=seed, l2=l2, C=C, k=k, temperature=temperature, keys=keys)}


# -- labelled tar shards --------------------------------------------------------------------


def evaluate_shards(
    encoder: VisionEncoder,
    shards: str | Path | Sequence[str | Path],
    *,
    processor: ImageProcessor | None = None,
    label_field: str | None = None,
    shots: Sequence[int] = (1, 5, 10),
    test_fraction: float = 0.5,
    seed: int = 0,
    pooling: str | None = None,
    batch_size: int = 32,
    device: str | torch.device | None = None,
    l2: float = DEFAULT_L2,
    C: float = 1.0,
    k: int = 20,
    temperature: float = 0.07,
    progress: bool = True,
) -> dict[str, Any]:
    """Every metric on labelled WebDataset tar shards, read once in order.

    Each sample's image goes through `processor` and its label is its `cls` field, or
    `label_field` of its `json` field (`LabelledDecode`). The class names are those of the
    `dataset.json` beside the shards (`vlm-vit shards --classes` writes it), else "0".."K-1"
    for the largest label K-1 seen. A sample's key (`key_order`) is the `path` its json
    records (`vlm-vit shards` writes the image's path relative to its folder there, so shards
    split as the folder they were written from), else its `__key__`. Samples without an
    image, and those whose image or label cannot be read (a label with no name in
    `dataset.json` included), are skipped, named in a warning and counted; a truncated
    shard gives what it holds before the cut (`read_shard` warns).

    Args:
        encoder: the frozen encoder.
        shards: a shard spec (see `vlm_vit.train.tar_shards.expand_shards`).
        processor: as in `extract_features`.
        label_field: None for the `cls` field, else a field of each sample's `json`.
        shots, test_fraction, seed, l2, C, k, temperature: as in `evaluate_features`.
        pooling, batch_size, device, progress: as in `evaluate_folder`.

    Returns:
        `data` and `pooling`, what `evaluate_features` returns, then `shards` (how many) and
        `skipped`: counts {"no_image", "undecodable" (image or label), "truncated_shards"}.

    Raises:
        FileNotFoundError, ValueError: from `expand_shards`; when no sample has a decodable
            image and label (naming the first problem); or as `evaluate_features`.
    """
    from vlm_vit.train.tar_shards import (
        LabelledBatches,
        LabelledDecode,
        expand_shards,
        read_dataset_index,
    )

    pooling = _resolve_pooling(encoder, pooling)
    shots = _checked_shots(shots)
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    urls = expand_shards(shards)
    index = read_dataset_index(urls)
    names = index.get("classes") if index else None
    decode = _KeyedDecode(LabelledDecode(processor or _default_processor(encoder), label_field,
                                         num_classes=len(names) if names else None))
    stream = LabelledBatches(urls, decode, batch_size)
    batches = iter(stream)
    first = next(batches, None)  # a clear error for shards without one usable sample
    if first is None:
        first_problem = "".join(f"; first: {text}" for text in stream.described(1))
        raise ValueError(f"no sample of the {len(urls)} shards of {shards} has a decodable "
                         f"image and label ({len(stream.no_image)} without an image, "
                         f"{len(stream.undecodable)} undecodable{first_problem})")
    features, labels = extract_features(encoder, itertools.chain([first], batches),
                                        pooling=pooling, device=device, progress=progress)
    skipped = stream.skipped()
    labels = labels.numpy()
    if not names:
        names = [str(label) for label in range(int(labels.max()) + 1)]
    data = (str(shards) if isinstance(shards, (str, os.PathLike))
            else [str(shard) for shard in shards])
    return {"data": data, "pooling": pooling, **evaluate_features(
        features.numpy(), labels, [str(name) for name in names], shots=shots,
        test_fraction=test_fraction, seed=seed, l2=l2, C=C, k=k, temperature=temperature,
        keys=decode.keys), "shards": len(urls), "skipped": skipped}


def sample_key(sample: Any) -> str:
    """A shard sample's key for the split (`key_order`): the `path` its json records (the
    image's path relative to the folder `vlm-vit shards` read), else its `__key__`."""
    try:
        record = sample.json()
    except ValueError:  # a json field that is not JSON: the label check reports it
        record = None
    path = record.get("path") if isinstance(record, dict) else None
    return path if isinstance(path, str) and path else sample.key


class _KeyedDecode:
    """A `LabelledDecode` that also records, in order, the key of each sample it decodes
    into an image and a label (the rows `LabelledBatches` yields)."""

    def __init__(self, decode: Any) -> None:
        self.decode = decode
        self.keys: list[str] = []

    def __call__(self, sample: Any) -> Any:
        from vlm_vit.train.data import UndecodableImage

        item = self.decode(sample)
        if item is not None and not isinstance(item, UndecodableImage):
            self.keys.append(sample_key(sample))
        return item
