"""Per-rank memory of MAE pretraining under FSDP2 against DDP, and what it means at scale.

    python benchmarks/fsdp_memory.py                  # vit-l/16, 2 ranks, CPU (gloo): ~14 GB
    python benchmarks/fsdp_memory.py --depth 10       # 10 of its 24 blocks: ~7.7 GB
    python benchmarks/fsdp_memory.py --quick          # vit-b/16
    python benchmarks/fsdp_memory.py --tiny           # a two-block vit-ti/16 (the test)
    python benchmarks/fsdp_memory.py --device cuda --dtype bfloat16   # NCCL, every GPU

Starts `torchrun` twice, one strategy after the other (`TrainConfig.strategy` "ddp", then
"fsdp"), each rank running `fsdp_memory_worker.py`: the trainer's setup of the strategy, then
real MAE steps (forward, backward, clipping, AdamW) on random pixels. After the first
optimizer step every rank counts the bytes it holds in parameters, gradients and AdamW's
moments (the local shards of DTensors); the headline is FSDP2's figure over DDP's (target
<= 0.55 at 2 ranks). Also reported: each process's peak memory (the resident set's high-water
mark on a CPU, the CUDA allocator's peak on a GPU), which adds what the strategies keep beside
that state (DDP's gradient buckets, FSDP2's gathered blocks, activations), and the median
step time after a warm-up step, fsdp over ddp: reported only, since gloo between processes
on one machine says little about NCCL between GPUs. (On a CPU, memory is measured over the
first two steps and time over the later ones with glibc's allocator set differently for each:
see `fsdp_memory_worker.py`.) DDP's ranks each peak at about 20 bytes per parameter (4 + 4 + 8,
and 4 for its gradient buckets), hence `--depth` on a small machine.

The images are small (64 px; the position table is resampled, the parameters stay the
variant's): the state's size does not depend on the image size, and a step takes seconds.

From the measured bytes per parameter it projects, in GB per rank, DDP and FSDP2 for MAE on
vit-g/14 and for the stage-2 (full) fine-tune of a LLaVA-1.5-7B at 8 and 64 ranks: FSDP2 holds
its sharded state plus, while computing, the units it has gathered whole (see `project`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from timing import write_json

HERE = Path(__file__).resolve().parent
WORKER = HERE / "fsdp_memory_worker.py"
GB = 1e9

# preset -> the worker's model and sizes; explicit options override them.
PRESETS = {
    "default": {"variant": "vit-l/16", "depth": None, "image_size": 64, "batch_size": 2,
                "steps": 4},
    "quick": {"variant": "vit-b/16", "depth": None, "image_size": 64, "batch_size": 2,
              "steps": 4},
    "tiny": {"variant": "vit-ti/16", "depth": 2, "image_size": 32, "batch_size": 1,
             "steps": 1},
}
PROJECTED_RANKS = (8, 64)


@dataclass(frozen=True)
class ModelShape:
    """What a memory projection needs to know of a model under FSDP2's units.

    Attributes:
        name: as printed.
        parameters: all of them, frozen ones included.
        trainable: those with gradients and AdamW moments.
        root: parameters outside every unit, which FSDP2 keeps gathered from the start of
            the forward pass to the end of the backward pass.
        root_trainable: the trainable ones among `root`.
        block: the largest unit (a transformer block or decoder layer).
        block_trainable: the trainable ones among `block`.
    """

    name: str
    parameters: int
    trainable: int
    root: int
    root_trainable: int
    block: int
    block_trainable: int


def shape_of(name: str, objective) -> ModelShape:
    """The `ModelShape` of an objective, its units found as `vlm_vit.train.fsdp.units` finds
    them (build it on the meta device: only shapes are read)."""
    from vlm_vit.train.fsdp import units

    def count(parameters, trainable_only=False):
        return sum(p.numel() for p in parameters if p.requires_grad or not trainable_only)

    found = units(objective)
    inside = {id(p) for unit in found for p in unit.parameters()}
    root = [p for p in objective.parameters() if id(p) not in inside]
    largest = max(found, key=lambda unit: count(unit.parameters()))
    return ModelShape(name, count(objective.parameters()), count(objective.parameters(), True),
                      count(root), count(root, True), count(largest.parameters()),
                      count(largest.parameters(), True))


def vit_g14_mae() -> ModelShape:
    """MAE pretraining of ViT-g/14 (Zhai et al., "Scaling Vision Transformers", 2022: width
    1408, depth 40, MLP 6144, 16 heads; not in the registry) at 224 with MAE's 512 x 8
    decoder, counted on the meta device."""
    import torch

    from vlm_vit import EncoderConfig, VisionEncoder
    from vlm_vit.pretrain.build import build_objective

    config = EncoderConfig(width=1408, depth=40, heads=16, mlp_width=6144, patch_size=14)
    with torch.device("meta"):
        objective = build_objective("mae", VisionEncoder(config), mean=(0.5,) * 3,
                                    std=(0.5,) * 3)
    return shape_of("vit-g/14 MAE pretraining", objective)


# LLaVA-1.5-7B: Vicuna-7B v1.5 has LLaMA-2-7B's shapes (its config.json: vocab 32000, hidden
# 4096, intermediate 11008, 32 layers, untied embeddings); the projector is mlp2x_gelu
# (1024 -> 4096 -> 4096); the tower, CLIP ViT-L/14-336, is frozen in both stages.
LLAMA_7B = {"vocab": 32000, "hidden": 4096, "intermediate": 11008, "layers": 32}
LLAVA_PROJECTOR = (1024 * 4096 + 4096) + (4096 * 4096 + 4096)


def llama_layer_parameters(hidden: int, intermediate: int) -> int:
    """One LLaMA decoder layer: q, k, v, o (no biases), gate, up, down, two RMSNorm scales."""
    return 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden


def llava_7b_stage2() -> ModelShape:
    """LLaVA-1.5-7B's stage 2: the LLM and projector trained, the tower frozen; FSDP2's
    units are the LLM's decoder layers and the tower's blocks, the root holds the embeddings,
    the LM head, the projector and the tower's patch embedding and norms."""
    import torch

    from vlm_vit import EncoderConfig, VisionEncoder

    with torch.device("meta"):
        tower = VisionEncoder(EncoderConfig.from_name("clip-vit-l/14-336"))
    tower_shape = shape_of("tower", tower)
    c = LLAMA_7B
    layer = llama_layer_parameters(c["hidden"], c["intermediate"])
    root_trained = 2 * c["vocab"] * c["hidden"] + c["hidden"] + LLAVA_PROJECTOR
    llm = c["layers"] * layer + 2 * c["vocab"] * c["hidden"] + c["hidden"]
    return ModelShape("LLaVA-1.5-7B stage 2 (full fine-tune)",
                      parameters=llm + LLAVA_PROJECTOR + tower_shape.parameters,
                      trainable=llm + LLAVA_PROJECTOR, root=root_trained + tower_shape.root,
                      root_trainable=root_trained, block=layer, block_trainable=layer)


def gathered_bytes(shape: ModelShape, weight_bytes: int = 4) -> int:
    """What FSDP2 holds whole beyond its shards while computing: the weights of the root
    (kept from the start of the forward pass to the end of the backward pass) and of two
    blocks (the running one and the one prefetched), `weight_bytes` each (4: float32, 2: bf16
    gathers), and the float32 gradients of the root and of one block before their
    reduce-scatter. Activations are not included."""
    return (weight_bytes * (shape.root + 2 * shape.block)
            + 4 * (shape.root_trainable + shape.block_trainable))


def project(shape: ModelShape, measured: dict, ranks: int, weight_bytes: int = 4) -> dict:
    """Bytes per rank under DDP and FSDP2 for `shape` at `ranks` ranks.

    DDP: every rank holds `measured` bytes per parameter (weights) and per trainable
    parameter (gradients, AdamW moments): 4 + 4 + 8 = 16 in float32. FSDP2: the same bytes
    over `ranks` (as measured, padding included) plus `gathered_bytes`.

    Args:
        measured: bytes per parameter from the run: "parameters", "gradients" and
            "optimizer" for DDP (`ddp`) and summed over ranks for FSDP2 (`fsdp`).
        weight_bytes: of a gathered weight.
    """
    def state(per: dict) -> float:
        return (per["parameters"] * shape.parameters
                + (per["gradients"] + per["optimizer"]) * shape.trainable)

    gathered = gathered_bytes(shape, weight_bytes)
    sharded = state(measured["fsdp"]) / ranks
    return {"model": shape.name, "parameters": shape.parameters, "trainable": shape.trainable,
            "ranks": ranks, "ddp_gb": state(measured["ddp"]) / GB,
            "fsdp_gb": (sharded + gathered) / GB, "fsdp_sharded_state_gb": sharded / GB,
            "fsdp_gathered_gb": gathered / GB}


def variant_depth(variant: str) -> int:
    """The number of blocks of a registered variant."""
    from vlm_vit import EncoderConfig

    return EncoderConfig.from_name(variant).depth


def measured_shape(args: argparse.Namespace) -> ModelShape:
    """The `ModelShape` of the objective the workers trained, built on the meta device."""
    import torch

    from vlm_vit import EncoderConfig, VisionEncoder
    from vlm_vit.pretrain.build import build_objective

    config = EncoderConfig.from_name(args.variant, **({"depth": args.depth} if args.depth
                                                       else {}))
    with torch.device("meta"):
        objective = build_objective("mae", VisionEncoder(config), mean=(0.5,) * 3,
                                    std=(0.5,) * 3)
    return shape_of(args.variant, objective)


def free_port() -> int:
    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        return handle.getsockname()[1]


def launch(strategy: str, args: argparse.Namespace, folder: Path) -> list[dict]:
    """Runs the worker on `args.ranks` processes under torchrun; every rank's result."""
    out = folder / strategy
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
               str(args.ranks), "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               str(WORKER), "--strategy", strategy, "--variant", args.variant,
               "--image-size", str(args.image_size), "--batch-size", str(args.batch_size),
               "--steps", str(args.steps), "--device", args.device, "--dtype", args.dtype,
               "--out", str(out), *(["--depth", str(args.depth)] if args.depth else []),
               *(["--default-malloc"] if args.default_malloc else [])]
    paths = [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    if args.device == "cpu":  # the cores shared out between the ranks
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.ranks))
    print(f"== {strategy}: {' '.join(command[1:])}", flush=True)
    finished = subprocess.run(command, env=env, timeout=args.timeout)
    if finished.returncode:
        raise SystemExit(f"the {strategy} run failed (status {finished.returncode})")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(args.ranks)]


def summarise(ranks: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    """The JSON result: per-strategy figures (the largest over ranks) and the ratios."""
    parameters = ranks["ddp"][0]["parameters"]
    result: dict = {"variant": args.variant, "depth": args.depth, "parameters": parameters,
                    "image_size": args.image_size, "batch_size": args.batch_size,
                    "ranks": args.ranks, "device": args.device, "dtype": args.dtype,
                    "backend": "nccl" if args.device == "cuda" else "gloo",
                    "timed_steps": args.steps,
                    "malloc": ranks["ddp"][0]["malloc"],
                    "peak_memory_kind": ranks["ddp"][0]["peak_memory_kind"]}
    full_depth = variant_depth(args.variant)
    blocks = f"{args.depth} of {full_depth} blocks, " if args.depth and args.depth < full_depth \
        else ""
    result["settings_note"] = f"{blocks}{args.ranks} ranks ({result['backend']})"
    for strategy, per_rank in ranks.items():
        held = max(per_rank, key=lambda r: r["held_bytes_total"])
        result[strategy] = {
            "held_bytes_per_rank": held["held_bytes_total"],
            "held_bytes_by_kind": held["held_bytes"],
            "bytes_per_parameter_per_rank": held["held_bytes_total"] / parameters,
            "peak_memory_bytes_per_rank": max(r["peak_memory_bytes"] for r in per_rank),
            "baseline_rss_bytes": max(r["baseline_rss_bytes"] for r in per_rank),
            "median_step_seconds": per_rank[0]["median_step_seconds"],
            "step_seconds": per_rank[0]["step_seconds"],
            "every_rank": per_rank}
    ddp, fsdp = result["ddp"], result["fsdp"]
    result["memory_ratio_fsdp_over_ddp"] = fsdp["held_bytes_per_rank"] / ddp["held_bytes_per_rank"]
    result["peak_memory_ratio_fsdp_over_ddp"] = (fsdp["peak_memory_bytes_per_rank"]
                                                 / ddp["peak_memory_bytes_per_rank"])
    result["time_ratio_fsdp_over_ddp"] = fsdp["median_step_seconds"] / ddp["median_step_seconds"]
    measured = {strategy: {kind: value * (args.ranks if strategy == "fsdp" else 1) / parameters
                           for kind, value in result[strategy]["held_bytes_by_kind"].items()}
                for strategy in ("ddp", "fsdp")}
    result["bytes_per_parameter"] = measured
    weight_bytes = 2 if args.dtype == "bfloat16" else 4
    # The projection's extra term, beside what the run's FSDP2 ranks peaked at beyond the
    # baseline and the held state (that also holds activations and allocator slack).
    fsdp["gathered_estimate_bytes"] = gathered_bytes(measured_shape(args), weight_bytes)
    if args.device == "cpu":
        fsdp["peak_beyond_baseline_and_state_bytes"] = (
            fsdp["peak_memory_bytes_per_rank"] - fsdp["baseline_rss_bytes"]
            - fsdp["held_bytes_per_rank"])
    shapes = [vit_g14_mae(), llava_7b_stage2()]
    result["model_shapes"] = [asdict(shape) for shape in shapes]
    result["projection"] = [project(shape, measured, n, weight_bytes) for shape in shapes
                            for n in PROJECTED_RANKS]
    return result


def print_tables(result: dict) -> None:
    memory = "peak RSS" if result["device"] == "cpu" else "peak CUDA"
    print(f"\nMAE on {result['variant']}"
          f"{' (' + str(result['depth']) + ' blocks)' if result['depth'] else ''}, "
          f"{result['parameters'] / 1e6:.1f}M parameters, {result['ranks']} ranks "
          f"({result['backend']}, {result['dtype']}), {result['batch_size']} images of "
          f"{result['image_size']} px per rank")
    print(f"{'strategy':<9}{'weights':>9}{'grads':>9}{'AdamW':>9}{'per rank':>10}"
          f"{'B/param':>9}{memory:>11}{'step':>9}")
    for strategy in ("ddp", "fsdp"):
        row = result[strategy]
        kinds = row["held_bytes_by_kind"]
        print(f"{strategy:<9}{kinds['parameters'] / GB:>8.3f}G{kinds['gradients'] / GB:>8.3f}G"
              f"{kinds['optimizer'] / GB:>8.3f}G{row['held_bytes_per_rank'] / GB:>9.3f}G"
              f"{row['bytes_per_parameter_per_rank']:>9.2f}"
              f"{row['peak_memory_bytes_per_rank'] / GB:>10.3f}G"
              f"{row['median_step_seconds']:>8.2f}s")
    if result["device"] == "cpu":
        print(f"(a process holds {result['ddp']['baseline_rss_bytes'] / GB:.2f} GB after its "
              f"imports, before any model; malloc: {result['malloc']})")
    print(f"fsdp / ddp: weights+grads+AdamW per rank {result['memory_ratio_fsdp_over_ddp']:.3f} "
          f"(target <= 0.55), {memory} {result['peak_memory_ratio_fsdp_over_ddp']:.3f}, "
          f"step time {result['time_ratio_fsdp_over_ddp']:.3f} (reported only)")
    fsdp = result["fsdp"]
    if "peak_beyond_baseline_and_state_bytes" in fsdp:
        print(f"fsdp's peak beyond the baseline and its state: "
              f"{fsdp['peak_beyond_baseline_and_state_bytes'] / GB:.3f} GB (the projection's "
              f"gathered units for this model: {fsdp['gathered_estimate_bytes'] / GB:.3f} GB)")
    weights = "bf16" if result["dtype"] == "bfloat16" else "float32"
    print(f"\nprojected per rank (GB; FSDP2 = sharded state + gathered units, {weights} "
          "weights gathered):")
    print(f"{'model':<40}{'params':>8}{'ranks':>6}{'DDP':>8}{'FSDP2':>8}{'= state':>9}"
          f"{'+ gathered':>11}")
    for row in result["projection"]:
        print(f"{row['model']:<40}{row['parameters'] / 1e9:>7.2f}B{row['ranks']:>6}"
              f"{row['ddp_gb']:>8.1f}{row['fsdp_gb']:>8.2f}{row['fsdp_sharded_state_gb']:>9.2f}"
              f"{row['fsdp_gathered_gb']:>11.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    presets = parser.add_mutually_exclusive_group()
    presets.add_argument("--quick", action="store_true", help="vit-b/16")
    presets.add_argument("--tiny", action="store_true", help="a two-block vit-ti/16, 32 px")
    parser.add_argument("--variant", help="default: the preset's (vit-l/16)")
    parser.add_argument("--depth", type=int, help="fewer blocks than the variant")
    parser.add_argument("--image-size", type=int)
    parser.add_argument("--batch-size", type=int, help="images per rank per step")
    parser.add_argument("--steps", type=int,
                        help="timed steps, after two memory steps and one warm-up step")
    parser.add_argument("--ranks", type=int,
                        help="processes (default: 2 on a CPU, every visible GPU on CUDA)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="bfloat16: FSDP2 gathers bf16 weights and both autocast")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's mmap threshold to adjust itself (see the worker)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per strategy")
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv)
    preset = PRESETS["tiny" if args.tiny else "quick" if args.quick else "default"]
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.ranks is None:
        import torch

        args.ranks = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.ranks < 1:
        print("no CUDA device visible: --device cuda needs one", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory() as scratch:
        ranks = {strategy: launch(strategy, args, Path(scratch)) for strategy in ("ddp", "fsdp")}
    result = summarise(ranks, args)
    print_tables(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
