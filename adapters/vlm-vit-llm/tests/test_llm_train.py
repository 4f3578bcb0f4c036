"""LLaVA's stages on vlm-vit's trainer: the image tokens really condition the LLM."""

import json

import pytest
import torch
from conftest import CAPTIONS, photos, tiny_llm, tiny_tower
from PIL import Image

from vlm_vit.train import TrainConfig, Trainer
from vlm_vit_llm import MultimodalLM
from vlm_vit_llm.objective import MODEL_DIR
from vlm_vit_llm.train import (
    CaptionCollate,
    CaptionFolder,
    CaptionObjective,
    read_captions,
)


def write_captions(folder, captions=CAPTIONS):
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for index, (photo, caption) in enumerate(zip(photos(len(captions)), captions, strict=True)):
        Image.fromarray(photo).save(folder / f"{index}.png")
        lines.append(json.dumps({"image": f"{index}.png", "caption": caption}))
    (folder / "captions.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "captions.jsonl"


def fit(mm, data, run_dir, steps, lr):
    config = TrainConfig(steps=steps, batch_size=4, lr=lr, warmup_steps=10, weight_decay=0.0,
                         num_workers=0, checkpoint_every=0, log_every=100, device="cpu")
    dataset = CaptionFolder(data, data / "captions.jsonl", mm.processor)
    return Trainer(CaptionObjective(mm), dataset, config, run_dir,
                   collate=CaptionCollate(mm), progress=False).fit()


def test_stage_1_teaches_the_projector_to_caption_each_image(tmp_path, tokenizer):
    """Eighty projector-only steps at a high learning rate on four pairs: greedy generation
    gives each image's caption, and swapping the images swaps the captions."""
    data = tmp_path / "data"
    write_captions(data)
    mm = MultimodalLM(tiny_tower(), tiny_llm(), tokenizer).train_projector_only()
    frozen = {name: p.detach().clone() for name, p in mm.named_parameters()
              if not name.startswith("tower.pooler.")}
    result = fit(mm, data, tmp_path / "run", steps=80, lr=5e-2)
    assert result.losses[-1] < 0.1 < result.losses[0]
    for name, parameter in mm.named_parameters():
        if name in frozen:
            assert torch.equal(parameter, frozen[name]), name  # frozen parts never moved

    mm.eval()
    pixels = [mm.processor.preprocess_one(data / f"{i}.png") for i in range(4)]
    prompts = ["<image>\n"] * 4
    assert mm.generate(prompts, [[p] for p in pixels], do_sample=False) == CAPTIONS
    swapped = mm.generate(prompts, [[p] for p in pixels[::-1]], do_sample=False)
    assert swapped == CAPTIONS[::-1]

    # The run leaves the whole model, which loads and captions the same.
    loaded = MultimodalLM.from_pretrained(tmp_path / "run" / MODEL_DIR).eval()
    assert loaded.generate(prompts, [[p] for p in pixels], do_sample=False) == CAPTIONS
    run_config = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert run_config["objective"]["type"].endswith("CaptionObjective")


def test_stage_2_trains_lora_and_the_projector_and_saves_the_adapter(tmp_path, tokenizer):
    data = tmp_path / "data"
    write_captions(data)
    mm = MultimodalLM(tiny_tower(), tiny_llm(), tokenizer).add_lora(r=4, encoder_targets="attn")
    before = {name: p.detach().clone() for name, p in mm.named_parameters()}
    result = fit(mm, data, tmp_path / "run", steps=30, lr=3e-3)
    assert result.losses[-1] < result.losses[0]
    for name, parameter in mm.named_parameters():
        moved = not torch.equal(parameter, before[name])
        assert moved == parameter.requires_grad, name  # exactly the trainable ones moved
    saved = tmp_path / "run" / MODEL_DIR
    assert (saved / "llm_adapter" / "adapter_config.json").is_file()
    assert (saved / "vision_adapter" / "adapter_config.json").is_file()
    loaded = MultimodalLM.from_pretrained(saved).eval()
    mm.eval()
    with torch.no_grad():
        image = [[mm.processor.preprocess_one(data / "0.png")]]
        torch.testing.assert_close(loaded(["<image>\n"], image).logits,
                                   mm(["<image>\n"], image).logits, rtol=0, atol=1e-6)


def test_an_undecodable_image_is_skipped_and_named(tmp_path, tokenizer):
    data = tmp_path / "data"
    write_captions(data)
    (data / "1.png").write_bytes(b"not a png")
    mm = MultimodalLM(tiny_tower(), tiny_llm(), tokenizer).train_projector_only()
    result = fit(mm, data, tmp_path / "run", steps=2, lr=1e-3)
    assert result.undecodable_images >= 1
    assert any(path.endswith("1.png") for path in result.undecodable_paths)


@pytest.mark.parametrize(("line", "message"), [
    ("not json", "line 2 is not JSON"),
    ('{"image": "0.png"}', "line 2 needs string fields 'image' and 'caption'"),
    ('{"image": "0.png", "caption": "x", "prompt": 3}', "line 2 needs string fields"),
    ('{"image": "missing.png", "caption": "x"}', "line 2: no image"),
])
def test_a_bad_captions_file_is_refused_by_line(tmp_path, line, message):
    captions = write_captions(tmp_path, CAPTIONS[:1])
    captions.write_text(captions.read_text() + line + "\n")
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        read_captions(captions, tmp_path)


def test_a_prompt_must_hold_one_placeholder(mm):
    with pytest.raises(ValueError, match="exactly once"):
        CaptionCollate(mm, prompt="no image")


def test_a_line_may_bring_its_own_prompt(tmp_path, mm):
    """Instruction data: a line's own prompt reaches the model, the others get the default,
    and the loss is the model's caption loss on exactly those prompts."""
    captions = write_captions(tmp_path, CAPTIONS[:2])
    lines = captions.read_text().splitlines()
    own = json.loads(lines[1]) | {"prompt": "what is in the image <image>"}
    captions.write_text(lines[0] + "\n" + json.dumps(own) + "\n")
    dataset = CaptionFolder(tmp_path, captions, mm.processor)
    assert [row.prompt for row in dataset.rows] == [None, "what is in the image <image>"]
    batch = CaptionCollate(mm, prompt="<image>\ndescribe the picture")(
        [dataset[0], dataset[1]])
    prompts = ["<image>\ndescribe the picture", "what is in the image <image>"]
    for row, prompt in enumerate(prompts):
        ids = batch.labels[row, 0]
        assert ids[ids != -100].tolist() == mm.tokenizer(prompt)["input_ids"]
        caption = batch.labels[row, 1]
        assert caption[caption != -100].tolist() == mm.encode_target(CAPTIONS[row])
    images = [[image] for image in batch.pixel_values]
    with torch.no_grad():
        loss = CaptionObjective(mm)(batch.pixel_values, batch.labels).loss
        expected = mm(prompts, images, targets=CAPTIONS[:2]).loss
    torch.testing.assert_close(loss, expected)
    bad = json.loads(lines[0]) | {"prompt": "two <image> <image>"}
    captions.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match="exactly once"):
        CaptionCollate(mm)([CaptionFolder(tmp_path, captions, mm.processor)[0]])
