"""Hostile input at the bridge's surfaces (issues 40 and 48): a LLaVA-NeXT config whose
pinpoints are not a bounded list of pairs, token budgets and lengths that leave nothing to
train, and a LLaVA record naming thousands of images. Each is refused or skipped in one
line naming the file or flag, before anything large is read or decoded."""

import json

import pytest
import transformers
from test_llava_next_export import TILINGS
from test_llm_anyres import tiled_mm

from vlm_vit_llm import MultimodalLM, export_llava

MAX_LINE = 300  # characters an error line may take, whatever the input


# ---- issue 40: image_grid_pinpoints ---------------------------------------------------------

@pytest.fixture
def next_folder(tmp_path, tokenizer, monkeypatch):
    """Our LLaVA-NeXT export; reading its weights (transformers' from_pretrained) fails the
    test, so a check that passes them has run before any weight is read."""
    export_llava(tiled_mm(tokenizer, TILINGS["next"]), tmp_path / "next")

    def refuse(*args, **kwargs):
        pytest.fail("the weights were read before the config was checked")

    monkeypatch.setattr(transformers.LlavaNextForConditionalGeneration, "from_pretrained",
                        refuse)
    return tmp_path / "next"


@pytest.mark.parametrize(("pinpoints", "message"), [
    ("anyres", "image_grid_pinpoints must be a list of 1 to 1024 [height, width] pairs, got "
               "str 'anyres'"),
    ([[32, 64]] * 100_000, "image_grid_pinpoints must be a list of 1 to 1024 [height, width] "
                           "pairs, got list of 100000 [[32, 64], [32, 64], "),
    ([], "image_grid_pinpoints must be a list of 1 to 1024 [height, width] pairs, got list "
         "of 0 []"),
    ([[32, 64], [32, "x" * 100_000]], "image_grid_pinpoints[1] is not a [height, width] pair "
                                      "of positive ints: [32, 'xxxxxx"),
    ([[32, 64], [32, 64, 96]], "image_grid_pinpoints[1] is not a [height, width] pair"),
    ([[32, 64], [True, 64]], "image_grid_pinpoints[1] is not a [height, width] pair"),
    ([[32, 50]], "tiling pinpoint (32, 50) is not a multiple of the tile size 32"),
])
def test_hostile_pinpoints_are_one_short_line_before_any_weight_is_read(next_folder, pinpoints,
                                                                        message):
    """`"anyres"` escaped as transformers' StrictDataclassFieldValidationError; 100,000
    pinpoints gave a one-million-character line after the whole model had loaded."""
    config = next_folder / "config.json"
    raw = json.loads(config.read_text())
    raw["image_grid_pinpoints"] = pinpoints
    config.write_text(json.dumps(raw))
    with pytest.raises(ValueError) as caught:
        MultimodalLM.from_pretrained(next_folder)
    line = str(caught.value)
    assert line.startswith(f"{config}: ") and message in line, line
    assert "\n" not in line and len(line) < MAX_LINE, len(line)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("vision_feature_select_strategy", "full" * 10_000, "vision_feature_select_strategy "
                                                         "'fullfullfull"),
    ("vision_feature_layer", "x" * 10_000, "vision_feature_layer"),
    ("model_type", "llava_next", "is not one of"),
])
def test_other_hostile_fields_are_one_short_line_naming_the_file(next_folder, field, value,
                                                                 message):
    from vlm_vit_llm.llava_next import read_llava

    config = next_folder / "config.json"
    raw = json.loads(config.read_text())
    raw[field] = value if field != "model_type" else ["llava_next"] * 10_000
    config.write_text(json.dumps(raw))
    with pytest.raises(ValueError) as caught:
        read_llava(next_folder)
    line = str(caught.value)
    assert line.startswith(f"{config}: ") and message in line, line
    assert "\n" not in line and len(line) < MAX_LINE, len(line)
