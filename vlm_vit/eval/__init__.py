"""Frozen-feature evaluation: few-shot least squares, a linear probe and k-NN.

- `classifiers`: the classifiers fit on features (`few_shot_accuracy`, `linear_probe_accuracy`,
  `knn_accuracy`) and the seeded picks of examples (`sample_shots`, `stratified_split`,
  `key_order`).
- `features`: one pooled vector per image from a frozen encoder (`extract_features`), and the
  readers of a class-labelled folder and of labelled shards.
- `protocol`: split, encode once, run every classifier (`evaluate_features`,
  `evaluate_folder`, `evaluate_shards`), with one `EvalSettings`.
"""

from vlm_vit.eval.classifiers import (
    BIAS_CONSTANT,
    DEFAULT_L2,
    STD_EPS,
    Array,
    LeastSquaresClassifier,
    few_shot_accuracy,
    fit_least_squares,
    key_order,
    knn_accuracy,
    linear_probe_accuracy,
    plus_minus_one_targets,
    sample_shots,
    standardize,
    stratified_split,
)
from vlm_vit.eval.features import POOLINGS, extract_features, read_class_folder, sample_key
from vlm_vit.eval.protocol import (
    EvalSettings,
    evaluate_features,
    evaluate_folder,
    evaluate_shards,
    split_for_shots,
)

__all__ = [
    "BIAS_CONSTANT",
    "DEFAULT_L2",
    "POOLINGS",
    "STD_EPS",
    "Array",
    "EvalSettings",
    "LeastSquaresClassifier",
    "evaluate_features",
    "evaluate_folder",
    "evaluate_shards",
    "extract_features",
    "few_shot_accuracy",
    "fit_least_squares",
    "key_order",
    "knn_accuracy",
    "linear_probe_accuracy",
    "plus_minus_one_targets",
    "read_class_folder",
    "sample_key",
    "sample_shots",
    "split_for_shots",
    "standardize",
    "stratified_split",
]
