"""The old home of frozen-feature evaluation, now `vlm_vit.eval`; its public names, kept here
for one release."""

from vlm_vit.eval import (  # noqa: F401
    BIAS_CONSTANT,
    DEFAULT_L2,
    POOLINGS,
    STD_EPS,
    Array,
    LeastSquaresClassifier,
    evaluate_features,
    evaluate_folder,
    evaluate_shards,
    extract_features,
    few_shot_accuracy,
    fit_least_squares,
    key_order,
    knn_accuracy,
    linear_probe_accuracy,
    plus_minus_one_targets,
    read_class_folder,
    sample_key,
    sample_shots,
    split_for_shots,
    standardize,
    stratified_split,
)
