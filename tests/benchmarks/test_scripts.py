"""The benchmark scripts run end to end at toy sizes (one iteration each, the `tiny` preset of
`benchmarks/run_all.py`), so they cannot rot. No timing is asserted: the figures are only
checked to be there and finite. The scripts run in this process (their imports are paid once);
`run_all.py` and `gpu_suite.py`, which start a process per script, each run one cheap script.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytest.importorskip("timm")
pytest.importorskip("transformers")
pytest.importorskip("open_clip")
pytest.importorskip("peft")


@pytest.fixture
def benchmarks(monkeypatch):
    """benchmarks/ importable (it is a folder of scripts, not a package); global torch state
    the scripts set (denormal flushing) restored afterwards."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    yield lambda name: importlib.import_module(name)
    torch.set_flush_denormal(False)


def run_script(benchmarks, monkeypatch, tmp_path, name: str, extra: tuple = ()) -> dict:
    """Runs the `tiny` preset's arguments of benchmark `name` in this process."""
    run_all = benchmarks("run_all")
    script = run_all.BENCHMARKS[name][0]
    out = tmp_path / "result.json"
    arguments = [*run_all.PRESETS["tiny"][name], *extra, "--json", str(out)]
    monkeypatch.setattr(sys, "argv", [script, *arguments])
    benchmarks(script.removesuffix(".py")).main()
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", ["encode vit-b/16", "encode clip-vit-b/16",
                                  "encode clip-vit-l/14-336", "llava features", "load",
                                  "mae step", "lora step", "llava step", "scaling",
                                  pytest.param("shards vs folder", marks=pytest.mark.slow),
                                  "export cpu", "window attention",
                                  "encode dinov2-l/14", "anyres",
                                  pytest.param("llava packed step", marks=pytest.mark.slow),
                                  pytest.param("qwen-vl packed step", marks=pytest.mark.slow),
                                  "ibot step", "ibot native vs square", "ijepa step",
                                  "capi step", "stage-1 cache step", "encode towers 2026",
                                  "qwen3-vl tower", "video processor"])
def test_tiny_benchmark_runs(benchmarks, monkeypatch, tmp_path, name):
    if name in ("llava step", "llava packed step", "qwen-vl packed step", "stage-1 cache step",
                "video processor"):
        pytest.importorskip("vlm_vit_llm")
    if name == "export cpu":
        pytest.importorskip("onnxruntime")
    if name.startswith(("ibot", "ijepa", "capi")):  # scikit-image's photos; lightly is the anchor
        for module in ("lightly", "skimage", "torchvision"):
            pytest.importorskip(module)
    memory_children = ("mae step", "lora step", "llava step", "llava packed step",
                       "qwen-vl packed step", "anyres",
                       "ibot step", "ijepa step", "capi step")
    extra = ("--no-memory",) if name in memory_children else ()  # children: below
    result = run_script(benchmarks, monkeypatch, tmp_path, name, extra)
    rows = benchmarks("run_all").headline_rows({name: result})
    expected = [field for field, *_ in benchmarks("run_all").BENCHMARKS[name][1]
                if "memory" not in field]
    assert len(rows) == len(expected)
    assert all(math.isfinite(value) and value > 0 for _, _, value, _ in rows)
    if name == "video processor":  # the same pixels, or the ratios mean nothing
        assert result["qwen3_vl_max_abs_difference"] == result["qwen2_vl_max_abs_difference"] == 0
    if name == "encode clip-vit-b/16":
        assert set(result["images_per_second"]) == {"vlm-vit", "timm", "transformers",
                                                    "open_clip"}
        assert max(result["max_abs_difference"].values()) < 1e-4  # truly the same weights
    if name == "llava features":
        assert result["max_abs_difference"] < 1e-4
    if name == "qwen-vl packed step":  # the same weights and records on both sides
        assert result["loss_difference_packed_vs_hf"] < 1e-4
    if name == "window attention":  # the same weights, windows cut at the grid's edge
        assert result["settings"]["grid"] == [4, 8]
        assert max(result["max_abs_difference"].values()) < 1e-4
    if name == "llava step":
        assert result["max_abs_logit_difference"] < 1e-4
    if name == "encode towers 2026":  # timm's build and ours on the same weights
        assert set(result["towers"]) == {"dinov3-l", "aimv2-l", "internvit-300m"}
        assert max(tower["max_abs_difference"] for tower in result["towers"].values()) < 1e-5
    if name == "qwen3-vl tower":  # the merger and every DeepStack tap, on the same weights
        assert result["max_abs_difference"] < 1e-5 and result["tokens"] == 28
    if name == "stage-1 cache step":  # every timed step hit, on the bytes a miss computed
        assert result["loss_difference"] == 0.0 and result["entry_kib"] > 0
    if name == "encode dinov2-l/14":  # the same weights in all three libraries
        assert max(result["max_abs_difference"].values()) < 1e-4
    if name == "anyres":  # the same weights and pixels, packed alike
        assert result["max_abs_difference"] < 1e-4
        assert result["max_abs_pixel_difference"] < 1e-4
    if name == "ibot step":  # the same step on the same weights, crops and masks
        assert set(result["step_seconds"]) == set(result["first_step_losses"]) == {
            "vlm-vit", "lightly"}
        assert result["loss_relative_difference"] <= result["loss_tolerance"] == 1e-4
        assert set(result["first_step_losses"]["lightly"]) == {"loss", "dino", "ibot", "koleo"}
        assert result["cpu"] and result["threads"] >= 1 and result["peak_memory_mib"] == {}
    if name in ("ijepa step", "capi step"):  # the same step on the same weights and masks
        assert set(result["step_seconds"]) == set(result["first_step_losses"]) == {
            "vlm-vit", "lightly"}
        assert result["loss_relative_difference"] <= result["loss_tolerance"] == 1e-4
        assert result["cpu"] and result["peak_memory_mib"] == {}
    if name == "ibot native vs square":
        views = result["batch_size"] * (2 + result["local_crops"])
        assert len(result["view_sizes"]) == len(result["padded_sides"]) == views
        assert all(side == max(size) for size, side in zip(
            result["view_sizes"], result["padded_sides"], strict=True))
        tokens = result["tokens_processed"]
        assert set(tokens) == set(result["step_seconds"]) == {"native", "padded"}
        assert 0 < tokens["native"] <= tokens["padded"]
        assert all(math.isfinite(losses["loss"])
                   for losses in result["first_step_losses"].values())
        assert result["cpu"] and "notes" in result


def test_packed_vs_padded_runs(benchmarks, monkeypatch, tmp_path):
    # Memory children are left out here (the child test below runs one).
    result = run_script(benchmarks, monkeypatch, tmp_path, "packed vs padded", ("--no-memory",))
    candidates = {"packed", "one at a time", "padded", "naflexvit"}
    assert set(result["images_per_second"]) == set(result["tokens_per_second"]) == candidates
    rates = [*result["images_per_second"].values(), *result["tokens_per_second"].values()]
    assert all(math.isfinite(value) and value > 0 for value in rates)
    assert all(0 < share < 1 for share in result["padding_waste_share"].values())
    # every candidate encodes the same model: checked in the script, reported here
    assert max(result["max_abs_difference"].values()) < 1e-4
    assert set(result["max_abs_difference"]) == (candidates - {"one at a time"}) | {
        "naflexvit_native"}
    rows = benchmarks("run_all").headline_rows({"packed vs padded": result})
    speed = [field for field, *_ in benchmarks("run_all").BENCHMARKS["packed vs padded"][1]
             if not field.startswith("memory_ratio")]
    assert len(rows) == len(speed)
    assert all(math.isfinite(value) and value > 0 for _, _, value, _ in rows)


@pytest.mark.parametrize("script, arguments", [
    # The full fine-tune's child: no peft import, so a few seconds.
    ("lora_step_vs_full.py", ["--child", "full", "--variant", "vit-ti/16", "--depth", "1",
                              "--image-size", "32", "--batch-size", "2"]),
    ("packed_vs_padded.py", ["--child", "padded", "--variant", "vit-ti/16", "--depth", "1",
                             "--images", "4", "--shrink", "4"]),
    # Ours: the child builds lightly's model too (the weights come from it), then drops it.
    pytest.param("ibot_step_vs_lightly.py", [
        "--child", "vlm-vit", "--variant", "vit-ti/16", "--depth", "1", "--image-size", "32",
        "--local-size", "16", "--local-crops", "2", "--batch-size", "2", "--prototypes", "64",
        "--head-hidden", "32", "--head-bottleneck", "16"], marks=pytest.mark.skipif(
            importlib.util.find_spec("lightly") is None, reason="needs lightly")),
])
def test_peak_memory_child_prints_a_number(script, arguments):
    finished = subprocess.run([sys.executable, str(BENCHMARKS / script), *arguments],
                              capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert float(finished.stdout.strip().splitlines()[-1]) >= 0


def test_run_all_writes_json_and_only_the_table_block_of_each_page(benchmarks, tmp_path):
    pages = [tmp_path / "benchmarks.md", tmp_path / "README.md"]
    for page in pages:
        page.write_text("# x\n\nkept\n<!-- benchmarks:start -->\nold\n<!-- benchmarks:end -->"
                        "\ntail\n")
    out = tmp_path / "results.json"
    status = benchmarks("run_all").main(["--preset", "tiny", "--only", "encode vit-b/16",
                                         "--out", str(out), "--docs", *map(str, pages)])
    assert status == 0
    saved = json.loads(out.read_text())
    assert saved["preset"] == "tiny" and set(saved["results"]) == {"encode vit-b/16"}
    assert set(saved["environment"]) == {"machine", "date", "python", "versions"}
    for page in pages:
        text = page.read_text()
        assert text.startswith("# x\n\nkept\n<!-- benchmarks:start -->\nMeasured by `python "
                               f"benchmarks/run_all.py --docs {pages[0]} {pages[1]} --preset "
                               "tiny --only 'encode vit-b/16'`")
        assert text.endswith("<!-- benchmarks:end -->\ntail\n") and "old" not in text
        assert "| encode vit-b/16 | speed vs timm |" in text


def test_replace_block_needs_the_markers(benchmarks):
    with pytest.raises(ValueError, match="benchmarks:start"):
        benchmarks("run_all").replace_block("no markers here", "table")


def test_gpu_suite_without_cuda_says_so(benchmarks, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert benchmarks("gpu_suite").main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_gpu_suite_tiny_runs_the_bf16_logic_on_cpu(benchmarks, tmp_path, capsys):
    out = tmp_path / "gpu.json"
    status = benchmarks("gpu_suite").main(["--tiny", "--only", "encode clip-vit-l/14-336",
                                           "--out", str(out)])
    assert status == 0
    result = json.loads(out.read_text())["results"]["encode clip-vit-l/14-336"]
    assert result["dtype"] == "bfloat16" and result["fraction_of_matmul_peak"] > 0
    assert "MFU" in capsys.readouterr().out


@pytest.mark.slow  # 45-70 s: four child processes loading CLIP through transformers
def test_sharded_load_memory_runs_at_toy_size(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "shards.json"
    finished = subprocess.run(
        [sys.executable, str(BENCHMARKS / "sharded_load_memory.py"), "--variant",
         "clip-vit-b/32", "--depth", "1", "--shard-size", "200KB", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=BENCHMARKS)
    assert finished.returncode == 0, finished.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["shards"] > 1
    assert set(result["peak_mb"]) == {"ours, one file", "ours, sharded",
                                      "transformers, one file", "transformers, sharded"}
    assert all(value > 0 for value in result["peak_mb"].values())


def test_a_verdict_can_be_read_from_the_figure_beside_it(benchmarks):
    run_all = benchmarks("run_all")
    assert run_all.shown(0.8496, ">= 0.85") == "0.8496"  # 0.850 would read as met
    assert run_all.shown(0.84996, ">= 0.85") == "0.84996"
    assert run_all.shown(0.8504, ">= 0.85") == "0.850"  # rounds onto the bound and meets it
    assert run_all.shown(1.23456, "") == "1.235"
    assert run_all.shown(0.70049, "<= 0.7") == "0.7005"
    assert run_all.shown(0.99996, "< 1.0") == "0.99996"  # strict: 1.000 would not meet it
    assert run_all.shown(1.0, "< 1.0") == "1.000" and not run_all._meets(1.0, "< 1.0")


def test_table_rows_of_one_benchmark_replace_only_its_own(benchmarks):
    run_all = benchmarks("run_all")
    env = {"machine": "M", "date": "D", "python": "3", "versions": "torch 2"}
    old = run_all.markdown_table({
        "load": {"ratio_vlm_vit_over_transformers": 1.5},
        "mae step": {"speed_ratio_vlm_vit_over_transformers": 0.9, "variant": "vit-b/16"}},
        env, "python benchmarks/run_all.py --docs")
    new = run_all.merged_block(old, {"mae step": {
        "speed_ratio_vlm_vit_over_transformers": 1.25, "variant": "vit-b/16"}}, env,
        "python benchmarks/run_all.py --docs --only 'mae step'")
    lines = new.splitlines()
    assert lines[0] == old.splitlines()[0]  # how the other rows were measured stays
    assert lines[1].startswith("Rows of mae step: measured by `python benchmarks/run_all.py "
                               "--docs --only 'mae step'`")
    rows = [line for line in lines if line.startswith("| ") and "benchmark |" not in line]
    assert rows == ["| load | time vs HF from_pretrained | 1.500 |  |  |",
                    "| mae step | speed vs ViTMAEForPreTraining | 1.250 | >= 1.2 (met) | "
                    "vit-b/16 |"]
    again = run_all.merged_block(new, {"mae step": {
        "speed_ratio_vlm_vit_over_transformers": 1.1}}, env, "again")
    assert again.count("Rows of mae step") == 1 and "1.100" in again and "1.250" not in again
