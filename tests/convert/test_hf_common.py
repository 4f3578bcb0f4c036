"""One preprocessor_config.json parser for the Hugging Face families; what differs between
them is data (`ImageProcessorClass`), and each difference is pinned here."""

import pytest

from vlm_vit.convert.hf_common import (
    CLIP_IMAGE_PROCESSOR,
    VIT_IMAGE_PROCESSOR,
    processor_from_hf,
)
from vlm_vit.processor import ImageProcessor

FALLBACK = ImageProcessor(size=(32, 32), resize_mode="squash", mean=(0.5,) * 3, std=(0.5,) * 3)
CLASSES = [CLIP_IMAGE_PROCESSOR, VIT_IMAGE_PROCESSOR]


def parse(settings, processor_class):
    rules = []
    return processor_from_hf(settings, FALLBACK, rules, "x/preprocessor_config.json",
                             processor_class=processor_class), rules


@pytest.mark.parametrize(("processor_class", "default"),
                         [(CLIP_IMAGE_PROCESSOR, "bicubic"), (VIT_IMAGE_PROCESSOR, "bilinear")])
def test_a_file_naming_no_filter_gets_the_class_s_own(processor_class, default):
    processor, rules = parse({"size": {"height": 32, "width": 48}}, processor_class)
    assert processor.resample == default and rules == []
    assert (processor.size, processor.resize_mode) == ((32, 48), "squash")


@pytest.mark.parametrize("processor_class", CLASSES)
def test_a_filter_we_do_not_have_is_approximated_by_the_class_default_and_said(
        processor_class):
    processor, rules = parse({"size": {"height": 32, "width": 32}, "resample": 1},
                             processor_class)  # PIL's LANCZOS
    default = "bicubic" if processor_class is CLIP_IMAGE_PROCESSOR else "bilinear"
    assert processor.resample == default
    assert rules == [f"preprocessor_config.json: resample 1 is not bilinear (2) or bicubic "
                     f"(3); using {processor_class.name}'s {default}"]


@pytest.mark.parametrize("processor_class", CLASSES)
@pytest.mark.parametrize("settings", [{"do_rescale": False}, {"rescale_factor": 1 / 127.5},
                                      {"rescale_factor": "1/255"}])
def test_a_rescale_other_than_1_255_is_refused_in_every_family(processor_class, settings):
    with pytest.raises(ValueError, match=r"x/preprocessor_config.json: rescales pixels other "
                                         r"than by 1/255"):
        parse(settings, processor_class)


@pytest.mark.parametrize("processor_class", CLASSES)
def test_sizes_read_alike(processor_class):
    clip_style = {"size": {"shortest_edge": 40}, "crop_size": {"height": 32, "width": 32},
                  "do_center_crop": True}
    processor, rules = parse(clip_style, processor_class)
    assert (processor.size, processor.resize_mode) == ((32, 32), "shortest_edge")
    assert len(rules) == 1 and "then crops (32, 32)" in rules[0]
    processor, rules = parse({"size": {"width": 7}}, processor_class)
    assert processor.size == FALLBACK.size and "is not understood" in rules[0]
