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


def test_the_report_has_every_number_for_every_arm(tiny_demo):
    out, report, _ = tiny_demo
    assert report["test_images"] == 100 and list(report["arms"]) == ["scratch", "mae"]
    assert report["arms"]["mae"]["pretraining"]["steps"] == 4
    assert report["arms"]["scratch"]["pretraining"] is None
    assert report["finetune"]["labels"] == ["1", "all"] and report["finetune"]["seeds"] == 2
    assert report["finetune"]["recipes_from"] == "flags" and report["sweep"] is None
    assert report["labelled_per_class"] == {"1": 1, "all": 8}
    spreads = [report["pixels"]["logistic_accuracy"][key] for key in ("1", "all")]
    for arm in ("scratch", "mae"):
        assert set(report["arms"][arm]) == {
            "pretraining", "few_shot_accuracy", "knn_accuracy", "linear_probe_accuracy",
            "finetune_accuracy", "finetune_start_fingerprint", "recipe"}
        assert report["arms"][arm]["recipe"]["lr"] == 1e-2
        assert report["arms"][arm]["recipe"]["steps"] == 120
        spreads += [report["arms"][arm]["finetune_accuracy"][key] for key in ("1", "all")]
    for spread in spreads:
        assert len(spread["per_seed"]) == 2
        assert spread["min"] <= spread["median"] <= spread["max"]
        assert spread["median"] == pytest.approx(float(np.median(spread["per_seed"])))
    assert set(report["pixels"]) == {"few_shot_accuracy", "knn_accuracy",
                                     "linear_probe_accuracy", "logistic_accuracy"}
    assert report["photos"] == {"encoder": "mae", "mean": [3, 32], "pixel_shuffle": [3, 4, 32]}
    assert report["evaluated_on"] == "test" and report["scored_images"] == 100
    for name, size in (("loss.png", (400, 300)), ("label_efficiency.png", (500, 350))):
        with Image.open(out / name) as plot:
            assert plot.size == size


def test_fine_tuning_from_either_start_beats_chance(tiny_demo):
    """Not that pretraining wins (a measurement, reported): that fine-tuning works at all."""
    _, report, _ = tiny_demo
    for arm in ("scratch", "mae"):
        assert report["arms"][arm]["finetune_accuracy"]["all"]["median"] >= 0.1 + 0.15, arm


def test_every_arm_starts_from_the_weights_it_claims(tiny_demo):
    out, report, _ = tiny_demo
    # Random init starts where pretraining started; the pretrained arm from its result.
    arms = report["arms"]
    assert arms["scratch"]["finetune_start_fingerprint"] == report["start_fingerprint"]
    assert arms["mae"]["finetune_start_fingerprint"] == \
        fingerprint(load_encoder(out / "encoders" / "mae"))
    assert arms["mae"]["finetune_start_fingerprint"] != report["start_fingerprint"]


def test_the_raw_pixel_baseline_is_a_logistic_regression_on_the_pixels(tiny_demo):
    """Recomputed here from the digits' files: the 'all labels' cell is scikit-learn's
    logistic regression on the pool's standardised pixels, scored on the held-out half."""
    from sklearn.linear_model import LogisticRegression

    from vlm_vit.eval import read_class_folder
    from vlm_vit.processor import NORMALIZATION, ImageProcessor

    out, report, _ = tiny_demo
    files, labels, _ = read_class_folder(out / "data" / "digits")
    _, pool, _, test = demo_splits(labels, seed=0)
    mean, std = NORMALIZATION["inception"]
    pixels = ImageProcessor(size=32, mean=mean, std=std)([str(f) for f in files])
    pixels = pixels.flatten(1).numpy().astype(np.float64)
    centre, scale = pixels[pool].mean(0), pixels[pool].std(0) + 1e-5  # big_vision's epsilon
    probe = LogisticRegression(max_iter=1000).fit((pixels[pool] - centre) / scale, labels[pool])
    expected = float(np.mean(probe.predict((pixels[test] - centre) / scale) == labels[test]))
    assert report["pixels"]["linear_probe_accuracy"] == expected
    assert report["pixels"]["logistic_accuracy"]["all"]["per_seed"] == \
        [report["pixels"]["linear_probe_accuracy"]] * 2


def test_the_terminal_table_carries_the_report(tiny_demo):
    _, report, printed = tiny_demo
    lines = printed.splitlines()
    assert lines[lines.index(next(line for line in lines if line.startswith("| held-out")))] \
        == "| held-out accuracy (chance 0.10) | raw pixels | scratch | mae |"

    def cells(start: str) -> list[str]:
        row = next(line for line in lines if line.startswith(f"| {start}"))
        return [cell.strip() for cell in row.strip("|").split("|")][1:]

    for key, label in (("1", "1 per class"), ("all", "all labels (8 per class)")):
        spreads = [report["pixels"]["logistic_accuracy"][key]] + [
            report["arms"][arm]["finetune_accuracy"][key] for arm in ("scratch", "mae")]
        assert cells(f"fine-tune, {label}") == [
            f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})" for s in spreads]
    for start, metric in (("frozen linear probe", "linear_probe_accuracy"),
                          ("frozen k-NN", "knn_accuracy")):
        assert cells(start) == [f"{report['pixels'][metric]:.3f}"] + [
            f"{report['arms'][arm][metric]:.3f}" for arm in ("scratch", "mae")]
    assert cells("fine-tuning recipe") == ["-", "lr 0.01, 120 steps", "lr 0.01, 120 steps"]
    assert "as --finetune-lr / --finetune-steps set it" in printed


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
    (["--sweep", "--finetune-lr", "1e-3"],
     "--sweep chooses each arm's fine-tuning lr and steps: drop --finetune-lr, or --sweep"),
    (["--finetune-lr", "0"], "--finetune-lr must be positive, got 0.0"),
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
    # Not requirements: joblib (psutil), scikit-learn (rich, and pandas in
    # sklearn.utils.fixes), torch's inductor (colorama) and numpy's f2py (charset-normalizer)
    # import these only when they are installed (the dev extra's docs tools bring colorama and
    # charset-normalizer, its executorch pandas); the plugins installed here add their
    # commands to any CLI run.
    optional = {"psutil", "rich", "colorama", "charset-normalizer", "pandas", "vlm-vit-llm",
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
    assert report["arms"][objective]["pretraining"]["objective"] == objective
    assert report["arms"][objective]["pretraining"]["steps"] == 3
    assert list(report["arms"]) == ["scratch", objective]
    state = torch.load(out / "runs" / objective / "objective.pt", weights_only=True)
    exported = load_encoder(out / "encoders" / objective).state_dict()
    assert exported
    for name, value in exported.items():
        assert torch.equal(value, state[f"student.{name}"]), name
    assert any(not torch.equal(value, state[f"encoder.{name}"])
               for name, value in exported.items())  # not the teacher



def test_an_arm_pretrains_the_same_whichever_arms_ran_before(tmp_path):
    """`--arms mae` and `--arms mpp mae` give mae the same encoder: its objective's own layers
    start from the seed, not from the RNG the earlier arms left."""
    quick = ["--steps", "2", "--batch-size", "16", "--images-per-class", "20", "--width", "32",
             "--depth", "1", "--shots", "1", "--finetune-steps", "1", "--seeds", "1",
             "--labels", "1", "--quiet"]
    runs = {}
    for arms in (["mae"], ["mpp", "mae"]):
        out = tmp_path / "-".join(arms)
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["demo", "--out", str(out), "--arms", *arms, *quick]) == 0
        runs[len(arms)] = load_encoder(out / "encoders" / "mae")
    assert fingerprint(runs[1]) == fingerprint(runs[2])

def test_quick_sweep_chooses_on_validation_before_the_held_out_half_is_read(
        tmp_path, monkeypatch):
    """`--quick --sweep` end to end, with every use of labelled rows recorded in order: the
    sweep's runs train on the labelled pool and are scored on the validation split only, each
    arm's recipe is the best of its own trials there, and nothing touches the held-out half
    until the sweep is over."""
    import vlm_vit.recipes.demo_scoring as scoring
    import vlm_vit.recipes.label_efficiency as label_efficiency
    from vlm_vit.recipes import demo_state

    monkeypatch.setattr(scoring, "SWEEP_GRID", {"lr": (1e-3, 1e-2), "steps": (5, 30)})
    uses = []  # (what, rows trained on, rows scored, results), in call order
    finetune_many, probes = label_efficiency.finetune_many, scoring.probes

    def recorded_finetune_many(jobs, images, labels, eval_rows, recipe, **kwargs):
        results = finetune_many(jobs, images, labels, eval_rows, recipe, **kwargs)
        uses.extend(("finetune", set(job.train_rows), set(eval_rows), (job.recipe, result))
                    for job, result in zip(jobs, results, strict=True))
        return results

    def recorded_probes(features, labels, train, test, shots, seed):
        uses.append(("probes", set(train), set(test), None))
        return probes(features, labels, train, test, shots, seed)

    monkeypatch.setattr(label_efficiency, "finetune_many", recorded_finetune_many)
    monkeypatch.setattr(scoring, "probes", recorded_probes)
    out = tmp_path / "demo"
    argv = ["demo", "--out", str(out), "--quick", "--sweep", "--steps", "3", "--batch-size",
            "16", "--images-per-class", "20", "--width", "32", "--depth", "1", "--shots", "1",
            "--labels", "1", "all", "--workers", "1", "--quiet"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())

    from vlm_vit.eval import read_class_folder
    _, labels, _ = read_class_folder(out / "data" / "digits")
    _, pool, validation, test = demo_splits(labels, seed=0)
    pool, validation, test = set(pool), set(validation), set(test)
    first_test = next(index for index, use in enumerate(uses) if use[2] & test)
    sweep_uses = [use for use in uses if use[2] == validation]
    assert len(sweep_uses) == 2 * 4  # two arms x four trials, all before the held-out half
    assert uses[:first_test] == sweep_uses
    for _, trained, scored, _ in uses:
        assert trained <= pool and not trained & scored and scored in (validation, test)
    for arm, tried in report["sweep"]["trials"].items():
        assert len(tried) == 4
        best = max(tried, key=lambda trial: trial["accuracy"])
        assert report["arms"][arm]["recipe"]["lr"] == best["lr"]
        assert report["arms"][arm]["recipe"]["steps"] == best["steps"]
    # What the report calls each trial's accuracy is what its validation run returned.
    returned = sorted((recipe.lr, recipe.steps, result) for _, _, _, (recipe, result)
                      in sweep_uses)
    assert returned == sorted((trial["lr"], trial["steps"], trial["accuracy"])
                              for tried in report["sweep"]["trials"].values()
                              for trial in tried)
    assert report["finetune"]["recipes_from"] == "sweep" and report["finetune"]["seeds"] == 1
    assert "| scratch |" in printed.getvalue() and "* chosen" in printed.getvalue()
    recorded = json.loads((out / demo_state.STATE_NAME).read_text())["finetune_accuracy"]
    assert sum(key.startswith("sweep/") for key in recorded) == 8


@pytest.mark.parametrize("argv, expected", [
    ([], {"scratch": (3e-4, 1000), "mae": (3e-3, 1000)}),
    (["--arms", "mpp", "capi", "--finetune-lr", "5e-4"],
     {"mpp": (5e-4, 1000), "capi": (5e-4, 1000)}),
    (["--objective", "ibot", "--finetune-steps", "7"], {"scratch": (3e-4, 7), "ibot": (3e-3, 7)}),
])
def test_each_arm_fine_tunes_with_the_recipe_the_full_sweep_chose(argv, expected):
    """Without --sweep, each arm's recipe is what `--arms all --sweep` chose on validation
    (docs/demo.md's table); a flag overrides only what it names."""
    from vlm_vit.cli import build_parser
    from vlm_vit.recipes.demo import _schedule

    schedule = _schedule(build_parser().parse_args(["demo", *argv]))
    assert {arm: (recipe["lr"], recipe["steps"]) for arm, recipe in
            schedule["recipes"].items()} == expected
