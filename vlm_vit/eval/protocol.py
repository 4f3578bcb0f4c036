"""The frozen-feature protocol: split, encode once, run every classifier.

`evaluate_folder` (a class-labelled folder) and `evaluate_shards` (labelled WebDataset tar
shards) encode the images once and hand the features to `evaluate_features`, which splits
them and runs every metric. Both split by each image's key (`key_order`): its path relative to
the folder (`class/name.png`), which is also what `vlm-vit shards` records in a sample's json,
so a folder and its shards give the same split and the same numbers.

The encoder is never trained here; each metric fits a cheap classifier
(`vlm_vit.eval.classifiers`) on its frozen features.

Shapes: N images, D the feature width, K classes.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlm_vit.eval.classifiers import (
    DEFAULT_L2,
    few_shot_accuracy,
    knn_accuracy,
    linear_probe_accuracy,
    stratified_split,
)
from vlm_vit.eval.features import (
    POOLINGS,
    _default_processor,
    _KeyedDecode,
    extract_features,
    read_class_folder,
)
from vlm_vit.model import VisionEncoder
from vlm_vit.processor import ImageProcessor

logger = logging.getLogger(__name__)


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
