"""Every side-by-side benchmark in one command, a table at the end, everything as JSON.

    python benchmarks/run_all.py --out benchmarks.json           # the reference sizes, CPU
    python benchmarks/run_all.py --out benchmarks.json --docs  # and rewrite the docs' table
    python benchmarks/run_all.py --only 'ibot step' --docs README.md docs/benchmarks.md
    python benchmarks/run_all.py --preset quick                  # small sizes, minutes on a CPU
    python benchmarks/run_all.py --preset gpu                    # bf16 on a GPU (gpu_suite.py)

Each script runs in its own process (so one's memory does not colour another's) and writes
its own JSON; the headline figure of each is a ratio against the anchor library, measured in
that one process, so it carries over between machines where absolute times do not. The
`tiny` preset runs every script for one iteration at toy sizes (the tests use it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import operator
import platform
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from timing import cpu_name

HERE = Path(__file__).resolve().parent
TABLE_PAGE = HERE.parent / "docs" / "benchmarks.md"  # the table between MARKERS
MARKERS = ("<!-- benchmarks:start -->", "<!-- benchmarks:end -->")

_EXPORT_ROWS = [  # export_cpu.py's headline figures, at each size it runs at
    ("ratio_onnxruntime_over_ours_float32", "ONNX Runtime float32 vs our eager float32",
     ">= 1.0"),
    ("ratio_ours_over_timm_float32", "eager float32 vs timm float32", ""),
    ("ratio_ours_over_timm_bf16", "eager bf16 (autocast) vs timm bf16", ">= 1.0"),
    ("ratio_ours_over_timm_int8", "eager int8 vs timm int8", ""),
    ("ratio_onnxruntime_int8_over_ours_float32", "ONNX Runtime int8 vs our float32", "")]

# name -> (script, the JSON fields to headline: (field, how to read it, target))
BENCHMARKS = {
    "encode vit-b/16": ("encode_vs_timm.py", [
        ("ratio_vlm_vit_over_timm", "speed vs timm", ">= 1.0"),
        ("fraction_of_matmul_peak", "share of matmul peak", ">= 0.85")]),
    "encode clip-vit-b/16": ("encode_vs_timm.py", [
        ("ratio_vlm_vit_over_timm", "speed vs timm", ">= 1.0"),
        ("ratio_vlm_vit_over_transformers", "speed vs HF CLIPVisionModel", ">= 1.05"),
        ("ratio_vlm_vit_over_open_clip", "speed vs open_clip", ">= 1.05"),
        ("fraction_of_matmul_peak", "share of matmul peak", ">= 0.85")]),
    "encode clip-vit-l/14-336": ("encode_vs_timm.py", [
        ("ratio_vlm_vit_over_timm", "speed vs timm", ">= 1.0"),
        ("fraction_of_matmul_peak", "share of matmul peak (MFU)", "")]),
    "llava features": ("llava_features_vs_hf.py", [
        ("ratio_vlm_vit_over_transformers", "speed vs HF hidden_states[-2]", ">= 1.08")]),
    "load": ("load_vs_hf.py", [
        ("ratio_vlm_vit_over_transformers", "time vs HF from_pretrained", "")]),
    "mae step": ("mae_step_vs_hf.py", [
        ("speed_ratio_vlm_vit_over_transformers", "speed vs ViTMAEForPreTraining", ">= 1.2")]),
    "lora step": ("lora_step_vs_full.py", [
        ("memory_ratio_lora_over_full", "peak memory vs full fine-tune", "<= 0.7"),
        ("time_ratio_lora_over_full", "step time vs full fine-tune", "")]),
    "llava step": ("llava_step_vs_hf.py", [
        ("forward_speed_ratio_vlm_vit_over_transformers", "forward speed vs HF LLaVA", ""),
        ("step_speed_ratio_vlm_vit_over_transformers", "stage-1 step speed vs HF LLaVA", ""),
        ("step_memory_ratio_vlm_vit_over_transformers", "stage-1 step memory vs HF LLaVA",
         "")]),
    "scaling": ("scaling.py", []),
    "packed vs padded": ("packed_vs_padded.py", [
        ("ratio_packed_over_naflexvit", "speed vs timm NaFlexVit (padded)", ">= 1.3"),
        ("ratio_packed_over_one_at_a_time", "speed vs one image at a time", ">= 1.2"),
        ("ratio_packed_over_padded", "speed vs ours padded with a mask", ""),
        ("memory_ratio_packed_over_padded", "peak memory vs ours padded", "<= 1.0"),
        ("memory_ratio_packed_over_naflexvit", "peak memory vs timm NaFlexVit", "<= 1.0")]),
    "shards vs folder": ("shards_vs_folder.py", [
        ("data_ratio_shards_over_folder_1", "data pipeline from shards vs a folder", ">= 1.0"),
        ("data_ratio_2_over_1_shards", "data pipeline, 2 processes vs 1 (shards)", ">= 1.6"),
        ("encode_ratio_shards_over_folder", "vlm-vit encode from shards vs a folder", ">= 1.0"),
        ("encode_ratio_2_over_1_shards", "vlm-vit encode, 2 processes vs 1 (shards)", "")]),
    "llava packed step": ("llava_packed_step.py", [
        ("stage1_speed_packed_over_padded", "stage-1 speed, packed vs ours padded", ">= 1.5"),
        ("stage1_speed_packed_over_hf_padded", "stage-1 speed, packed vs HF LLaVA padded",
         ">= 1.5"),
        ("stage2_speed_packed_over_padded", "stage-2 speed, packed vs ours padded", ">= 1.5"),
        ("stage2_speed_packed_over_hf_padded", "stage-2 speed, packed vs HF LLaVA padded",
         ">= 1.5"),
        ("stage1_memory_packed_over_padded", "stage-1 peak memory vs padded", "<= 1.0"),
        ("stage2_memory_packed_over_padded", "stage-2 peak memory vs padded", "<= 1.0")]),
    "qwen-vl packed step": ("qwen_vl_packed_step.py", [
        ("speed_packed_over_hf_padded", "stage-2 speed, packed vs HF Qwen2.5-VL padded",
         ">= 1.5"),
        ("memory_packed_over_hf_padded", "stage-2 peak memory vs HF Qwen2.5-VL padded",
         "<= 0.5"),
        ("speed_packed_over_padded", "stage-2 speed, packed vs ours padded", "")]),
    "encode towers 2026": ("towers_encode.py", [
        ("ratio_dinov3_l_vlm_vit_over_timm", "DINOv3-L encode speed vs timm", ">= 1.0"),
        ("ratio_aimv2_l_vlm_vit_over_timm", "AIMv2-L encode speed vs timm", ">= 1.0"),
        ("ratio_internvit_300m_vlm_vit_over_timm", "InternViT-300M encode speed vs timm",
         ">= 1.0")]),
    "qwen3-vl tower": ("qwen3_vl_tower.py", [
        ("speed_ratio_vlm_vit_over_transformers",
         "Qwen3-VL tower (merger + DeepStack) vs transformers", ">= 1.0")]),
    "video processor": ("video_processor.py", [
        ("speed_ratio_qwen3_vl_vlm_vit_over_transformers",
         "Qwen3-VL clip preprocessing vs transformers' video processor", ">= 1.0"),
        ("speed_ratio_qwen2_vl_vlm_vit_over_transformers",
         "Qwen2-VL clip preprocessing vs transformers' video processor", ">= 1.0")]),
    "stage-1 cache step": ("stage1_cache_step.py", [
        ("speed_ratio_cache_over_pixels", "stage-1 step, features from the cache vs pixels",
         "")]),
    "fsdp memory": ("fsdp_memory.py", [
        ("memory_ratio_fsdp_over_ddp", "weights+grads+AdamW per rank, FSDP2 vs DDP", "<= 0.55"),
        ("peak_memory_ratio_fsdp_over_ddp", "peak process memory per rank, FSDP2 vs DDP", ""),
        ("time_ratio_fsdp_over_ddp", "step time, FSDP2 vs DDP", "")]),
    "export cpu": ("export_cpu.py", _EXPORT_ROWS),
    "export cpu batch 1": ("export_cpu.py", _EXPORT_ROWS),
    "export cpu clip-vit-l/14-336": ("export_cpu.py", _EXPORT_ROWS),
    "encode dinov2-l/14": ("dinov2_encode.py", [
        ("ratio_vlm_vit_over_transformers", "speed vs transformers Dinov2Model", ">= 1.0"),
        ("ratio_vlm_vit_over_timm", "speed vs timm", ">= 1.0")]),
    "window attention": ("window_attention.py", [
        ("ratio_vlm_vit_over_transformers_sdpa",
         "Qwen2.5-VL tower speed vs transformers sdpa (per window)", ">= 1.0"),
        ("ratio_vlm_vit_over_transformers_eager",
         "Qwen2.5-VL tower speed vs transformers eager (per window)", "")]),
    "anyres": ("anyres.py", [
        ("ratio_vlm_vit_over_transformers", "speed vs HF LLaVA-NeXT", ">= 1.3"),
        # ours stops after the layer LLaVA reads (-2): a larger saving at 4 blocks than at 24
        ("ratio_per_block_run", "speed per block run vs HF LLaVA-NeXT", ""),
        ("memory_ratio_vlm_vit_over_transformers", "peak memory vs HF LLaVA-NeXT", "<= 1.0")]),
    "ibot step": ("ibot_step_vs_lightly.py", [
        ("speed_ratio_vlm_vit_over_lightly", "speed vs lightly's DINOv2 step", ">= 1.0"),
        ("memory_ratio_vlm_vit_over_lightly", "peak memory vs lightly's DINOv2 step",
         "<= 1.0")]),
    "ibot native vs square": ("ibot_native_vs_square.py", [
        ("token_ratio_native_over_padded", "tokens, native vs padded to squares", "< 1.0"),
        ("speed_ratio_native_over_padded", "speed, native packed vs padded squares",
         ">= 1.2")]),
    "ijepa step": ("ijepa_step_vs_lightly.py", [
        ("speed_ratio_vlm_vit_over_lightly", "speed vs lightly's I-JEPA step", ">= 1.0"),
        ("memory_ratio_vlm_vit_over_lightly", "peak memory vs lightly's I-JEPA step",
         "<= 1.0")]),
    "capi step": ("capi_step_vs_lightly.py", [
        ("speed_ratio_vlm_vit_over_lightly", "speed vs lightly's CAPI step", ">= 1.0"),
        ("memory_ratio_vlm_vit_over_lightly", "peak memory vs lightly's CAPI step",
         "<= 1.0")]),
}

_TINY = ["--depth", "1", "--image-size", "32", "--batch-size", "2", "--repeats", "1"]
_TINY_IBOT = ["--depth", "1", "--batch-size", "2", "--local-crops", "2", "--prototypes", "64",
              "--head-hidden", "32", "--head-bottleneck", "16", "--repeats", "1"]
# preset -> name -> arguments; a name missing from a preset is not run by it.
PRESETS: dict[str, dict[str, list[str]]] = {
    "reference": {
        "encode vit-b/16": ["--variant", "vit-b/16", "--anchors", "timm"],
        "encode clip-vit-b/16": ["--variant", "clip-vit-b/16"],
        "llava features": [],
        "load": [],
        "mae step": [],
        "lora step": [],
        "llava step": [],
        "scaling": [],
        "packed vs padded": [],
        "shards vs folder": [],
        "export cpu": ["--variant", "vit-b/16", "--batch-size", "8", "--repeats", "3"],
        "export cpu batch 1": ["--variant", "vit-b/16", "--batch-size", "1", "--repeats", "5"],
        # batch 1 only: at batch 8 its eight arms take over an hour on a 2-core CPU
        "export cpu clip-vit-l/14-336": ["--variant", "clip-vit-l/14-336", "--batch-size", "1",
                                         "--repeats", "3"],
        "llava packed step": [],
        "qwen-vl packed step": [],
        "stage-1 cache step": [],
        "encode towers 2026": [],
        "qwen3-vl tower": [],
        "video processor": [],
        # 10 of vit-l/16's 24 blocks: DDP's two ranks then peak at ~7.7 GB together (all 24
        # would take ~14 GB); bytes per parameter do not depend on the depth.
        "fsdp memory": ["--depth", "10"],
        "window attention": ["--hf-attention", "sdpa", "eager"],
        "encode dinov2-l/14": [],
        "anyres": [],
        "ibot step": [],
        "ibot native vs square": [],
        "ijepa step": [],
        "capi step": [],
    },
    "quick": {
        "encode vit-b/16": ["--variant", "vit-s/16", "--anchors", "timm", "--repeats", "5"],
        "encode clip-vit-b/16": ["--variant", "clip-vit-b/16", "--depth", "4", "--repeats", "5"],
        "llava features": ["--variant", "clip-vit-b/16", "--repeats", "3"],
        "load": ["--variant", "clip-vit-b/16"],
        "mae step": ["--variant", "vit-s/16", "--batch-size", "4", "--repeats", "3"],
        "lora step": ["--variant", "vit-s/16", "--batch-size", "4", "--repeats", "3"],
        "llava step": ["--variant", "clip-vit-b/32", "--llm-layers", "2", "--repeats", "3"],
        "scaling": ["--variant", "vit-ti/16", "--repeats", "2"],
        "packed vs padded": ["--variant", "vit-s/16", "--images", "16", "--repeats", "3"],
        "shards vs folder": ["--images", "1000", "--per-shard", "125", "--repeats", "2"],
        "export cpu": ["--variant", "vit-s/16", "--batch-size", "1", "--repeats", "3"],
        "llava packed step": ["--quick"],
        "qwen-vl packed step": ["--quick"],
        "stage-1 cache step": ["--llm-layers", "2", "--repeats", "3"],
        "encode towers 2026": ["--depth", "6", "--repeats", "3"],
        "qwen3-vl tower": ["--depth", "6", "--repeats", "3"],
        "video processor": ["--frames", "8", "--repeats", "3"],
        "fsdp memory": ["--quick"],
        "window attention": ["--depth", "4", "--repeats", "5"],
        "encode dinov2-l/14": ["--depth", "6", "--batch-size", "1", "--repeats", "3"],
        "anyres": ["--images", "3", "--repeats", "3"],
        "ibot step": ["--batch-size", "2", "--repeats", "3", "--warmup", "0"],
        "ibot native vs square": ["--batch-size", "2", "--repeats", "3"],
        "ijepa step": ["--variant", "vit-s/16", "--batch-size", "2", "--repeats", "3",
                       "--warmup", "0"],
        "capi step": ["--batch-size", "2", "--repeats", "3", "--warmup", "0"],
    },
    "tiny": {
        "encode vit-b/16": ["--variant", "vit-ti/16", "--anchors", "timm", *_TINY,
                            "--warmup", "0", "--peak-sides", "128"],
        "encode clip-vit-b/16": ["--variant", "clip-vit-b/16", *_TINY, "--warmup", "0",
                                 "--peak-sides", "128"],
        "encode clip-vit-l/14-336": ["--variant", "clip-vit-l/14-336", "--anchors", "timm",
                                     *_TINY, "--image-size", "28", "--warmup", "0",
                                     "--peak-sides", "128"],
        "llava features": ["--variant", "clip-vit-b/16", "--depth", "2", "--image-size", "32",
                           "--batch-size", "2", "--repeats", "1"],
        "load": ["--variant", "clip-vit-b/16", "--depth", "1", "--repeats", "1"],
        "mae step": ["--variant", "vit-ti/16", *_TINY],
        "lora step": ["--variant", "vit-ti/16", *_TINY],
        "llava step": ["--variant", "clip-vit-b/32", "--image-size", "64", "--llm-width", "128",
                       "--llm-layers", "1", "--batch-size", "1", "--repeats", "1"],
        "scaling": ["--variant", "vit-ti/16", "--depth", "1", "--batches", "1", "2",
                    "--sides", "32", "48", "--repeats", "1"],
        "packed vs padded": ["--variant", "vit-ti/16", "--depth", "1", "--images", "6",
                             "--shrink", "4", "--repeats", "1"],
        "shards vs folder": ["--images", "64", "--per-shard", "16", "--repeats", "1"],
        "export cpu": ["--variant", "vit-ti/16", "--depth", "1", "--image-size", "32",
                       "--batch-size", "2", "--repeats", "1", "--warmup", "0"],
        "llava packed step": ["--quick", "--llm-width", "64", "--llm-layers", "1",
                              "--batches", "1", "--batch-size", "2", "--repeats", "1"],
        "qwen-vl packed step": ["--quick", "--vision-depth", "4", "--llm-layers", "1",
                                "--llm-width", "64", "--batches", "1", "--batch-size", "2",
                                "--repeats", "1"],
        "stage-1 cache step": ["--depth", "1", "--image-size", "32", "--llm-width", "64",
                               "--llm-layers", "1", "--batch-size", "2", "--repeats", "1"],
        "encode towers 2026": ["--depth", "1", "--width", "64", "--image-size", "112",
                               "--repeats", "1", "--warmup", "0"],
        "qwen3-vl tower": ["--depth", "2", "--width", "144", "--sides", "64", "64", "32", "96",
                           "--repeats", "1", "--warmup", "0"],
        "video processor": ["--frames", "2", "--side", "48", "64", "--repeats", "1",
                            "--warmup", "0"],
        "fsdp memory": ["--tiny"],
        "window attention": ["--width", "64", "--depth", "2", "--heads", "2", "--mlp-width",
                             "96", "--height", "56", "--image-width", "112",
                             "--window-pixels", "56", "--hf-attention", "sdpa", "eager",
                             "--repeats", "1", "--warmup", "0"],
        "encode dinov2-l/14": ["--width", "64", "--depth", "2", "--heads", "2", "--image-size",
                               "28", "--registers", "4", "--repeats", "1", "--warmup", "0"],
        "anyres": ["--width", "64", "--depth", "2", "--heads", "2", "--mlp-width", "128",
                   "--tile-size", "28", "--llm-width", "32", "--images", "4", "--shrink", "8",
                   "--repeats", "1", "--warmup", "0"],
        "ibot step": ["--variant", "vit-ti/16", *_TINY_IBOT, "--image-size", "32",
                      "--local-size", "16", "--warmup", "0"],
        "ibot native vs square": ["--variant", "vit-ti/16", *_TINY_IBOT, "--image-size", "32",
                                  "--global-tokens", "12", "--local-tokens", "4"],
        # 10 x 10 patches: I-JEPA's target blocks then hold more than its min_keep of 10
        "ijepa step": ["--variant", "vit-ti/16", "--depth", "1", "--image-size", "160",
                       "--batch-size", "2", "--predictor-width", "48", "--predictor-depth",
                       "1", "--repeats", "1", "--warmup", "0"],
        "capi step": ["--variant", "vit-ti/16", "--depth", "1", "--image-size", "64",
                      "--batch-size", "2", "--clusters", "16", "--predictor-depth", "1",
                      "--predictor-heads", "3", "--repeats", "1", "--warmup", "0"],
    },
    "gpu": {  # gpu_suite.py: bf16 under autocast, sized to finish in one call of < 8 minutes
        "encode vit-b/16": ["--variant", "vit-b/16", "--anchors", "timm", "--batch-size", "256",
                            "--repeats", "20", "--warmup", "5"],
        "encode clip-vit-b/16": ["--variant", "clip-vit-b/16", "--batch-size", "256",
                                 "--repeats", "20", "--warmup", "5"],
        "encode clip-vit-l/14-336": ["--variant", "clip-vit-l/14-336", "--batch-size", "64",
                                     "--repeats", "10", "--warmup", "3"],
        "llava features": ["--batch-size", "64", "--repeats", "10"],
        "load": [],
        "mae step": ["--batch-size", "128", "--repeats", "10"],
        "lora step": ["--batch-size", "128", "--repeats", "10"],
        "scaling": ["--variant", "vit-b/16", "--batches", "1", "16", "64", "256",
                    "--sides", "224", "336", "448", "672", "--repeats", "5"],
        # torchrun on every visible GPU (NCCL), FSDP2 gathering bf16 weights
        "fsdp memory": ["--variant", "vit-l/16", "--image-size", "224", "--batch-size", "64",
                        "--steps", "10"],
    },
}


def run_benchmarks(preset: str, only: list[str] | None = None,
                   extra: list[str] | None = None) -> tuple[dict, list[str]]:
    """Runs the preset's benchmarks, each in its own process.

    Args:
        preset: a key of `PRESETS`.
        only: the names to run (default: all of the preset's).
        extra: arguments added to every script (`--device cpu`, say).

    Returns:
        The results by name and the names that failed.
    """
    results, failures = {}, []
    with tempfile.TemporaryDirectory() as scratch:
        for index, (name, arguments) in enumerate(PRESETS[preset].items()):
            if only and name not in only:
                continue
            script = BENCHMARKS[name][0]
            target = Path(scratch, f"{index}.json")
            command = [sys.executable, str(HERE / script), *arguments, *(extra or []),
                       "--json", str(target)]
            print(f"== {name}: {' '.join(command[1:-2])}", flush=True)
            finished = subprocess.run(command)
            if finished.returncode or not target.is_file():
                failures.append(name)
                continue
            results[name] = json.loads(target.read_text())
    return results, failures


def headline_rows(results: dict) -> list[tuple[str, str, float, str]]:
    """(benchmark, what, value, target) for every headline figure present in `results`."""
    rows = []
    for name, result in results.items():
        for field, label, target in BENCHMARKS[name][1]:
            if field in result:
                rows.append((name, label, result[field], target))
    return rows


def environment() -> dict[str, str]:
    """The machine and library versions the figures were measured with."""
    import torch

    versions = {}
    for package in ("torch", "timm", "transformers", "open_clip_torch", "peft"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "absent"
    if torch.cuda.is_available():
        machine = torch.cuda.get_device_name()
    else:
        machine = f"{cpu_name()}, {torch.get_num_threads()} threads"
    return {"machine": machine, "date": datetime.date.today().isoformat(),
            "python": platform.python_version(),
            "versions": ", ".join(f"{k} {v}" for k, v in versions.items())}


def markdown_table(results: dict, env: dict[str, str], command: str) -> str:
    """The table block: where and how it was measured, then one row per headline figure."""
    lines = [f"Measured by `{command}` on {env['machine']}, {env['date']} (Python "
             f"{env['python']}; {env['versions']}). Ratios above 1 mean vlm-vit is faster "
             "(time and memory ratios: below 1 is better).", "",
             "| benchmark | figure | measured | target | settings |", "|---|---|---|---|---|"]
    for name, label, value, target in headline_rows(results):
        result = results[name]
        settings = ", ".join(str(part) for part in (
            result.get("variant"), result.get("settings_note"),  # e.g. fewer blocks, ranks
            f"batch {result['batch_size']}" if "batch_size" in result
            else None, result.get("device"), result.get("dtype")) if part)
        met = "" if not target else (" (met)" if _meets(value, target) else " (not met)")
        lines.append(f"| {name} | {label} | {shown(value, target)} | {target}{met} | "
                     f"{settings} |")
    return "\n".join(lines)


def shown(value: float, target: str = "") -> str:
    """`value` with 3 decimals, or as many more (up to 6) as it takes for the verdict to be
    read from the table: 0.8496 against ">= 0.85" is "0.8496", never "0.850 (not met)"."""
    for decimals in range(3, 7):
        text = f"{value:.{decimals}f}"
        if not target or _meets(float(text), target) == _meets(value, target):
            return text
    return f"{value:.6g}"


def _meets(value: float, target: str) -> bool:
    comparison, bound = target.split()
    return {">=": operator.ge, ">": operator.gt, "<=": operator.le,
            "<": operator.lt}[comparison](value, float(bound))


def current_block(text: str) -> str:
    """What stands between the benchmark markers of `text` (empty without them)."""
    start, end = MARKERS
    found = re.search(re.escape(start) + r"(.*?)" + re.escape(end), text, re.DOTALL)
    return found.group(1) if found else ""


def replace_block(text: str, block: str) -> str:
    """`text` with everything between the benchmark markers replaced by `block`.

    Raises:
        ValueError: when the markers are missing or out of order.
    """
    start, end = MARKERS
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"no {start} ... {end} block in the page")
    return pattern.sub(lambda _: f"{start}\n{block}\n{end}", text, count=1)


def merged_block(old: str, results: dict, env: dict[str, str], command: str) -> str:
    """The table block with only the rows of the benchmarks in `results` replaced (a run
    with `--only`): the other rows, and the line saying how they were measured, stay; a line
    saying how the new rows were measured is added (replacing one for the same benchmarks).

    Args:
        old: the block between the markers now.
    """
    def name_of(line: str) -> str | None:
        return line[2:].split(" | ")[0] if line.startswith("| ") and " | " in line else None

    names = list(results)
    fresh = [line for line in markdown_table(results, env, command).splitlines()
             if name_of(line) in results]
    lines = old.strip("\n").splitlines()
    prose = [line for line in lines if not line.startswith("|") and line.strip()]
    note_start = f"Rows of {', '.join(names)}: "
    prose = [line for line in prose if not line.startswith(note_start)]
    prose.append(f"{note_start}measured by `{command}` on {env['machine']}, {env['date']} "
                 f"({env['versions']}).")
    rows = [line for line in lines if name_of(line) not in (None, "benchmark")]
    fresh_at = {name: [line for line in fresh if name_of(line) == name] for name in names}
    ordered = []
    for name in BENCHMARKS:  # the registry's order; rows of unknown benchmarks last
        ordered += fresh_at.get(name) or [line for line in rows if name_of(line) == name]
    ordered += [line for line in rows if name_of(line) not in BENCHMARKS]
    return "\n".join([*prose, "", "| benchmark | figure | measured | target | settings |",
                      "|---|---|---|---|---|", *ordered])


def print_table(results: dict, failures: list[str]) -> None:
    print(f"\n{'benchmark':<26}{'figure':<36}{'value':>8}  target")
    for name, label, value, target in headline_rows(results):
        print(f"{name:<26}{label:<36}{value:>8.3f}  {target}")
    for name in failures:
        print(f"{name:<26}{'FAILED':<36}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="reference")
    parser.add_argument("--quick", action="store_true", help="the same as --preset quick")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), metavar="NAME")
    parser.add_argument("--out", type=Path, help="write every result to this JSON file")
    parser.add_argument("--docs", nargs="*", type=Path, metavar="PATH",
                        help="rewrite the table between the benchmark markers of "
                        "docs/benchmarks.md (or of each PATH: the README's pretraining "
                        "rows, say) (with --only, only those benchmarks' rows)")
    args = parser.parse_args(argv)
    preset = "quick" if args.quick else args.preset
    results, failures = run_benchmarks(preset, args.only)
    print_table(results, failures)
    env = environment()
    if args.out:
        args.out.write_text(json.dumps({"environment": env, "preset": preset,
                                        "results": results}, indent=2))
        print(f"\nwrote {args.out}")
    if args.docs is not None:
        pages = args.docs or [TABLE_PAGE]
        command = "python benchmarks/run_all.py --docs" + "".join(
            f" {page}" for page in args.docs) + (
            f" --preset {preset}" if preset != "reference" else "") + (
            " --only " + " ".join(f"'{name}'" for name in args.only) if args.only else "")
        for page in pages:
            text = page.read_text()
            if args.only and "| benchmark |" in current_block(text):  # only their rows change
                block = merged_block(current_block(text), results, env, command)
            else:
                block = markdown_table(results, env, command)
            page.write_text(replace_block(text, block))
            print(f"rewrote the benchmark table in {page}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
