"""Every example runs, at a tiny size, so none rots."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# name -> (arguments for a tiny run, a line its output must contain)
TINY_ARGS = {
    "encode_patch_tokens.py": (["--variant", "vit-ti/16", "--image-size", "64"],
                               "patch tokens     [2, 16, 192]"),
    "vision_tower.py": (["--variant", "vit-ti/16", "--image-size", "64", "--llm-width", "48",
                         "--pooler", "mlp2x_gelu", "--pooler", "pixel_shuffle"],
                        "pixel_shuffle: image -> [1, 4, 48] (num_image_tokens = 4)"),
    "load_hf_clip.py": (["--width", "64", "--layers", "2"],
                        "image embeddings [2, 64], max |ours - transformers| = "),
    "llava_stage1.py": (["--image-size", "32", "--steps", "5"],
                        "max |ours - transformers| logits = "),
    "llava_instruct.py": (["--image-size", "32", "--stage-1-steps", "3", "--stage-2-steps", "3"],
                          "max |ours - transformers| logits = "),
}


def test_every_example_has_tiny_arguments():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(TINY_ARGS)


@pytest.mark.parametrize("name", sorted(TINY_ARGS))
def test_example_runs(name):
    pytest.importorskip("skimage")
    if name.startswith("llava_"):
        pytest.importorskip("vlm_vit_llm")
    arguments, expected = TINY_ARGS[name]
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *arguments],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout
