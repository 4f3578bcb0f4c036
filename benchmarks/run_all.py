"""Every side-by-side benchmark in one command, a table at the end, everything as JSON.

    python benchmarks/run_all.py --out benchmarks.json           # the reference sizes
    python benchmarks/run_all.py --quick                          # small sizes, minutes on a CPU

Each script runs in its own process (so one's memory does not colour another's) and writes
its own JSON; the headline figure of each is a ratio against the anchor library, measured in
that one process, so it carries over between machines where absolute times do not.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# name -> (script, reference arguments, quick arguments, the JSON field to headline)
BENCHMARKS = {
    "encode vs timm": ("encode_vs_timm.py", [], ["--variant", "vit-s/16", "--repeats", "5"],
                       "ratio_vlm_vit_over_timm"),
    "llava features vs hf": ("llava_features_vs_hf.py", [],
                             ["--variant", "clip-vit-b/16", "--repeats", "3"],
                             "ratio_vlm_vit_over_transformers"),
    "load vs hf": ("load_vs_hf.py", [], ["--variant", "clip-vit-b/16"],
                   "ratio_vlm_vit_over_transformers"),
    "mae step vs hf": ("mae_step_vs_hf.py", [],
                       ["--variant", "vit-s/16", "--batch-size", "4", "--repeats", "3"],
                       "time_ratio_vlm_vit_over_transformers"),
    "lora vs full step": ("lora_step_vs_full.py", [],
                          ["--variant", "vit-s/16", "--batch-size", "4", "--repeats", "3"],
                          "time_ratio_lora_over_full"),
    "scaling": ("scaling.py", [], ["--variant", "vit-ti/16", "--repeats", "2"], None),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), metavar="NAME")
    parser.add_argument("--out", type=Path, help="write every result to this JSON file")
    args = parser.parse_args()
    results, failures = {}, []
    with tempfile.TemporaryDirectory() as scratch:
        for name, (script, reference, quick, _) in BENCHMARKS.items():
            if args.only and name not in args.only:
                continue
            target = Path(scratch, f"{script}.json")
            command = [sys.executable, str(HERE / script), *(quick if args.quick else reference),
                       "--json", str(target)]
            print(f"== {name}: {' '.join(command[1:])}", flush=True)
            finished = subprocess.run(command)
            if finished.returncode or not target.is_file():
                failures.append(name)
                continue
            results[name] = json.loads(target.read_text())
    print(f"\n{'benchmark':<24}{'headline':<40}{'value':>8}")
    for name, result in results.items():
        field = BENCHMARKS[name][3]
        if field:
            print(f"{name:<24}{field:<40}{result[field]:>8.3f}")
    for name in failures:
        print(f"{name:<24}{'FAILED':<40}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
