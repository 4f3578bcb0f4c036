"""Classifiers fit on frozen features: few-shot least squares, a linear probe and k-NN, and
the seeded ways of picking examples (shots, splits) they and the protocol share.

- Few-shot accuracy as Dosovitskiy et al. 2021 (section 4.1, "Metrics") measure it: "a
  regularized least-squares regression problem that maps the (frozen) representation of a
  subset of training images to {-1, 1}^K target vectors", solved in closed form, with
  big_vision's recipe (`evaluators/fewshot_lsr.py`, `configs/common_fewshot.py`): features
  standardised with the training statistics, a constant bias feature of 100 (so the bias is
  almost unregularised), and a fixed l2 of 2^10 rather than a value tuned per dataset.
- A linear probe: scikit-learn's multinomial logistic regression on standardised features.
- k-NN: cosine similarity, the k nearest training images vote with weight exp(sim / T)
  (Caron et al. 2021, DINO, section 4.1 and `eval_knn.py`).

Shapes: N images, D the feature width, K classes.
"""

from __future__ import annotations

import hashlib
import logging
import math
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: big_vision's fixed ridge strength for few-shot least squares (`common_fewshot.py`).
DEFAULT_L2 = 2.0**10
#: big_vision's constant bias feature: large, so the ridge penalty barely touches the bias.
BIAS_CONSTANT = 100.0
#: Added to the training standard deviation so constant features do not divide by zero.
STD_EPS = 1e-5

# Features and labels come as numpy arrays or torch tensors; this module never imports torch
# (a tensor is read through its own `.numpy()`).
Array: TypeAlias = "np.ndarray | torch.Tensor"


# -- input checks --------------------------------------------------------------------------


def _features(x: Any, name: str) -> np.ndarray:
    """A finite `[N, D]` float64 array from a tensor or array, errors naming `name`."""
    if _is_tensor(x):
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


def _is_tensor(x: Any) -> bool:
    """Whether `x` is a torch tensor, asked without importing torch (a tensor's module is
    loaded whenever one exists)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _labels(y: Any, name: str, count: int) -> np.ndarray:
    """A 1D label array of length `count` (ints, strings: any sortable values)."""
    if _is_tensor(y):
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
    exp(similarity / temperature); the class with the largest total wins. Of training
    images equally similar at the k-th place, the earlier rows are taken. Computed in float32
    with numpy, as DINO's in torch.

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
    train, test = _unit_rows(train_x), _unit_rows(test_x)  # (N, D), (M, D) float32
    correct = 0
    for start in range(0, len(test), chunk_size):
        similarity = test[start:start + chunk_size] @ train.T  # (m, N)
        top, rows = _top_k(similarity, k)  # (m, k), most similar first
        # exp((s - max) / T): the same argmax as exp(s / T) without overflow.
        weights = np.exp((top - top[:, :1]) / np.float32(temperature))
        votes = np.zeros((len(top), len(classes)), dtype=np.float32)  # (m, K)
        for column in range(k):  # in rank order, so the sums add up as they always have
            np.add.at(votes, (np.arange(len(top)), train_index[rows[:, column]]),
                      weights[:, column])
        predicted = votes.argmax(axis=1)
        correct += int(np.sum(predicted == test_index[start:start + chunk_size]))
    return correct / len(test)


def _unit_rows(x: np.ndarray) -> np.ndarray:
    """`[N, D]` rows scaled to unit length, in float32 (an all-zero row stays zero)."""
    x = x.astype(np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), np.float32(1e-12))


def _top_k(similarity: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest entries of each row of `[m, N]` and their columns, largest first (ties:
    the lower column first)."""
    if k < similarity.shape[1]:
        rows = np.argpartition(-similarity, k - 1, axis=1)[:, :k]
    else:
        rows = np.broadcast_to(np.arange(similarity.shape[1]), similarity.shape)
    top = np.take_along_axis(similarity, rows, axis=1)
    order = np.lexsort((rows, -top), axis=1)
    rows = np.take_along_axis(rows, order, axis=1)
    return np.take_along_axis(similarity, rows, axis=1), rows


# -- splits -------------------------------------------------------------------------------


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
