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
from dataclasses import dataclass, fields, replace
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


@dataclass(frozen=True)
class EvalSettings:
    """The protocol's settings, one set for `evaluate_features`, `evaluate_folder` and
    `evaluate_shards` (each also takes them as keywords of the same names).

    Attributes:
        shots: examples per class for few-shot accuracy, one score per entry; each must fit
            the smallest class's training part.
        test_fraction: each class's share held out for testing.
        seed: the split and shot-sampling seed.
        pooling: "cls" or "mean"; None picks "cls" when the encoder has a class token and
            "mean" otherwise (logged, and recorded in the result). `extract_features` on its
            own defaults to "cls".
        batch_size: images per forward pass.
        device: where the encoder runs; None: where it is.
        l2: few-shot ridge strength (big_vision's fixed 2^10).
        C: the linear probe's inverse L2 strength.
        k: the k-NN's neighbours (capped at the training images).
        temperature: the k-NN's vote temperature (DINO: 0.07).
        progress: show a progress bar while encoding.
    """

    shots: Sequence[int] = (1, 5, 10)
    test_fraction: float = 0.5
    seed: int = 0
    pooling: str | None = None
    batch_size: int = 32
    device: str | torch.device | None = None
    l2: float = DEFAULT_L2
    C: float = 1.0
    k: int = 20
    temperature: float = 0.07
    progress: bool = True


# What evaluate_features uses of the settings: the encoding ones mean nothing to it.
_FEATURE_SETTINGS = ("shots", "test_fraction", "seed", "l2", "C", "k", "temperature")


def _settings(settings: EvalSettings | None, overrides: dict[str, Any], function: str,
              allowed: Sequence[str] | None = None) -> EvalSettings:
    """`settings` (default `EvalSettings()`) with the keyword `overrides` a caller gave;
    a keyword that is no setting (of `allowed`) is a TypeError, as for any function."""
    names = allowed if allowed is not None else [item.name for item in fields(EvalSettings)]
    unknown = [name for name in overrides if name not in names]
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")
    return replace(settings or EvalSettings(), **overrides)


def _in_key_order(features: np.ndarray, labels: np.ndarray, keys: Sequence[str]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows put in their keys' sorted order, so that however they were read they come in
    one order; repeated keys are logged (their split depends on the reading order)."""
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
    return features, labels, keys


def evaluate_features(
    features: np.ndarray,
    labels: np.ndarray,
    class_names: Sequence[str],
    settings: EvalSettings | None = None,
    *,
    keys: Sequence[str] | None = None,
    **overrides: Any,
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
        settings: `EvalSettings`; of them, shots, test_fraction, seed, l2, C, k and
            temperature apply here.
        keys: `[N]` a name per image (see `key_order`); None: a seeded permutation of the
            rows splits them.
        **overrides: any of those settings by name (`shots=[1, 5]`), over `settings`.

    Returns:
        A JSON-able dict: `classes`, `num_train`, `num_test`, `feature_dim`, `seed`,
        `test_fraction`, `chance`, `few_shot` (accuracy per shots, keyed by the shots as a
        string), `l2`, `linear_probe`, `linear_probe_C`, `knn`, `knn_k` (after capping),
        `knn_temperature`. Accuracies are fractions in [0, 1].
    """
    settings = _settings(settings, overrides, "evaluate_features", _FEATURE_SETTINGS)
    shots, seed = _checked_shots(settings.shots), settings.seed
    features, labels = np.asarray(features), np.asarray(labels)
    if keys is not None:
        features, labels, keys = _in_key_order(features, labels, keys)
    train, test = split_for_shots(labels, class_names, shots, settings.test_fraction, seed,
                                  None if keys is None else keys.tolist())
    train_keys = None if keys is None else keys[train].tolist()
    present = np.unique(labels)
    split = (features[train], labels[train], features[test], labels[test])
    few_shot = {str(count): few_shot_accuracy(*split, shots=count, l2=settings.l2, seed=seed,
                                              train_keys=train_keys)
                for count in shots}
    return {
        "classes": [class_names[int(index)] for index in present],
        "num_train": len(train),
        "num_test": len(test),
        "feature_dim": int(features.shape[1]),
        "seed": seed,
        "test_fraction": settings.test_fraction,
        "chance": 1 / len(present),
        "few_shot": few_shot,
        "l2": settings.l2,
        "linear_probe": linear_probe_accuracy(*split, C=settings.C),
        "linear_probe_C": settings.C,
        "knn": knn_accuracy(*split, k=settings.k, temperature=settings.temperature),
        "knn_k": min(settings.k, len(train)),
        "knn_temperature": settings.temperature,
    }


def evaluate_folder(
    encoder: VisionEncoder,
    root: str | Path,
    settings: EvalSettings | None = None,
    *,
    processor: ImageProcessor | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Every metric on a class-labelled folder, split into train and test.

    The folder is read by `read_class_folder`; the split and the shots are checked before
    anything is encoded; every image is encoded once and `evaluate_features` does the rest,
    each image's key being its path relative to `root` (`class/name.png`, see `key_order`).

    Args:
        encoder: the frozen encoder.
        root: one sub-folder per class.
        settings: `EvalSettings` (pooling None: "cls" with a class token, else "mean").
        processor: as in `extract_features`.
        **overrides: any setting by name (`shots=[1, 5]`, `progress=False`), over `settings`.

    Returns:
        `data` and `pooling`, then what `evaluate_features` returns.
    """
    settings = _settings(settings, overrides, "evaluate_folder")
    pooling = _resolve_pooling(encoder, settings.pooling)
    shots = _checked_shots(settings.shots)
    files, labels, classes = read_class_folder(root)
    keys = [path.relative_to(root).as_posix() for path in files]
    # fails before encoding
    split_for_shots(labels, classes, shots, settings.test_fraction, settings.seed, keys)
    features, _ = extract_features(encoder, files, pooling=pooling,
                                   batch_size=settings.batch_size, processor=processor,
                                   device=settings.device, progress=settings.progress)
    return {"data": str(root), "pooling": pooling, **evaluate_features(
        features.numpy(), labels, classes, replace(settings, shots=shots), keys=keys)}


# -- labelled tar shards --------------------------------------------------------------------


def evaluate_shards(
    encoder: VisionEncoder,
    shards: str | Path | Sequence[str | Path],
    settings: EvalSettings | None = None,
    *,
    processor: ImageProcessor | None = None,
    label_field: str | None = None,
    **overrides: Any,
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
        shards: a shard spec (see `vlm_vit.data.shards.expand_shards`).
        settings: as in `evaluate_folder`.
        processor: as in `extract_features`.
        label_field: None for the `cls` field, else a field of each sample's `json`.
        **overrides: any setting by name, over `settings`.

    Returns:
        `data` and `pooling`, what `evaluate_features` returns, then `shards` (how many) and
        `skipped`: counts {"no_image", "undecodable" (image or label), "truncated_shards"}.

    Raises:
        FileNotFoundError, ValueError: from `expand_shards`; when no sample has a decodable
            image and label (naming the first problem); or as `evaluate_features`.
    """
    settings = _settings(settings, overrides, "evaluate_shards")
    pooling = _resolve_pooling(encoder, settings.pooling)
    shots = _checked_shots(settings.shots)
    if settings.batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {settings.batch_size}")
    features, labels, names, keys, urls, skipped = _shard_features(
        encoder, shards, processor, label_field, replace(settings, pooling=pooling))
    data = (str(shards) if isinstance(shards, (str, os.PathLike))
            else [str(shard) for shard in shards])
    return {"data": data, "pooling": pooling, **evaluate_features(
        features, labels, names, replace(settings, shots=shots), keys=keys),
        "shards": len(urls), "skipped": skipped}


def _shard_features(encoder: VisionEncoder, shards: str | Path | Sequence[str | Path],
                    processor: ImageProcessor | None, label_field: str | None,
                    settings: EvalSettings):
    """The shards' samples encoded in order: `[N, D]` features, `[N]` labels, the class names,
    the `[N]` keys, the shard URLs and the skipped counts."""
    from vlm_vit.data.shards import (
        LabelledBatches,
        LabelledDecode,
        expand_shards,
        read_dataset_index,
    )

    urls = expand_shards(shards)
    index = read_dataset_index(urls)
    names = index.get("classes") if index else None
    decode = _KeyedDecode(LabelledDecode(processor or _default_processor(encoder), label_field,
                                         num_classes=len(names) if names else None))
    stream = LabelledBatches(urls, decode, settings.batch_size)
    batches = iter(stream)
    first = next(batches, None)  # a clear error for shards without one usable sample
    if first is None:
        first_problem = "".join(f"; first: {text}" for text in stream.described(1))
        raise ValueError(f"no sample of the {len(urls)} shards of {shards} has a decodable "
                         f"image and label ({len(stream.no_image)} without an image, "
                         f"{len(stream.undecodable)} undecodable{first_problem})")
    features, labels = extract_features(encoder, itertools.chain([first], batches),
                                        pooling=settings.pooling, device=settings.device,
                                        progress=settings.progress)
    skipped = stream.skipped()
    labels = labels.numpy()
    if not names:
        names = [str(label) for label in range(int(labels.max()) + 1)]
    return (features.numpy(), labels, [str(name) for name in names], decode.keys, urls,
            skipped)
