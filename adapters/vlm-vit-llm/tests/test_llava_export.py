"""The LLaVA export loads in transformers and gives our logits."""

import pytest
import torch
from conftest import assert_export_matches, perturb_lora, photos
from transformers import AutoProcessor

from vlm_vit import build_pooler
from vlm_vit_llm import export_llava

PROMPTS = ["<image>\nwhat is in the image", "<image> the dog <image>"]


def _perturb(mm):
    """Random-init biases are 0 and LoRA starts as a no-op; make every weight count. The
    qkv biases too, each slice its own: a swap of the q and v slices must show."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in mm.named_parameters():
            if name.startswith("tower.") and ".lora_" not in name:
                parameter.add_(torch.randn_like(parameter) * 0.02)
    perturb_lora(mm)


@pytest.mark.parametrize("lora", [False, True])
def test_the_export_loads_in_transformers_with_the_same_logits(mm, tmp_path, lora):
    if lora:
        mm.add_lora(r=4, encoder_targets="attn")
    _perturb(mm)
    mm.eval()
    images = photos(3)
    per_prompt = [[images[0]], [images[1], images[2]]]
    export_llava(mm, tmp_path / "llava")

    hf = assert_export_matches(mm, tmp_path / "llava", PROMPTS, per_prompt, images)
    assert hf.config.vision_feature_layer == -2
    assert hf.config.vision_feature_select_strategy == "default"
    batch = mm.prepare(PROMPTS, per_prompt)
    mask = batch.attention_mask.bool()
    pixel_values = torch.stack([mm.processor.preprocess_one(image) for image in images])

    # transformers' own processor expands the placeholders and preprocesses as we do.
    processor = AutoProcessor.from_pretrained(tmp_path / "llava")
    encoded = processor(text=PROMPTS, images=images, return_tensors="pt", padding=True)
    for row in range(2):
        real = encoded["attention_mask"][row].bool()
        assert encoded["input_ids"][row][real].tolist() == batch.input_ids[row][mask[row]].tolist()
    torch.testing.assert_close(encoded["pixel_values"], pixel_values, rtol=0, atol=1e-5)


def test_what_llava_cannot_hold_is_refused_and_nothing_is_written(mm, tmp_path):
    mm.tower.feature_layer = None
    with pytest.raises(ValueError, match="feature_layer=-2"):
        export_llava(mm, tmp_path / "out")
    mm.tower.feature_layer = -2
    mm.tower.pooler = build_pooler("linear", in_dim=32, out_dim=64)
    with pytest.raises(ValueError, match="'linear'; LLaVA holds 'mlp2x_gelu'"):
        export_llava(mm, tmp_path / "out")
    assert not (tmp_path / "out").exists()
