"""Every example runs, at a tiny size, so none rots."""

import os
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


SLOW = {"llava_stage1.py", "llava_instruct.py"}  # tens of seconds: captions are learnt


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW
                                  else name for name in sorted(TINY_ARGS)])
def test_example_runs(name, tmp_path):
    pytest.importorskip("skimage")
    if name.startswith("llava_"):
        pytest.importorskip("vlm_vit_llm")
    arguments, expected = TINY_ARGS[name]
    temp = tmp_path / "tmp"
    temp.mkdir()
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *arguments],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TMPDIR": str(temp),  # torch's own cache apart
                                 "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert result.returncode == 0, result.stderr
    assert not any(temp.iterdir()), f"{name} left {sorted(temp.iterdir())}"  # issue 27, 9
    assert expected in result.stdout
    if expected.endswith("= "):  # a parity figure: read it, not only its label
        figure = result.stdout.split(expected, 1)[1].split()[0]
        assert float(figure) <= 1e-4, result.stdout


def test_an_example_fails_when_its_parity_figure_is_above_tolerance(monkeypatch, capsys):
    """The examples check what they print: a tower that differs from transformers' exits 1."""
    pytest.importorskip("transformers")
    pytest.importorskip("skimage")
    import runpy

    from vlm_vit.tower import VisionTower

    real = VisionTower.forward
    monkeypatch.setattr(VisionTower, "forward", lambda self, *a, **k: real(self, *a, **k) * 1.01)
    monkeypatch.setattr(sys, "argv", ["load_hf_clip.py", "--width", "64", "--layers", "2"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(EXAMPLES / "load_hf_clip.py"), run_name="__main__")
    assert exit_info.value.code == 1
    assert "differ from transformers' by more than" in capsys.readouterr().err
