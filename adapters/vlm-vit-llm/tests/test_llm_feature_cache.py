"""Stage 1 through the frozen tower's feature cache (`llm train --cache`; issue 46): a run
that fills the cache and one that reads it give bit-identical loss curves, and the run
without it the same within rounding (the encoder's kernels are not bit-invariant to a
batch's order); stage 2 and a size without a cache are one-line errors."""

import csv

import pytest
from test_llm_cli import train_args
from test_llm_train import fit, write_captions

from vlm_vit.cli import main
from vlm_vit.io.encode_cache import EncodeCache
from vlm_vit.io.feature_cache import cache_tower_features
from vlm_vit_llm import MultimodalLM


def losses(run_dir):
    with open(run_dir / "metrics.csv", newline="") as handle:
        return [row["loss"] for row in csv.DictReader(handle)]


def test_stage_1_from_the_cache_repeats_the_loss_curve(tmp_path, tokenizer):
    from conftest import tiny_llm, tiny_tower

    data = tmp_path / "data"
    write_captions(data)
    curves = []
    cache = EncodeCache(tmp_path / "cache")
    for name, cached in (("plain", False), ("cold", True), ("warm", True)):
        mm = MultimodalLM(tiny_tower(), tiny_llm(), tokenizer).train_projector_only()
        if cached:
            cache_tower_features(mm.tower, cache)
        curves.append(fit(mm, data, tmp_path / name, steps=6, lr=1e-2).losses)
    plain, cold, warm = curves
    assert len(set(cold)) > 1 and cold == warm  # the warm run read every feature
    assert cache.misses == 4 and cache.hits == 5 * 4 + 6 * 4  # cold: the first batch missed
    # a hit holds the bytes of the batch that first computed it; a batch in another order
    # differs by up to 6e-8 in the features, 1.1e-5 relative in the sixth step's loss here
    assert plain[0] == cold[0] and plain == pytest.approx(cold, rel=1e-4, abs=0)


def test_llm_train_cache_through_the_cli(parts, capsys):
    start = ["--tower", str(parts / "encoder"), "--llm", str(parts / "llm")]
    cache = ["--cache", str(parts / "cache"), "--steps", "4"]
    assert main(train_args(parts, *start, *cache, "--out", str(parts / "a"))) == 0
    assert "4 hit(s), 4 miss(es)" in capsys.readouterr().out
    assert main(train_args(parts, *start, *cache, "--out", str(parts / "b"))) == 0
    assert "8 hit(s), 0 miss(es)" in capsys.readouterr().out
    assert losses(parts / "a") == losses(parts / "b")


@pytest.mark.parametrize(("extra", "message"), [
    (["--cache", "c", "--stage", "2"], "--cache is for stage 1, where the tower is frozen"),
    (["--cache-max-gb", "1"], "--cache-max-gb needs --cache and a size above 0, got 1.0"),
    (["--cache", "c", "--cache-max-gb", "0"], "--cache-max-gb needs --cache and a size above 0"),
])
def test_cache_flag_errors_are_one_line(parts, capsys, extra, message):
    args = train_args(parts, "--tower", str(parts / "encoder"), "--llm", str(parts / "llm"),
                      "--out", str(parts / "run"), *extra)
    assert main(args) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert not (parts / "c").exists() and not (parts / "run").exists()
