"""The LLaVA export loads in transformers and gives our logits."""

import pytest
import torch
from conftest import assert_export_matches, perturb_lora, photos, tiny_llm, tiny_tower
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


def test_the_export_is_prompted_and_generates_as_transformers_documents(tokenizer, tmp_path):
    """Issue 27, 3: transformers' LLaVA usage, line by line (structured content, the
    processor's chat template, `processor(images=, text=)`, `generate`, `decode`) gives the
    prompt and the greedy ids of our `llm generate --chat` path."""
    from PIL import Image
    from transformers import LlavaForConditionalGeneration

    from vlm_vit_llm import MultimodalLM
    from vlm_vit_llm.chat import chat_prompt, chat_template
    from vlm_vit_llm.records import Turn

    mm = MultimodalLM(tiny_tower(), tiny_llm(), tokenizer)
    _perturb(mm)
    mm.eval()
    export_llava(mm, tmp_path / "llava")
    image = Image.fromarray(photos(1)[0])

    # As transformers' LLaVA documentation writes it, with default arguments throughout.
    processor = AutoProcessor.from_pretrained(tmp_path / "llava")
    model = LlavaForConditionalGeneration.from_pretrained(tmp_path / "llava").eval()
    conversation = [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is shown in this image?"}]}]
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True)
    inputs = processor(images=image, text=prompt, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    generated = output[0, inputs["input_ids"].shape[1]:]
    answer = processor.decode(generated, skip_special_tokens=True)

    # Ours: `vlm-vit llm generate --chat --prompt $'<image>\nWhat is shown in this image?'`.
    ids = chat_prompt(mm.tokenizer, [Turn("user", "<image>\nWhat is shown in this image?")],
                      chat_template(mm.tokenizer))
    assert ids.count(mm.tokenizer.bos_token_id) == 1
    expanded = mm.prepare([ids], [[image]]).input_ids[0]
    assert inputs["input_ids"][0].tolist() == expanded.tolist()
    outputs = []
    llm_generate = mm.llm.generate

    def recording(*args, **kwargs):
        outputs.append(llm_generate(*args, **kwargs))
        return outputs[-1]

    mm.llm.generate = recording
    text = mm.generate([ids], [[image]], max_new_tokens=8, do_sample=False)[0]
    assert len(generated) > 1
    assert outputs[0][0].tolist() == generated.tolist()
    assert answer.strip() == text
    # Plain string content renders as before, structured content as its LLaVA layout.
    assert prompt == processor.apply_chat_template(
        [{"role": "user", "content": "<image>\nWhat is shown in this image?"}],
        add_generation_prompt=True)


def test_a_tokenizer_that_adds_its_own_bos_is_prompted_with_one(tokenizer, tmp_path):
    """With a tokenizer that adds its BOS (Llama-2's), the exported template writes none
    (as transformers' LLaVA templates), so the documented usage gives one BOS, not two."""
    from vlm_vit_llm import MultimodalLM

    tokenizer.add_bos_token = True
    assert tokenizer("a")["input_ids"][0] == tokenizer.bos_token_id
    mm = MultimodalLM(tiny_tower(), tiny_llm(), tokenizer)
    export_llava(mm, tmp_path / "llava")
    processor = AutoProcessor.from_pretrained(tmp_path / "llava")
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        add_generation_prompt=True)
    assert not prompt.startswith(tokenizer.bos_token)
    ids = processor(images=photos(1), text=prompt, return_tensors="pt")["input_ids"][0]
    assert ids.tolist().count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
