"""`vlm_vit.commands`, the helpers plugins' subcommands use, and the old name for them."""

import pytest

import vlm_vit.cli.common
import vlm_vit.commands
from vlm_vit.commands import image_size, reading_checkpoint, refusing_pickles


def test_the_cli_name_re_exports_every_helper():
    for name in vlm_vit.cli.common.__all__:
        assert getattr(vlm_vit.cli.common, name) is getattr(vlm_vit.commands, name)
    # what the LLM plugin imports from the old name
    assert {"reading_checkpoint", "refusing_pickles"} <= set(vlm_vit.cli.common.__all__)


def test_the_helpers_module_imports_no_cli():
    import subprocess
    import sys

    code = ("import sys, vlm_vit.commands; "
            "print(sorted(m for m in sys.modules if m.startswith('vlm_vit.cli')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


def test_reading_checkpoint_names_a_file_that_is_no_checkpoint(tmp_path):
    path = tmp_path / "model.pt"
    path.write_text("hello")
    with (pytest.raises(ValueError, match="model.pt is not a readable checkpoint"),
          reading_checkpoint(path)):
        raise EOFError("cut short")


def test_refusing_pickles_names_the_files(tmp_path):
    import pickle

    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with (pytest.raises(ValueError, match="MODEL .*pytorch_model.bin"),
          refusing_pickles(tmp_path, "MODEL")):
        raise pickle.UnpicklingError("bad")


def test_image_size():
    assert image_size(None) is None
    assert image_size([224]) == (224, 224)
    assert image_size([224, 336]) == (224, 336)
    with pytest.raises(ValueError, match="SIDE or HEIGHT WIDTH"):
        image_size([1, 2, 3])
