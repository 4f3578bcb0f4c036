"""A tiled (AnyRes) model exports as transformers' LLaVA-NeXT, or OneVision for
`anyres_max_N`: loaded strictly, it gives our logits; its processor gives our pixels and
our token counts; a folder transformers wrote itself reads back as a `MultimodalLM` with
the same logits; a tiling the layout cannot hold is refused by name."""

import dataclasses

import pytest
import torch
from test_llm_anyres import LOGITS_ATOL, PINPOINTS, image, tiled_mm
from transformers import AutoImageProcessor, AutoProcessor

from vlm_vit.processor import Tiling
from vlm_vit_llm import MultimodalLM, export_llava
from vlm_vit_llm.llava_next import model_class, read_llava
from vlm_vit_llm.pixels import as_tiled

PIXEL_ATOL = 1e-5
# 950 x 1256, 700 x 840 and 640 x 427 at a 32-pixel tile (x 32/336), both orientations.
SIZES = [(90, 120), (120, 90), (67, 80), (80, 67), (61, 41), (41, 61)]
TILINGS = {"next": Tiling(pinpoints=PINPOINTS, tile_size=32),
           "onevision": Tiling(pinpoints=[*PINPOINTS, [96, 96]], tile_size=32,
                               max_feature_tiles=1)}


def pil_processor(folder):
    """The folder's processor with its image processor on transformers' PIL backend (the
    default torchvision one rounds its bicubic resize one uint8 level off now and then)."""
    processor = AutoProcessor.from_pretrained(folder)
    processor.image_processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    return processor


@pytest.mark.parametrize("family", sorted(TILINGS))
def test_the_anyres_export_loads_strictly_with_our_logits_pixels_and_counts(tokenizer, tmp_path,
                                                                            family):
    mm = tiled_mm(tokenizer, TILINGS[family])
    export_llava(mm, tmp_path / "out")
    hf, info = model_class(mm.tower.tiling).from_pretrained(tmp_path / "out",
                                                            output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    assert torch.equal(hf.model.image_newline, mm.tower.image_newline)
    hf.eval()
    processor = pil_processor(tmp_path / "out")
    default = AutoProcessor.from_pretrained(tmp_path / "out")  # transformers' torchvision

    # One image per prompt: OneVision's multi-image prompts encode base views only.
    prompts = ["<image>\nwhat is in the image", "the dog <image>"]
    pictures = [image(*SIZES[0]), image(*SIZES[5])]
    batch = mm.prepare(prompts, [[pictures[0]], [pictures[1]]])
    encoded = processor(text=prompts, images=pictures, return_tensors="pt", padding=True)
    real = batch.attention_mask.bool()
    for row in range(2):
        mine = encoded["attention_mask"][row].bool()
        assert encoded["input_ids"][row][mine].tolist() == batch.input_ids[row][real[row]].tolist()
    with torch.no_grad():
        ours = mm.run(batch).logits
        theirs = hf(**encoded).logits
    for row in range(2):
        mine = encoded["attention_mask"][row].bool()
        torch.testing.assert_close(theirs[row][mine], ours[row][real[row]], rtol=0,
                                   atol=LOGITS_ATOL)

    for size in SIZES:
        picture = image(*size)
        tiled = as_tiled(picture, mm.processor, 0)
        for loaded in (processor, default):
            out = loaded(text=["<image>"], images=[picture], return_tensors="pt")
            assert out["image_sizes"][0].tolist() == list(size)
            count = (out["input_ids"][0] == mm.image_token_id).sum().item()
            assert count == mm.tower.num_image_tokens(size), (size, family)
        pixels = processor(text=["<image>"], images=[picture], return_tensors="pt")
        torch.testing.assert_close(pixels["pixel_values"][0][:len(tiled.views)], tiled.views,
                                   rtol=0, atol=PIXEL_ATOL)


def test_a_folder_transformers_wrote_reads_back_with_its_logits(tokenizer, tmp_path):
    """`save_pretrained` of a tiny random LlavaNextForConditionalGeneration (with its
    processor), read by `MultimodalLM.from_pretrained`."""
    mm = tiled_mm(tokenizer)
    export_llava(mm, tmp_path / "export")
    hf = model_class(mm.tower.tiling).from_pretrained(tmp_path / "export").eval()
    torch.manual_seed(3)
    with torch.no_grad():  # transformers' own model now, not ours: new random weights
        for parameter in hf.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    hf.save_pretrained(tmp_path / "theirs")
    AutoProcessor.from_pretrained(tmp_path / "export").save_pretrained(tmp_path / "theirs")

    read = MultimodalLM.from_pretrained(tmp_path / "theirs")
    assert read.tower.tiling == mm.tower.tiling
    prompts = ["<image>\nwhat is in the image", "<image> the dog <image>"]
    pictures = [image(90, 120), image(41, 61), image(90, 120)]
    batch = read.prepare(prompts, [[pictures[0]], pictures[1:]])
    processor = pil_processor(tmp_path / "theirs")
    encoded = processor(text=prompts, images=pictures, return_tensors="pt", padding=True)
    with torch.no_grad():
        ours = read.run(batch).logits
        theirs = hf(**encoded).logits
    for row in range(2):
        mine, real = encoded["attention_mask"][row].bool(), batch.attention_mask[row].bool()
        assert encoded["input_ids"][row][mine].tolist() == batch.input_ids[row][real].tolist()
        torch.testing.assert_close(ours[row][real], theirs[row][mine], rtol=0, atol=LOGITS_ATOL)
    assert read_llava(tmp_path / "theirs").tower.tiling == mm.tower.tiling


@pytest.mark.parametrize("change, match", [
    (dict(newline=False), "tiling newline=False: LLaVA-NeXT and OneVision end every row"),
    (dict(base_image=False), "tiling base_image=False"),
])
def test_a_tiling_the_layout_cannot_hold_is_refused_by_name(tokenizer, tmp_path, change, match):
    tiling = dataclasses.replace(TILINGS["next"], **change)
    mm = tiled_mm(tokenizer, tiling)
    with pytest.raises(ValueError, match=match):
        export_llava(mm, tmp_path / "out")
    assert not (tmp_path / "out").exists()
