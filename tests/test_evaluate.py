import logging

import numpy as np
import pytest
import torch

from vlm_vit import EncoderConfig, ImageProcessor, VisionEncoder
from vlm_vit.eval import (
    BIAS_CONSTANT,
    evaluate_features,
    extract_features,
    few_shot_accuracy,
    fit_least_squares,
    key_order,
    knn_accuracy,
    linear_probe_accuracy,
    plus_minus_one_targets,
    read_class_folder,
    sample_shots,
    stratified_split,
)

TINY = dict(image_size=32, patch_size=8, width=32, depth=2, heads=4, mlp_width=64)


def blobs(per_class, classes=4, dim=16, seed=0, spread=3.0):
    """Gaussian blobs around well separated class means (fixed by the class count)."""
    means = np.random.default_rng(123).normal(size=(classes, dim)) * spread
    labels = np.repeat(np.arange(classes), per_class)
    rng = np.random.default_rng(seed)
    return means[labels] + rng.normal(size=(len(labels), dim)), labels


def noise(count, classes=4, dim=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(count, dim)), rng.integers(0, classes, count)


@pytest.fixture(scope="module")
def separable():
    return (*blobs(30, seed=1), *blobs(100, seed=2))


# -- few-shot least squares --------------------------------------------------------------


def test_plus_minus_one_targets():
    np.testing.assert_array_equal(plus_minus_one_targets(np.array([2, 0, 1, 2]), 3), [
        [-1, -1, 1], [1, -1, -1], [-1, 1, -1], [-1, -1, 1]])
    with pytest.raises(ValueError, match="0..2"):
        plus_minus_one_targets(np.array([0, 3]), 3)


@pytest.mark.parametrize("per_class, dim", [(40, 8), (3, 50)])  # primal and dual branches
def test_least_squares_matches_numpy_closed_form(per_class, dim):
    x, y = blobs(per_class, classes=3, dim=dim, seed=3)
    test_x, _ = blobs(10, classes=3, dim=dim, seed=4)
    l2 = 5.0
    classifier = fit_least_squares(torch.from_numpy(x).float(), y, l2=l2)

    x = x.astype(np.float32).astype(np.float64)  # the classifier saw float32 features
    mean, std = x.mean(0), x.std(0) + 1e-5
    design = np.hstack([(x - mean) / std, np.full((len(x), 1), BIAS_CONSTANT)])
    targets = 2.0 * np.eye(3)[y] - 1.0
    weights = np.linalg.inv(design.T @ design + l2 * np.eye(dim + 1)) @ design.T @ targets
    test_design = np.hstack([(test_x - mean) / std, np.full((len(test_x), 1), BIAS_CONSTANT)])

    np.testing.assert_allclose(classifier.weights, weights, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(classifier.scores(test_x), test_design @ weights, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_array_equal(classifier.predict(test_x), (test_design @ weights).argmax(1))


def test_few_shot_separable_blobs_near_perfect(separable):
    for shots in (None, 1, 5, 10):
        assert few_shot_accuracy(*separable, shots=shots) >= 0.95, shots


def test_few_shot_noise_is_chance():
    accuracy = few_shot_accuracy(*noise(400, seed=1), *noise(2000, seed=2))
    assert 0.20 <= accuracy <= 0.30  # 4 classes; the std of 2000 guesses is 0.01


def test_few_shot_keeps_string_labels_and_is_seeded(separable):
    train_x, train_y, test_x, test_y = separable
    names = np.array(["ant", "bee", "cat", "dog"])
    words = few_shot_accuracy(train_x, names[train_y], test_x, names[test_y], shots=1, seed=7)
    assert words == few_shot_accuracy(train_x, train_y, test_x, test_y, shots=1, seed=7)


def test_sample_shots_takes_exactly_k_per_class():
    labels = np.array([0] * 7 + [1] * 3 + [2] * 10)
    rows = sample_shots(labels, 3, seed=0)
    assert np.bincount(labels[rows]).tolist() == [3, 3, 3]
    assert len(set(rows.tolist())) == 9
    assert np.array_equal(rows, sample_shots(labels, 3, seed=0))
    assert not np.array_equal(sample_shots(labels, 2, seed=0), sample_shots(labels, 2, seed=1))
    with pytest.raises(ValueError, match="class 1 has 3"):
        sample_shots(labels, 4)
    with pytest.raises(ValueError, match="positive int"):
        sample_shots(labels, 0)


# -- linear probe and k-NN -----------------------------------------------------------------


def test_linear_probe_and_knn_on_blobs(separable):
    assert linear_probe_accuracy(*separable) >= 0.95
    assert knn_accuracy(*separable) >= 0.95
    assert knn_accuracy(*separable, k=500) >= 0.9  # k capped at the 120 training points


def test_linear_probe_and_knn_on_noise_are_chance():
    train, test = noise(400, seed=1), noise(2000, seed=2)
    assert 0.18 <= linear_probe_accuracy(*train, *test) <= 0.32
    assert 0.18 <= knn_accuracy(*train, *test) <= 0.32


def test_knn_votes_by_weighted_cosine_neighbours():
    train_x = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    train_y = torch.tensor([0, 0, 1])
    # Closest to class 1's single point, but with k=3 the two class-0 points add up; a low
    # temperature makes the nearest neighbour dominate again.
    test_x, test_y = torch.tensor([[0.6, 0.8]]), torch.tensor([1])
    assert knn_accuracy(train_x, train_y, test_x, test_y, k=1) == 1.0
    assert knn_accuracy(train_x, train_y, test_x, test_y, k=3, temperature=10.0) == 0.0
    assert knn_accuracy(train_x, train_y, test_x, test_y, k=3, temperature=0.01) == 1.0


# -- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize("function", [few_shot_accuracy, linear_probe_accuracy, knn_accuracy])
@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "train_x": a["train_x"][:, :3]}, "width 3 but test_x has width 16"),
    (lambda a: {**a, "train_y": a["train_y"][:-1]}, "train_y has 119 labels for 120"),
    (lambda a: {**a, "test_x": a["test_x"][0]}, r"test_x must be a non-empty \[N, D\]"),
    (lambda a: {**a, "train_y": np.zeros(120, int)}, "at least 2 classes"),
    (lambda a: {**a, "train_x": np.where(a["train_x"] > 3, np.nan, a["train_x"])},
     "non-finite"),
    (lambda a: {**a, "train_y": np.where(a["train_y"] == 3, 0, a["train_y"])},
     r"test labels \[3\] have no training examples"),
])
def test_metrics_validate_inputs(separable, function, change, message):
    names = ("train_x", "train_y", "test_x", "test_y")
    arguments = change(dict(zip(names, separable, strict=True)))
    with pytest.raises(ValueError, match=message):
        function(*(arguments[n] for n in names))


def test_metric_option_errors(separable):
    with pytest.raises(ValueError, match="l2 must be a finite number > 0"):
        few_shot_accuracy(*separable, l2=0.0)
    with pytest.raises(ValueError, match="class 0 has 30"):
        few_shot_accuracy(*separable, shots=31)
    with pytest.raises(ValueError, match="k must be a positive int"):
        knn_accuracy(*separable, k=0)
    with pytest.raises(ValueError, match="C must be > 0"):
        linear_probe_accuracy(*separable, C=-1.0)


# -- feature extraction --------------------------------------------------------------------


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    return VisionEncoder(EncoderConfig(**TINY)).eval()


def test_extract_features_pools_the_encoder_output(encoder):
    images = torch.rand(5, 3, 32, 32)
    processor = ImageProcessor.for_family("imagenet", size=32)
    with torch.no_grad():
        out = encoder(processor(images))
    for pooling, expected in [("cls", out.cls_token), ("mean", out.patch_tokens.mean(1))]:
        features, labels = extract_features(encoder, images, pooling=pooling, batch_size=2,
                                            processor=processor, progress=False)
        assert features.shape == (5, 32) and features.dtype == torch.float32
        assert labels is None
        torch.testing.assert_close(features, expected, atol=1e-5, rtol=1e-5)


def test_extract_features_from_a_loader_keeps_labels_and_mode(encoder):
    pixels = torch.randn(6, 3, 32, 32)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(pixels, torch.arange(6) % 2), batch_size=4)
    encoder.train()
    features, labels = extract_features(encoder, loader, pooling="mean", progress=False)
    assert encoder.training  # restored after running in eval mode
    encoder.eval()
    with torch.no_grad():
        expected = encoder(pixels).patch_tokens.mean(1)
    torch.testing.assert_close(features, expected, atol=1e-5, rtol=1e-5)
    assert labels.tolist() == [0, 1, 0, 1, 0, 1]


def test_extract_features_without_class_token_refuses_cls(caplog):
    encoder = VisionEncoder(EncoderConfig(**TINY, class_token=False, num_register_tokens=2))
    with pytest.raises(ValueError, match="has none.*use pooling='mean'"):
        extract_features(encoder, torch.rand(2, 3, 32, 32), pooling="cls", progress=False)
    with caplog.at_level(logging.INFO, logger="vlm_vit.eval"):
        features, _ = extract_features(encoder, torch.rand(2, 3, 32, 32), pooling="mean",
                                       progress=False)
    assert features.shape == (2, 32)
    assert "imagenet normalisation at 32x32" in caplog.text


@pytest.mark.parametrize("kwargs, message", [
    (dict(pooling="max"), "pooling must be one of cls, mean"),
    (dict(batch_size=0), "batch_size must be at least 1"),
])
def test_extract_features_option_errors(encoder, kwargs, message):
    with pytest.raises(ValueError, match=message):
        extract_features(encoder, torch.rand(2, 3, 32, 32), progress=False, **kwargs)


def test_extract_features_input_errors(encoder):
    with pytest.raises(ValueError, match="no images"):
        extract_features(encoder, [], progress=False)
    with pytest.raises(ValueError, match=r"\[B, C, H, W\], got shape \[3, 32, 32\]"):
        extract_features(encoder, torch.rand(3, 32, 32), progress=False)
    with pytest.raises(ValueError, match="batch 0 from the loader is a str"):
        extract_features(encoder, iter(["x"]), progress=False)


# -- folders -------------------------------------------------------------------------------


def test_read_class_folder_and_split(tmp_path):
    from PIL import Image

    for name, count in [("b", 4), ("a", 3)]:
        (tmp_path / name / "nested").mkdir(parents=True)
        for i in range(count):
            Image.new("RGB", (8, 8)).save(tmp_path / name / "nested" / f"{i}.png")
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    (tmp_path / ".hidden").mkdir()
    files, labels, classes = read_class_folder(tmp_path)
    assert classes == ["a", "b"] and labels.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert all(f.suffix == ".png" for f in files)
    train, test = stratified_split(labels, 0.5, seed=0)
    assert np.bincount(labels[test]).tolist() == [2, 2]  # round(1.5) = 2, round(2.0) = 2
    assert sorted([*train, *test]) == list(range(7))
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        stratified_split(labels, 1.0)
    with pytest.raises(ValueError, match="class 1 has 1 image"):
        stratified_split(np.array([0, 0, 1]), 0.5)


def test_a_keyed_split_and_its_shots_depend_on_the_names_not_their_order():
    """Issue 27: with keys, which images are held out and which are the shots is a function
    of the keys and the seed, so a folder and its shuffled shards agree."""
    labels = np.repeat([0, 1, 2], 10)
    keys = [f"c{label}/{index:02d}.png" for index, label in enumerate(labels)]
    order = np.random.default_rng(5).permutation(len(keys))

    def named(rows, keys):
        return sorted(keys[row] for row in rows)

    shuffled = [keys[i] for i in order]
    for seed in (0, 1):
        train, test = stratified_split(labels, 0.3, seed=seed, keys=keys)
        train2, test2 = stratified_split(labels[order], 0.3, seed=seed, keys=shuffled)
        assert named(test, keys) == named(test2, shuffled)
        assert np.bincount(labels[test]).tolist() == [3, 3, 3]
        shots = sample_shots(labels, 2, seed=seed, keys=keys)
        assert named(shots, keys) == named(sample_shots(labels[order], 2, seed=seed,
                                                        keys=shuffled), shuffled)
    assert named(stratified_split(labels, 0.3, seed=0, keys=keys)[1], keys) != named(
        stratified_split(labels, 0.3, seed=1, keys=keys)[1], keys)
    # The documented order: BLAKE2b-64 of "seed:key", big-endian.
    import hashlib

    def digest(key):
        return int.from_bytes(hashlib.blake2b(f"7:{key}".encode(), digest_size=8).digest(),
                              "big")
    assert key_order(keys, seed=7).tolist() == sorted(range(len(keys)),
                                                      key=lambda i: digest(keys[i]))
    # Every metric agrees however the rows come.
    features = blobs(10, classes=3, spread=0.6)[0]
    result = evaluate_features(features, labels, ["a", "b", "c"], shots=[1, 3], keys=keys)
    assert result == evaluate_features(features[order], labels[order], ["a", "b", "c"],
                                       shots=[1, 3], keys=shuffled)
    with pytest.raises(ValueError, match="got 2 keys for 30 labels"):
        stratified_split(labels, 0.3, keys=keys[:2])



def test_the_classifiers_need_numpy_only():
    """vlm_vit/eval/classifiers.py loads and scores with torch unimportable."""
    import subprocess
    import sys

    import vlm_vit.eval.classifiers as classifiers

    code = (
        "import importlib.util, sys\n"
        "import numpy as np\n"
        "sys.modules['torch'] = None\n"
        f"spec = importlib.util.spec_from_file_location('classifiers', {classifiers.__file__!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "x = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])\n"
        "y = np.array([0, 0, 1, 1])\n"
        "print(module.knn_accuracy(x, y, x, y, k=1), module.few_shot_accuracy(x, y, x, y))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1.0", "1.0"]


def test_knn_takes_the_lower_training_row_among_equally_similar_ones():
    # rows 0 and 1 are the same point in different classes; k=1 takes row 0
    train = np.array([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0], [-1.0, 0.0]])
    query = np.array([[0.6, 0.8]])
    assert knn_accuracy(train, [0, 1, 0, 1], query, [0], k=1) == 1.0
    assert knn_accuracy(train, [1, 0, 0, 1], query, [1], k=1) == 1.0
