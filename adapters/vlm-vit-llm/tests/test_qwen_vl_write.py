"""A Qwen2-VL or Qwen2.5-VL model read from transformers, written back (issue 44): `llm export`
writes transformers' own class, loaded strictly, every tensor and the processor's settings as
read; `save_pretrained` keeps the base as transformers' folder with LoRA beside it; `llm train
--stage 2` continues one on LLaVA-format records and transformers generates our tokens from
the export."""

import json

import pytest
import torch
import transformers
from conftest import perturb_lora, photos
from PIL import Image
from test_qwen_vl_read import FAMILIES, IMAGE, PROMPTS, pictures, qwen_folder

from vlm_vit.io.integrity import IntegrityError
from vlm_vit_llm import MultimodalLM
from vlm_vit_llm.qwen_vl_writer import export_qwen_vl

LOGITS_ATOL = 1e-5  # merged LoRA against peft's unmerged forward: float32 rounding


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def qwen(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf, processor = qwen_folder(folder, request.param)
    return request.param, folder, hf, processor


def _logits(mm, prompts=PROMPTS):
    images = pictures()
    with torch.no_grad():
        return mm.run(mm.prepare(prompts, [images[:1], images[1:], []])).logits


def _strict(family, folder):
    model_class = getattr(transformers, FAMILIES[family] + "ForConditionalGeneration")
    model, info = model_class.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    return model.eval()


def test_an_export_is_transformers_class_with_every_tensor_as_read(qwen, tmp_path):
    family, folder, hf, processor = qwen
    export_qwen_vl(MultimodalLM.from_pretrained(folder), tmp_path / "back")
    back = _strict(family, tmp_path / "back")
    theirs, ours = hf.state_dict(), back.state_dict()
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[name], ours[name]) for name in theirs)
    written = transformers.AutoProcessor.from_pretrained(tmp_path / "back")
    assert type(written).__name__ == FAMILIES[family] + "Processor"
    for name in ("size", "patch_size", "merge_size", "temporal_patch_size", "image_mean",
                 "image_std", "resample"):
        value, expected = (getattr(one.image_processor, name) for one in (written, processor))
        assert (list(value) if name.startswith("image_") else value) == (
            list(expected) if name.startswith("image_") else expected), name


def test_a_saved_model_with_lora_reads_back_with_the_same_logits(qwen, tmp_path):
    family, folder, hf, processor = qwen
    mm = MultimodalLM.from_pretrained(folder)
    mm.add_lora(r=4, encoder_targets="attn_qv")
    perturb_lora(mm, hold_key_rows=True)
    before = _logits(mm.eval())
    mm.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "multimodal_config.json").read_text())
    assert config["llm_layout"] == family and config["llm_adapter"] and config["vision_adapter"]
    assert not (tmp_path / "saved" / "tower").exists()  # the tower is inside llm/
    read = MultimodalLM.from_pretrained(tmp_path / "saved").eval()
    torch.testing.assert_close(_logits(read), before, rtol=0, atol=0)
    # the export folds the LoRA in: transformers' logits on its own processor's input
    export_qwen_vl(read, tmp_path / "back")
    images = pictures()
    encoded = processor(text=PROMPTS, images=images, return_tensors="pt", padding=True)
    with torch.no_grad():
        theirs = _strict(family, tmp_path / "back")(**encoded).logits
    for row in range(len(PROMPTS)):
        real = encoded["attention_mask"][row].bool()
        torch.testing.assert_close(theirs[row][real], before[row][: int(real.sum())], rtol=0,
                                   atol=LOGITS_ATOL)


def test_a_changed_byte_in_the_saved_base_is_refused(qwen, tmp_path):
    family, folder, hf, processor = qwen
    MultimodalLM.from_pretrained(folder).save_pretrained(tmp_path / "saved")
    weights = tmp_path / "saved" / "llm" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="model.safetensors"):
        MultimodalLM.from_pretrained(tmp_path / "saved")


def test_an_unknown_llm_layout_is_one_line(qwen, tmp_path):
    family, folder, hf, processor = qwen
    MultimodalLM.from_pretrained(folder).save_pretrained(tmp_path / "saved")
    config_file = tmp_path / "saved" / "multimodal_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "llm_layout": "qwen9_vl"}))
    with pytest.raises(ValueError, match=r"llm_layout 'qwen9_vl' is not one this version reads "
                                         r"\(llava, .*qwen2_5_vl, qwen3_vl\)"):
        MultimodalLM.from_pretrained(tmp_path / "saved")


def test_a_tower_the_config_does_not_describe_is_refused_before_writing(qwen, tmp_path):
    family, folder, hf, processor = qwen
    mm = MultimodalLM.from_pretrained(folder)
    mm.llm.config.vision_config.depth = 3
    with pytest.raises(ValueError, match=r"the tower is not the one the LLM's config "
                                         r"describes: depth 3 \(the tower: 2\)"):
        export_qwen_vl(mm, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_a_multimodal_rope_family_without_a_writer_is_refused_before_writing(qwen, tmp_path):
    family, folder, hf, processor = qwen
    mm = MultimodalLM.from_pretrained(folder)
    mm.llm.config.model_type = "glm4v"  # M-RoPE, no writer
    with pytest.raises(ValueError, match=r"\(model_type 'glm4v'\) cannot be written yet; "
                                         r"vlm-vit-llm writes qwen2_vl, qwen2_5_vl, qwen3_vl"):
        mm.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


@pytest.mark.filterwarnings("ignore:The tied weights mapping")
def test_a_qwen_folder_continues_in_stage_2_on_llava_records_then_writes_back(qwen, tmp_path,
                                                                              capsys):
    """`llm train THEIR_FOLDER --stage 2 --packing` on records whose `<image>` becomes Qwen's
    vision-start, image-pad, vision-end; `llm merge`, `llm export`: transformers loads the
    export strictly and greedily generates our tokens."""
    from vlm_vit.cli import main

    family, folder, hf, processor = qwen
    (tmp_path / "images").mkdir()
    for index, array in enumerate(photos(3, size=40)):
        Image.fromarray(array).save(tmp_path / "images" / f"{index}.png")
    records = [{"id": str(index), "image": f"{index}.png", "conversations": [
        {"from": "human", "value": "<image>\nwhat is in the image"},
        {"from": "gpt", "value": f"a red square {index}"}]} for index in range(3)]
    (tmp_path / "data.json").write_text(json.dumps(records))
    assert main(["llm", "train", str(folder), "--stage", "2", "--lora-r", "4", "--packing",
                 "--data-format",
                 "llava", "--data", str(tmp_path / "data.json"), "--image-folder",
                 str(tmp_path / "images"), "--steps", "2", "--batch-size", "2",
                 "--num-workers", "0", "--device", "cpu", "--quiet", "--lr", "1e-2",
                 "--out", str(tmp_path / "s2")]) == 0
    out = capsys.readouterr().out
    assert "trained stage 2 for 2 steps" in out and "packing: attention varlen_sdpa" in out
    trained = MultimodalLM.from_pretrained(tmp_path / "s2" / "model")
    assert not torch.equal(_logits(trained.eval()), _logits(MultimodalLM.from_pretrained(folder)))
    assert main(["llm", "merge", str(tmp_path / "s2" / "model"), "--out",
                 str(tmp_path / "merged")]) == 0
    assert main(["llm", "export", str(tmp_path / "merged"), "--out", str(tmp_path / "back")]) == 0
    assert f"({FAMILIES[family]}ForConditionalGeneration)" in capsys.readouterr().out
    back = _strict(family, tmp_path / "back")
    prompt, picture = f"{IMAGE}what is in the image", pictures()[:1]
    written = transformers.AutoProcessor.from_pretrained(tmp_path / "back")
    written.image_processor = transformers.AutoImageProcessor.from_pretrained(
        tmp_path / "back", backend="pil")
    encoded = written(text=[prompt], images=picture, return_tensors="pt")
    with torch.no_grad():
        theirs = back.generate(**encoded, max_new_tokens=5, do_sample=False)
    new = theirs[0, encoded["input_ids"].shape[1]:]
    assert len(new) == 5  # no early end: five tokens to agree on
    ours = MultimodalLM.from_pretrained(tmp_path / "merged").eval()
    assert ours.generate([prompt], [picture], max_new_tokens=5, do_sample=False) == [
        ours.tokenizer.decode(new, skip_special_tokens=True).strip()]
