import contextlib
import io
import json

import numpy as np
import pytest
from PIL import Image

from vlm_vit import load_encoder
from vlm_vit.cli import main
from vlm_vit.recipes.demo import demo_splits
from vlm_vit.recipes.label_efficiency import fingerprint

pytest.importorskip("sklearn")
pytest.importorskip("skimage")
pytest.importorskip("torchvision")

TINY = ["--steps", "4", "--batch-size", "16", "--images-per-class", "20", "--width", "32",
        "--depth", "1", "--shots", "2", "--finetune-steps", "120", "--finetune-lr", "1e-2",
        "--seeds", "2", "--labels", "1", "all", "--quiet"]


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["demo", "--out", str(out), *TINY]) == 0
    return out, json.loads((out / "report.json").read_text()), printed.getvalue()


def test_the_report_has_every_number_for_both_arms(tiny_demo):
    out, report, _ = tiny_demo
    assert report["test_images"] == 100 and report["pretraining"]["steps"] == 4
    assert report["finetune"]["labels"] == ["1", "all"] and report["finetune"]["seeds"] == 2
    assert report["labelled_per_class"] == {"1": 1, "all": 8}
    for arm in ("random_init", "pretrained"):
        assert set(report[arm]) == {"few_shot_accuracy", "knn_accuracy", "linear_probe_accuracy",
                                    "finetune_accuracy", "finetune_start_fingerprint"}
        for key in ("1", "all"):
            result = report[arm]["finetune_accuracy"][key]
            assert len(result["per_seed"]) == 2
            assert result["min"] <= result["median"] <= result["max"]
            assert result["median"] == pytest.approx(float(np.median(result["per_seed"])))
    assert report["photos"] == {"mean": [3, 32], "pixel_shuffle": [3, 4, 32]}
    assert report["evaluated_on"] == "test" and report["scored_images"] == 100
    for name, size in (("loss.png", (500, 300)), ("label_efficiency.png", (500, 350))):
        with Image.open(out / name) as plot:
            assert plot.size == size


def test_fine_tuning_from_either_start_beats_chance(tiny_demo):
    """Not that pretraining wins (a measurement, reported): that fine-tuning works at all."""
    _, report, _ = tiny_demo
    for arm in ("random_init", "pretrained"):
        assert report[arm]["finetune_accuracy"]["all"]["median"] >= 0.1 + 0.15, arm


def test_both_arms_start_from_the_weights_they_claim(tiny_demo):
    out, report, _ = tiny_demo
    # The random arm starts where pretraining started; the pretrained arm from its result.
    assert report["random_init"]["finetune_start_fingerprint"] == \
        report["pretraining"]["start_fingerprint"]
    assert report["pretrained"]["finetune_start_fingerprint"] == \
        fingerprint(load_encoder(out / "encoder"))
    assert report["pretrained"]["finetune_start_fingerprint"] != \
        report["random_init"]["finetune_start_fingerprint"]


def test_the_terminal_table_carries_the_report(tiny_demo):
    _, report, printed = tiny_demo
    for key in ("1", "all"):
        row = next(line for line in printed.splitlines()
                   if line.startswith(f"fine-tune, {key} per class"))
        expected = [f"{report[arm]['finetune_accuracy'][key]['median']:.3f}"
                    for arm in ("random_init", "pretrained")]
        assert row.split()[4:6] == expected
    # The loss printed is the report's, named the same way (mean of the last 10 steps).
    pretraining = report["pretraining"]
    assert f"-> {pretraining['final_loss_mean_of_last_10']:.3f} (mean of the last 10" in printed
    assert "final_loss" not in pretraining and "last_loss" in pretraining
    for start, metric, at in (("frozen linear probe", "linear_probe_accuracy", 4),
                              ("frozen k-NN", "knn_accuracy", 4)):
        row = next(line for line in printed.splitlines() if line.startswith(start))
        assert row.split()[at:at + 2] == [f"{report[arm][metric]:.3f}"
                                          for arm in ("random_init", "pretrained")]


def test_the_validation_split_is_inside_the_training_half():
    labels = np.repeat(np.arange(10), 30)
    train, pool, validation, test = demo_splits(labels, seed=0)
    assert not set(validation) & set(test) and not set(pool) & set(test)
    assert not set(pool) & set(validation)
    assert set(pool) | set(validation) == set(train)
    assert len(validation) == 30 and np.bincount(labels[validation]).tolist() == [3] * 10


@pytest.mark.parametrize("argv, message", [
    (["--labels", "0"], "--labels takes positive numbers or 'all', got '0'"),
    (["--seeds", "0"], "--seeds must be at least 1"),
    (["--labels", "5", "5"], "--labels lists a count twice"),
    (["--labels", "9", "--images-per-class", "20"],
     "the labelled pool has only 8 images of its smallest class"),
])
def test_demo_user_errors(tmp_path, capsys, argv, message):
    assert main(["demo", "--out", str(tmp_path / "d"), *argv, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_everything_the_demo_imports_comes_with_the_train_extra(tmp_path):
    """`pip install 'vlm-vit[train]'` then `vlm-vit demo`: each module the demo loads (run
    for real, in a fresh process) belongs to a distribution that the core dependencies and
    the `train` extra bring, directly or through their own requirements."""
    import subprocess
    import sys
    from importlib import metadata
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    code = ("import sys\nfrom vlm_vit.cli import main\n"
            f"assert main(['demo', '--out', {str(tmp_path / 'demo')!r}, '--steps', '2', "
            "'--batch-size', '16', '--images-per-class', '10', '--width', '32', '--depth', "
            "'1', '--shots', '1', '--finetune-steps', '2', '--seeds', '1', '--labels', '1', "
            "'--quiet']) == 0\n"
            "print(' '.join(sorted({name.split('.')[0] for name in sys.modules})))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = done.stdout.strip().splitlines()[-1].split()

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    wanted = [Requirement(r) for r in project["project"]["dependencies"]
              + project["project"]["optional-dependencies"]["train"]]
    allowed, queue = set(), [canonicalize_name(r.name) for r in wanted]
    while queue:  # the closure of their requirements, as installed here
        name = queue.pop()
        if name in allowed:
            continue
        allowed.add(name)
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:  # not installed (a platform's own): not imported
            continue
        for text in requirements:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                queue.append(canonicalize_name(requirement.name))
    # Not requirements: joblib (psutil), scikit-learn (rich), torch's inductor (colorama) and
    # numpy's f2py (charset-normalizer) import these only when they are installed (the dev
    # extra's docs tools bring the last two); the plugins installed here add their commands
    # to any CLI run.
    optional = {"psutil", "rich", "colorama", "charset-normalizer", "vlm-vit-llm",
                "vlm-vit-cabstractor"}
    owners = metadata.packages_distributions()
    outside = {module: owners[module] for module in imported if module in owners
               and not any(canonicalize_name(d) in allowed | optional | {"vlm-vit"}
                           for d in owners[module])}
    assert not outside, f"the demo imports modules the train extra does not bring: {outside}"


@pytest.mark.parametrize("objective", ["ijepa", "capi"])
def test_the_ijepa_and_capi_demos_score_their_student(tmp_path, objective):
    """Their EMA teachers lag the student over a demo-length run: `encoder/`, the arm the
    demo scores, is the student's final weights."""
    import torch

    out = tmp_path / "demo"
    quick = ["--steps", "3", "--batch-size", "16", "--images-per-class", "20", "--width", "32",
             "--depth", "1", "--shots", "1", "--finetune-steps", "2", "--seeds", "1",
             "--labels", "1", "--quiet"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["demo", "--out", str(out), "--objective", objective, *quick]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["pretraining"]["objective"] == objective
    assert report["pretraining"]["steps"] == 3
    state = torch.load(out / "run" / "objective.pt", weights_only=True)
    exported = load_encoder(out / "encoder").state_dict()
    assert exported
    for name, value in exported.items():
        assert torch.equal(value, state[f"student.{name}"]), name
    assert any(not torch.equal(value, state[f"encoder.{name}"])
               for name, value in exported.items())  # not the teacher
