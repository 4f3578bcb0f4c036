"""`benchmarks/fsdp_memory.py`: FSDP2 against DDP, measured at toy size on two gloo processes
(and on every GPU where there is CUDA), and the arithmetic of its projections."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def fsdp_memory(monkeypatch):
    """benchmarks/fsdp_memory.py as a module (benchmarks/ is a folder of scripts)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("fsdp_memory")


def run(arguments: list[str], out: Path, timeout: float) -> dict:
    finished = subprocess.run([sys.executable, str(BENCHMARKS / "fsdp_memory.py"), *arguments,
                               "--json", str(out)], capture_output=True, text=True,
                              timeout=timeout)
    assert finished.returncode == 0, (finished.stdout + finished.stderr)[-4000:]
    return json.loads(out.read_text())


def check_measurement(result: dict) -> None:
    """The fields every run writes, with values only a real measurement gives."""
    parameters = result["parameters"]
    for strategy in ("ddp", "fsdp"):
        row = result[strategy]
        assert set(row["held_bytes_by_kind"]) == {"parameters", "gradients", "optimizer"}
        assert row["held_bytes_per_rank"] == sum(row["held_bytes_by_kind"].values())
        assert row["peak_memory_bytes_per_rank"] > row["held_bytes_per_rank"]
        assert len(row["every_rank"]) == result["ranks"]
        assert row["median_step_seconds"] > 0 and len(row["step_seconds"]) == result["timed_steps"]
    for field in ("memory_ratio_fsdp_over_ddp", "peak_memory_ratio_fsdp_over_ddp",
                  "time_ratio_fsdp_over_ddp"):
        assert math.isfinite(result[field]) and result[field] > 0, field
    assert {row["ranks"] for row in result["projection"]} == {8, 64}
    assert all(row["fsdp_gb"] < row["ddp_gb"] for row in result["projection"])
    # Both keep float32 weights (bf16 is autocast, or FSDP2's gathers): DDP all of them.
    assert result["ddp"]["held_bytes_by_kind"]["parameters"] == 4 * parameters


@pytest.mark.slow  # two torchrun launches of two processes each: ~35 s on two cores
def test_tiny_preset_holds_half_the_state_per_rank_under_fsdp(fsdp_memory, tmp_path,
                                                              monkeypatch):
    result = run(["--tiny"], tmp_path / "tiny.json", timeout=180)
    check_measurement(result)
    ddp, fsdp = result["ddp"], result["fsdp"]
    assert result["ranks"] == 2 and result["backend"] == "gloo"
    # Float32 AdamW under DDP: 4 + 4 + 8 bytes for every parameter on every rank.
    assert ddp["held_bytes_by_kind"]["gradients"] == 4 * result["parameters"]
    assert ddp["bytes_per_parameter_per_rank"] == pytest.approx(16, abs=0.01)
    # FSDP2: each rank a half (dim-0 shards: the larger half, plus padding) of each.
    assert fsdp["held_bytes_per_rank"] < ddp["held_bytes_per_rank"]
    assert result["memory_ratio_fsdp_over_ddp"] <= 0.55
    for kind, held in fsdp["held_bytes_by_kind"].items():
        assert ddp["held_bytes_by_kind"][kind] / 2 <= held < ddp["held_bytes_by_kind"][kind]
    # gpu_suite's FSDP2 lines and run_all's README rows read this result.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    lines = importlib.import_module("gpu_suite").fsdp_summary({"fsdp memory": result})
    assert "FSDP2" in "\n".join(lines) and len(lines) == 4
    environment = {"machine": "m", "date": "d", "python": "p", "versions": "v"}
    table = importlib.import_module("run_all").markdown_table({"fsdp memory": result},
                                                              environment, "command")
    assert ("| fsdp memory | weights+grads+AdamW per rank, FSDP2 vs DDP | 0.5" in table
            and "| <= 0.55 (met) | vit-ti/16, 2 of 12 blocks, 2 ranks (gloo), batch 1," in table)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL FSDP2 needs a CUDA device")
def test_every_gpu_runs_fsdp2_against_ddp_in_bf16(tmp_path):
    result = run(["--device", "cuda", "--dtype", "bfloat16", "--variant", "vit-b/16",
                  "--image-size", "224", "--batch-size", "16", "--steps", "3"],
                 tmp_path / "gpu.json", timeout=600)
    check_measurement(result)
    assert result["ranks"] == torch.cuda.device_count() and result["backend"] == "nccl"
    assert result["peak_memory_kind"] == "cuda max_memory_allocated"
    # 1/N of the state per rank (over a one-rank group on one GPU: all of it)
    assert result["memory_ratio_fsdp_over_ddp"] <= 1 / result["ranks"] + 0.05


def test_projection_is_the_measured_bytes_per_parameter_scaled(fsdp_memory):
    shape = fsdp_memory.ModelShape("m", parameters=10**9, trainable=10**9, root=10**6,
                                   root_trainable=10**6, block=10**7, block_trainable=10**7)
    measured = {"ddp": {"parameters": 4.0, "gradients": 4.0, "optimizer": 8.0},
                "fsdp": {"parameters": 4.0, "gradients": 4.0, "optimizer": 8.0}}
    row = fsdp_memory.project(shape, measured, ranks=8)
    assert row["ddp_gb"] == pytest.approx(16.0)
    assert row["fsdp_sharded_state_gb"] == pytest.approx(2.0)
    # float32 weights of the root and two blocks, gradients of the root and one block
    assert row["fsdp_gathered_gb"] == pytest.approx(4 * (1e6 + 2e7 + 1e6 + 1e7) / 1e9)
    assert row["fsdp_gb"] == pytest.approx(2.0 + row["fsdp_gathered_gb"])
    frozen = fsdp_memory.ModelShape("f", parameters=10**9, trainable=0, root=0,
                                    root_trainable=0, block=10**7, block_trainable=0)
    assert fsdp_memory.project(frozen, measured, ranks=1)["ddp_gb"] == pytest.approx(4.0)


def test_projected_models_have_their_published_sizes(fsdp_memory):
    vit_g = fsdp_memory.vit_g14_mae()
    # Zhai et al. report 1011M parameters for ViT-g/14; MAE's decoder adds ~26M.
    assert 1.035e9 < vit_g.parameters < 1.04e9 and vit_g.parameters == vit_g.trainable
    assert vit_g.block == 25_250_176  # one 1408-wide block with its 6144 MLP
    llava = fsdp_memory.llava_7b_stage2()
    assert llava.trainable - fsdp_memory.LLAVA_PROJECTOR == 6_738_415_616  # LLaMA-2-7B
    assert 0.30e9 < llava.parameters - llava.trainable < 0.31e9  # the frozen CLIP ViT-L/14-336


def test_llama_layer_count_matches_transformers(fsdp_memory):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=344,
                                      num_hidden_layers=2, num_attention_heads=4)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert layer == fsdp_memory.llama_layer_parameters(128, 344)
