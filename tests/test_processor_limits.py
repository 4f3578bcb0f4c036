"""Image processing cannot be made to exhaust memory (issue 19, section 2): processor configs
are bounded and validated field by field, and a resize whose output would be over the pixel
limit or whose aspect ratio is extreme is refused, naming the image and the size it would
become."""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_vit import ImageProcessor, VisionEncoder, load_processor
from vlm_vit.processor import PIXEL_CEILING, PROCESSOR_CONFIG_NAME, ImageTooLargeError

from .conftest import tiny_config


@pytest.mark.parametrize("kwargs, text", [
    ({"size": (60_000, 60_000)}, r"size must be .*1\.\.16384.*got \(60000, 60000\)"),
    ({"size": (224, 16_385)}, r"size must be .*got \(224, 16385\)"),
    ({"size": None}, r"size must be .*got None"),
    ({"size": 20_000, "max_pixels": None}, r"size must be .*got \(20000, 20000\)"),
    ({"mean": ("0.5", "0.5", "0.5")}, r"mean must be 3 values, one finite number per "
     r"channel, got \('0.5'"),
    ({"mean": (math.nan, 0.5, 0.5)}, r"mean must be 3 values.*got \(nan"),
    ({"mean": (True, 0.5, 0.5)}, r"mean must be 3 values.*got \(True"),
    ({"mean": 0.5}, r"mean must be 3 values.*got 0.5"),
    ({"std": (0.5, -0.5, 0.5)}, r"std must be 3 values, one finite number > 0 \(nonzero\)"),
    ({"std": (0.5, math.inf, 0.5)}, r"std must be 3 values.*got \(0.5, inf"),
    ({"std": "NaN"}, r"std must be 3 values.*got 'NaN'"),
    ({"resample": "lanczos"}, r"resample 'lanczos' is not one of \('bicubic', 'bilinear'\)"),
    ({"max_pixels": 10**15}, rf"max_pixels must be .*got {10**15} \(allowed: 1\.\.{PIXEL_CEILING}"),
    ({"max_pixels": 1.5e6}, r"max_pixels must be a positive int"),
    ({"max_output_pixels": 10**15}, r"max_output_pixels must be .*\(allowed: 1\.\.268435456\)"),
    ({"min_output_pixels": 2**32}, r"min_output_pixels must be .*\(allowed: 1\.\.268435456\)"),
    ({"patch_multiple": 10**6}, r"patch_multiple must be .*1\.\.16384"),
    ({"resize_mode": None}, r"resize_mode None is not one of"),
])
def test_processor_settings_are_bounded_and_typed(kwargs, text):
    with pytest.raises(ValueError, match=text):
        ImageProcessor(**kwargs)


def test_processor_config_file_is_named(tmp_path):
    (tmp_path / PROCESSOR_CONFIG_NAME).write_text(json.dumps({"size": [60_000, 60_000]}))
    with pytest.raises(ValueError, match=rf"{PROCESSOR_CONFIG_NAME}.*size must be"):
        ImageProcessor.from_pretrained(tmp_path)


def test_a_checkpoint_s_processor_config_is_bounded(tmp_path):
    VisionEncoder(tiny_config()).save_pretrained(tmp_path, model_card=False)
    (tmp_path / PROCESSOR_CONFIG_NAME).write_text(json.dumps({"size": [60_000, 60_000]}))
    with pytest.raises(ValueError, match=rf"{PROCESSOR_CONFIG_NAME}.*size must be") as info:
        load_processor(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_hf_preprocessor_config_is_bounded(tmp_path):
    from vlm_vit.convert.hf_clip import save_hf_clip

    encoder = VisionEncoder(tiny_config(pre_norm=True, act="quick_gelu", patch_bias=False))
    save_hf_clip(encoder, tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 60_000}, "crop_size": 60_000, "do_center_crop": True}))
    with pytest.raises(ValueError, match=r"preprocessor_config\.json.*size must be"):
        load_processor(tmp_path)


# -- resizing --------------------------------------------------------------------------------

def test_the_177_byte_strip_is_refused_before_the_resize(tmp_path):
    path = tmp_path / "strip.png"
    Image.new("L", (100_000, 1)).save(path, optimize=True)  # 1 pixel high, 100,000 wide
    assert path.stat().st_size < 1000
    with pytest.raises(ValueError, match=r"^image \(file '.*strip\.png'\) \(height 1, width "
                       r"100000\) has aspect ratio 100000, .*it would be resized to "
                       r"224 x 22400000 = 5017600000 "):
        ImageProcessor()(path)


def test_shortest_edge_output_over_max_pixels_is_refused():
    processor = ImageProcessor(size=32, max_pixels=10_000)
    strip = Image.new("RGB", (200, 2))  # aspect 100, under the maximum of 200
    with pytest.raises(ImageTooLargeError, match=r"^image \(height 2, width 200\) would be "
                       r"resized to 32 x 3200 = 102400 pixels before the crop, more than "
                       r"max_pixels=10000"):
        processor(strip)
    with pytest.raises(ImageTooLargeError, match=r"^images\[1\] \(height 2, width 200\) "
                       r"would be resized to 32 x 3200"):
        processor([Image.new("RGB", (8, 8)), strip])


@pytest.mark.parametrize("image", [
    Image.new("RGB", (300, 1)),
    np.zeros((300, 1, 3), np.uint8),
    torch.rand(3, 1, 300),  # float: resized by interpolate, checked the same way
], ids=["pil", "array", "float-tensor"])
def test_shortest_edge_refuses_extreme_aspect_ratios(image):
    with pytest.raises(ValueError, match=r"aspect ratio 300, more than the maximum 200 "
                       r"\(max_aspect_ratio\); it would be resized to"):
        ImageProcessor(size=32)(image)
    assert ImageProcessor(size=32, max_aspect_ratio=400)(image).shape == (1, 3, 32, 32)


def test_squash_keeps_extreme_aspect_ratios_which_cannot_blow_up():
    out = ImageProcessor(size=32, resize_mode="squash")(Image.new("RGB", (300, 1)))
    assert out.shape == (1, 3, 32, 32)


def test_ordinary_images_are_unaffected():
    out = ImageProcessor(size=32)([Image.new("RGB", (640, 480)), Image.new("RGB", (20, 3000))])
    assert out.shape == (2, 3, 32, 32)
