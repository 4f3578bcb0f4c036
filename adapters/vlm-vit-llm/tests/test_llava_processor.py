"""The exported LLaVA's own processor gives our pixels, crop offsets included; a processor
transformers cannot reproduce is refused before anything is written."""

import dataclasses

import pytest
import torch
from conftest import tiny_llm, tiny_tower
from PIL import Image
from transformers import AutoProcessor

from vlm_vit import ImageProcessor
from vlm_vit_llm import MultimodalLM, export_llava

# (width, height) around the 32 x 32 crop. Overhangs: 21 (10.5 -> 10 both ways), 23 (11.5 ->
# torchvision rounds to 12, transformers floors to 11), 22 (11 exactly); the doubled sizes are
# resized first (106 x 64 -> 53 x 32, ...).
SIZES = [(53, 32), (55, 32), (54, 32), (32, 53), (32, 55), (32, 54), (106, 64), (64, 110)]
ROUNDING_DIFFERS = {(53, 32): False, (55, 32): True, (54, 32): False, (32, 53): False,
                    (32, 55): True, (32, 54): False, (106, 64): False, (64, 110): True}


def photos_at(sizes):
    """Real scikit-image photos resized with PIL to each (width, height)."""
    from skimage import data

    sources = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
    return [Image.fromarray(sources[i % len(sources)]).resize(size, Image.Resampling.BICUBIC)
            for i, size in enumerate(sizes)]


def clip_floor_processor():
    return ImageProcessor.for_family("clip", size=32, resize_mode="shortest_edge",
                                     crop_rounding="floor")


def test_the_default_processor_crops_as_llava(mm):
    assert mm.processor == clip_floor_processor()  # MultimodalLM's default


def test_transformers_processor_gives_our_pixels_at_every_crop_offset(tokenizer, tmp_path):
    mm = MultimodalLM(tiny_tower(), tiny_llm(), tokenizer, processor=clip_floor_processor())
    export_llava(mm, tmp_path / "llava")
    theirs = AutoProcessor.from_pretrained(tmp_path / "llava", backend="pil").image_processor
    assert type(theirs).__name__ == "CLIPImageProcessorPil"
    rounded = dataclasses.replace(mm.processor, crop_rounding="round")
    for size, image in zip(SIZES, photos_at(SIZES), strict=True):
        ours = mm.processor.preprocess_one(image)
        expected = theirs(images=image, return_tensors="pt").pixel_values[0]
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0, msg=f"{size}")
        # the sizes do test the rounding: torchvision's crop moves where the .5 rounds up
        moved = not torch.equal(rounded.preprocess_one(image), ours)
        assert moved == ROUNDING_DIFFERS[size], size


def test_a_crop_transformers_rounds_otherwise_is_refused(tokenizer, tmp_path):
    rounded = dataclasses.replace(clip_floor_processor(), crop_rounding="round")
    mm = MultimodalLM(tiny_tower(), tiny_llm(), tokenizer, processor=rounded)
    with pytest.raises(ValueError, match="LLaVA layout: .*crop_rounding='round'"):
        export_llava(mm, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # Without a crop the rounding never applies.
    mm.processor = dataclasses.replace(rounded, resize_mode="squash")
    export_llava(mm, tmp_path / "squash")
    image = photos_at([(55, 32)])[0]
    theirs = AutoProcessor.from_pretrained(tmp_path / "squash", backend="pil")
    torch.testing.assert_close(theirs.image_processor(images=image, return_tensors="pt")
                               .pixel_values[0], mm.processor.preprocess_one(image),
                               atol=1e-5, rtol=0)
