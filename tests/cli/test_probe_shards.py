"""`vlm-vit probe` and `evaluate_shards` on labelled WebDataset tar shards."""

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_vit.cli import main
from vlm_vit.data.listing import class_folders
from vlm_vit.eval import evaluate_folder, evaluate_shards
from vlm_vit.io.loading import load_with_processor
from vlm_vit.model import VisionEncoder

from ..conftest import tiny_config

pytest.importorskip("webdataset")

CLASSES, PER_CLASS = 3, 20
ACCURACIES = ("few_shot", "linear_probe", "knn")
SAME = (*ACCURACIES, "num_train", "num_test", "chance", "feature_dim", "knn_k", "pooling")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """Real images: scikit-learn's 8x8 handwritten digits 0-2, upscaled to 32x32 PNGs."""
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("digits")
    data = load_digits(n_class=CLASSES)
    for digit in range(CLASSES):
        (root / f"digit_{digit}").mkdir()
        images = data.images[data.target == digit][:PER_CLASS]
        for index, image in enumerate(images):
            pixels = np.round(image * (255 / 16)).astype(np.uint8)
            Image.fromarray(pixels).resize((32, 32), Image.Resampling.BILINEAR).save(
                root / f"digit_{digit}" / f"{index:02d}.png")
    return root


@pytest.fixture(scope="module")
def class_shards(tmp_path_factory, digits):
    """`vlm-vit shards --classes --no-shuffle`: the folder's order, `cls` labels and a
    dataset.json naming the classes; 25 per shard, so shards cross class boundaries."""
    out = tmp_path_factory.mktemp("class_shards") / "shards"
    assert main(["shards", str(digits), "--out", str(out), "--classes", "--no-shuffle",
                 "--per-shard", "25", "--quiet"]) == 0
    assert len(list(out.glob("*.tar"))) == 3
    return out


@pytest.fixture(scope="module")
def json_shards(tmp_path_factory, digits):
    """The same images in the same order, labelled by a `json` field `digit` (no `cls`, no
    dataset.json) and named by its `path` (as `vlm-vit shards` names them), followed by a
    shard with a corrupt image and a sample without an image."""
    import webdataset as wds

    out = tmp_path_factory.mktemp("json_shards")
    files, labels, _ = class_folders(digits)
    for shard in range(2):
        with wds.TarWriter(str(out / f"part-{shard}.tar")) as writer:
            for index in range(shard * 30, shard * 30 + 30):
                writer.write({"__key__": f"k{index:03d}", "png": files[index].read_bytes(),
                              "json": json.dumps({
                                  "digit": labels[index],
                                  "path": files[index].relative_to(digits).as_posix(),
                              }).encode()})
    with wds.TarWriter(str(out / "part-9.tar")) as writer:
        writer.write({"__key__": "corrupt", "png": b"no PNG at all",
                      "json": json.dumps({"digit": 0}).encode()})
        writer.write({"__key__": "caption-only", "txt": b"a caption, no image"})
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    return VisionEncoder(tiny_config(depth=2)).save_pretrained(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def folder_result(digits, checkpoint):
    encoder, processor = load_with_processor(checkpoint)
    return evaluate_folder(encoder, digits, processor=processor, shots=[1, 5], batch_size=8,
                           progress=False)


def test_class_shards_score_exactly_as_the_folder(class_shards, checkpoint, folder_result):
    encoder, processor = load_with_processor(checkpoint)
    result = evaluate_shards(encoder, class_shards, processor=processor, shots=[1, 5],
                             batch_size=8, progress=False)
    for key in SAME:
        assert result[key] == folder_result[key], key
    assert result["classes"] == folder_result["classes"] == ["digit_0", "digit_1", "digit_2"]
    assert result["linear_probe"] > 0.5  # a real measurement, not a degenerate one
    assert result["shards"] == 3


def test_one_settings_object_scores_as_its_keywords(class_shards, digits, checkpoint,
                                                    folder_result):
    from vlm_vit.eval import EvalSettings

    encoder, processor = load_with_processor(checkpoint)
    settings = EvalSettings(shots=(1, 5), batch_size=8, progress=False)
    assert evaluate_folder(encoder, digits, settings, processor=processor) == folder_result
    result = evaluate_shards(encoder, class_shards, settings, processor=processor)
    for key in SAME:
        assert result[key] == folder_result[key], key
    with pytest.raises(TypeError, match="unexpected keyword argument 'label_fields'"):
        evaluate_shards(encoder, class_shards, settings, label_fields="digit")
    assert result["skipped"] == {"no_image": 0, "undecodable": 0, "truncated_shards": 0}


def test_shuffled_shards_split_by_image_path_and_probe_exactly_as_the_folder(
        digits, checkpoint, tmp_path, capsys):
    """Issue 27: `vlm-vit shards --classes` shuffles the images (and numbers them anew), yet
    `probe` splits both sources by each image's path relative to the folder, so it measures
    the same numbers on the folder and on its shards."""
    shards = tmp_path / "shards"
    assert main(["shards", str(digits), "--out", str(shards), "--classes", "--seed", "3",
                 "--per-shard", "25", "--quiet"]) == 0
    results = {}
    for name, data in (("folder", digits), ("shards", shards)):
        out = tmp_path / f"{name}.json"
        assert main(["probe", str(checkpoint), "--data", str(data), "--shots", "1", "5",
                     "--batch-size", "8", "--json", str(out), "--quiet"]) == 0
        results[name] = json.loads(out.read_text())
    capsys.readouterr()
    for key in (*SAME, "classes"):
        assert results["shards"][key] == results["folder"][key], key
    # The held-out images are the same named ones: the split is a function of the paths.
    from vlm_vit.eval import key_order, stratified_split

    files, labels, _ = class_folders(digits)
    keys = [path.relative_to(digits).as_posix() for path in files]
    _, test = stratified_split(np.array(labels), 0.5, seed=0, keys=keys)
    backwards = list(reversed(range(len(keys))))
    _, test_backwards = stratified_split(np.array(labels)[backwards], 0.5, seed=0,
                                         keys=[keys[i] for i in backwards])
    assert sorted(keys[i] for i in test) == sorted(keys[backwards[i]] for i in test_backwards)
    assert sorted(key_order(keys, seed=0)) == list(range(len(keys)))


def test_json_labels_skip_bad_samples_and_name_classes_by_index(json_shards, checkpoint,
                                                                 folder_result, caplog):
    encoder, processor = load_with_processor(checkpoint)
    with caplog.at_level(logging.WARNING, logger="vlm_vit.eval"):
        result = evaluate_shards(encoder, str(json_shards / "part-*.tar"), processor=processor,
                                 label_field="digit", shots=[1, 5], batch_size=8,
                                 progress=False)
    for key in SAME:
        assert result[key] == folder_result[key], key
    assert result["classes"] == ["0", "1", "2"]
    assert result["skipped"] == {"no_image": 1, "undecodable": 1, "truncated_shards": 0}
    warning = caplog.text
    assert "part-9.tar:caption-only (no image)" in warning
    assert "cannot load image " in warning and "part-9.tar:corrupt: not a recognised" in warning


def test_the_probe_command_reads_shards(class_shards, checkpoint, folder_result, tmp_path,
                                        capsys):
    out = tmp_path / "probe.json"
    assert main(["probe", str(checkpoint), "--data", str(class_shards / "{00000..00002}.tar"),
                 "--shots", "1", "5", "--batch-size", "8", "--json", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "3 classes, 30 train / 30 test images, cls pooling, width 32" in printed
    assert "3 shards; skipped 0 samples without an image, 0 undecodable" in printed
    result = json.loads(out.read_text())
    for key in ACCURACIES:
        assert result[key] == folder_result[key], key
    assert result["classes"] == ["digit_0", "digit_1", "digit_2"]
    assert result["data"] == str(class_shards / "{00000..00002}.tar")


@pytest.mark.parametrize("data, options, message", [
    ("JSON", [], "has a decodable image and label (1 without an image, 61 undecodable; "
     "first: JSON/part-0.tar:k000: no class label in its cls field"),
    ("JSON", ["--label-field", "class"], "no class label in its json field 'class'"),
    ("DIGITS", ["--label-field", "digit"], "--label-field is for tar shards"),
    ("CLASSES/{00000..00004}.tar", [], "2 of the 5 shards"),
    ("CLASSES", ["--shots", "11"], "11-shot needs 11 training images per class"),
])
def test_probe_shard_user_errors_are_one_line(digits, class_shards, json_shards, checkpoint,
                                              capsys, data, options, message):
    data = (data.replace("CLASSES", str(class_shards)).replace("JSON", str(json_shards))
            .replace("DIGITS", str(digits)))
    assert main(["probe", str(checkpoint), "--data", data, *options, "--quiet"]) == 1
    err = capsys.readouterr().err
    message = message.replace("JSON", str(json_shards))
    assert err.startswith("vlm-vit probe: error: ") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_labels_without_a_name_in_the_dataset_index_are_skipped(class_shards, checkpoint,
                                                                 tmp_path, caplog):
    shutil.copytree(class_shards, tmp_path / "shards")
    index = json.loads((tmp_path / "shards" / "dataset.json").read_text())
    index["classes"] = index["classes"][:2]
    (tmp_path / "shards" / "dataset.json").write_text(json.dumps(index))
    encoder, processor = load_with_processor(checkpoint)
    with caplog.at_level(logging.WARNING, logger="vlm_vit.eval"):
        result = evaluate_shards(encoder, tmp_path / "shards", processor=processor,
                                 shots=[1], progress=False)
    assert result["skipped"]["undecodable"] == PER_CLASS
    assert result["classes"] == ["digit_0", "digit_1"] and result["chance"] == 0.5
    assert result["num_train"] + result["num_test"] == 2 * PER_CLASS
    assert "class 2 is out of range for 2 classes" in caplog.text
