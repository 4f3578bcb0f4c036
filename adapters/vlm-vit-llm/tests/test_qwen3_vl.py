"""transformers' Qwen3-VL folders read as a `MultimodalLM` with DeepStack (issue 44): a tiny
`Qwen3VLForConditionalGeneration` built at random by transformers (DeepStack mergers after
vision blocks 0 and 1, feeding LLM layers 0 and 1) and saved with its processor; ours gives
transformers' token ids, 3D positions, logits and greedy tokens on prompts with one, two and
no images, and zeroed DeepStack taps change them (the comparison sees DeepStack); packed rows
give the loss and every gradient of the records alone; `llm export` and `save_pretrained`
write transformers' own class, loaded strictly, with our logits."""

from dataclasses import replace

import pytest
import torch
import transformers
from test_llm_packing import assert_every_path_equals_records_alone
from test_qwen_vl_packing import RECORDS, records_batch
from test_qwen_vl_read import IMAGE, LOGITS_ATOL, PROMPTS, pictures, qwen_folder

from vlm_vit_llm import MultimodalLM, Video
from vlm_vit_llm.deepstack import DeepStack
from vlm_vit_llm.mrope import generation_inputs
from vlm_vit_llm.qwen_vl_writer import export_qwen_vl

FAMILY = "qwen3_vl"
IMAGES = [slice(0, 1), slice(1, 3), slice(0, 0)]  # PROMPTS' images: one, two, none


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp(FAMILY)
    hf, processor = qwen_folder(folder, FAMILY)
    return folder, hf, processor, MultimodalLM.from_pretrained(folder)


def _ours(mm, prompts=PROMPTS, padding_side="right"):
    images = pictures()
    return mm.prepare(prompts, [images[which] for which in IMAGES[:len(prompts)]],
                      padding_side=padding_side)


def _theirs(processor, prompts=PROMPTS, padding_side="right"):
    return processor(text=prompts, images=pictures()[:3 if len(prompts) > 1 else 1],
                     return_tensors="pt", padding=True, padding_side=padding_side)


def _assert_logits(mine, batch, theirs, encoded, atol=LOGITS_ATOL):
    torch.testing.assert_close(mine[batch.attention_mask.bool()],
                               theirs[encoded["attention_mask"].bool()], rtol=0, atol=atol)


def test_the_logits_are_transformers_on_its_own_processor_s_input(qwen3):
    folder, hf, processor, ours = qwen3
    assert isinstance(ours.deepstack, DeepStack) and len(ours.deepstack.mergers) == 2
    encoded, batch = _theirs(processor), _ours(ours)
    assert torch.equal(batch.input_ids, encoded["input_ids"])
    assert [tuple(one.shape) for one in batch.deepstack_features] == \
        [tuple(batch.image_features.shape)] * 2
    with torch.no_grad():
        theirs, mine = hf(**encoded).logits, ours.run(batch).logits
    _assert_logits(mine, batch, theirs, encoded)


def test_zeroed_deepstack_taps_change_the_image_prompts_logits_only(qwen3):
    """DeepStack moves the logits at and after the image tokens, far beyond the tolerance
    above, and leaves the prompt without images alone."""
    folder, hf, processor, ours = qwen3
    batch = _ours(ours)
    zeroed = replace(batch, deepstack_features=tuple(
        torch.zeros_like(one) for one in batch.deepstack_features))
    with torch.no_grad():
        mine, without = ours.run(batch).logits, ours.run(zeroed).logits
    moved = (mine - without).abs().amax(dim=(1, 2))
    assert moved[0] > 100 * LOGITS_ATOL and moved[1] > 100 * LOGITS_ATOL
    assert moved[2] == 0


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_the_3d_positions_are_get_rope_index_s(qwen3, padding_side):
    folder, hf, processor, ours = qwen3
    encoded = _theirs(processor, padding_side=padding_side)
    theirs, _ = hf.model.get_rope_index(
        encoded["input_ids"], encoded["mm_token_type_ids"],
        image_grid_thw=encoded["image_grid_thw"], attention_mask=encoded["attention_mask"])
    batch = _ours(ours, padding_side=padding_side)
    assert torch.equal(batch.attention_mask, encoded["attention_mask"])
    assert torch.equal(batch.position_ids, theirs)


@pytest.mark.parametrize("tie", [(True, False), (False, True)], ids=["top", "text"])
def test_the_tie_is_transformers_s_at_either_config_level(tmp_path, tie):
    """Qwen3-VL ties by the top-level `tie_word_embeddings` only (unlike Qwen2-VL, the text
    config's is not carried up: transformers 5.25 saves an untied head then); ours ties as
    transformers does and reads the same head."""
    hf, processor = qwen_folder(tmp_path, FAMILY, tie)
    ours = MultimodalLM.from_pretrained(tmp_path)
    for model in (hf, ours.llm):
        tied = model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        assert tied == tie[0]
    encoded, batch = _theirs(processor), _ours(ours)
    with torch.no_grad():
        _assert_logits(ours.run(batch).logits, batch, hf(**encoded).logits, encoded)


def test_greedy_generation_and_every_decoding_step_are_transformers(qwen3):
    """The prefill takes the DeepStack features, the decoding steps (one token each, its
    image tokens in the cache) do not."""
    folder, hf, processor, ours = qwen3
    prompts = PROMPTS[:2]
    settings = dict(max_new_tokens=4, do_sample=False, output_logits=True,
                    return_dict_in_generate=True, pad_token_id=ours.pad_token_id)
    encoded = _theirs(processor, prompts, padding_side="left")
    batch = _ours(ours, prompts, padding_side="left")
    with torch.no_grad(), ours.deepstack.feeding(batch.image_mask, batch.deepstack_features):
        theirs = hf.generate(**encoded, **settings)
        mine = ours.llm.generate(inputs_embeds=ours.embed(batch),
                                 attention_mask=batch.attention_mask,
                                 **generation_inputs(batch), **settings)
    assert len(mine.logits) == len(theirs.logits) == 4
    for step, (a, b) in enumerate(zip(mine.logits, theirs.logits)):
        torch.testing.assert_close(a, b, rtol=0, atol=LOGITS_ATOL, msg=f"step {step}")
    new = theirs.sequences[:, encoded["input_ids"].shape[1]:]
    expected = [text.strip() for text in ours.tokenizer.batch_decode(
        new, skip_special_tokens=True)]
    images = pictures()
    assert ours.generate(prompts, [images[:1], images[1:]], max_new_tokens=4,
                         do_sample=False) == expected


@pytest.mark.parametrize(("frames", "fps"), [(4, 2.0), (3, None)])
def test_a_clip_gives_transformers_timestamps_ids_positions_and_logits(qwen3, frames, fps):
    """A clip: transformers' video processor and its timestamped prompt against ours on the
    chat template's wrapped placeholder, beside an image (odd frame counts fill the last
    temporal patch with the last frame; no fps is transformers' 24)."""
    from PIL import Image
    from test_qwen_vl_read import photos

    folder, hf, processor, ours = qwen3
    clip = [Image.fromarray(array) for array in photos(frames, size=48)]
    prompt = f"{IMAGE}and <|vision_start|><|video_pad|><|vision_end|>what happens"
    metadata = {"total_num_frames": frames, "frames_indices": list(range(frames)),
                **({} if fps is None else {"fps": fps})}
    encoded = processor(text=[prompt], images=pictures()[:1], videos=[clip],
                        video_metadata=[metadata], do_sample_frames=False, return_tensors="pt")
    assert encoded["video_grid_thw"][0].tolist() == [2, 4, 4]  # 48 x 48 frames made 32 x 32
    batch = ours.prepare([prompt], [[pictures()[0], Video(clip, fps)]])
    assert torch.equal(batch.input_ids, encoded["input_ids"])  # the timestamps as text
    theirs_ids, _ = hf.model.get_rope_index(
        encoded["input_ids"], encoded["mm_token_type_ids"],
        image_grid_thw=encoded["image_grid_thw"], video_grid_thw=encoded["video_grid_thw"],
        attention_mask=encoded["attention_mask"])
    assert torch.equal(batch.position_ids, theirs_ids)
    with torch.no_grad():
        theirs, mine = hf(**encoded).logits, ours.run(batch).logits
    torch.testing.assert_close(mine, theirs, rtol=0, atol=LOGITS_ATOL)


def test_a_clip_in_a_prompt_of_token_ids_is_refused_by_name(qwen3):
    folder, hf, processor, ours = qwen3
    ids = ours.tokenizer("<|vision_start|><|video_pad|><|vision_end|>what")["input_ids"]
    with pytest.raises(ValueError, match="prompt 0 holds a clip but is given as token ids"):
        ours.prepare([ids], [[Video(torch.zeros(2, 3, 32, 32))]])


def test_packed_loss_and_every_gradient_equal_records_alone(qwen3):
    """Under both reductions and the three CPU attention paths (float32, within 2e-5 of the
    largest gradient): the DeepStack mergers get theirs, each record's taps at its own image
    tokens though the rows reorder the records."""
    mm = MultimodalLM.from_pretrained(qwen3[0]).requires_grad_(True).train()
    batch = records_batch(mm)
    assert [index for row in batch.rows for index in row] != list(range(len(RECORDS)))
    assert_every_path_equals_records_alone(mm, batch, {"tower", "llm", "deepstack"})


@pytest.mark.parametrize("setup", ["stage1", "lora"])
def test_the_deepstack_mergers_train_with_the_projector(qwen3, setup):
    """Stage 1 and LoRA train the merger fully, and Qwen3-VL's DeepStack mergers with it:
    each gets a gradient from a loss over image prompts; the encoder's base weights do not."""
    mm = MultimodalLM.from_pretrained(qwen3[0]).train()
    if setup == "stage1":
        mm.train_projector_only()
    else:
        mm.add_lora(r=4)
    mergers = dict(mm.deepstack.mergers.named_parameters())
    assert mergers and all(parameter.requires_grad for parameter in mergers.values())
    mm.run(_ours(mm)).logits.square().mean().backward()
    for name, parameter in mergers.items():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    assert all(parameter.grad is None for parameter in mm.tower.encoder.parameters())


def _strict(folder):
    model, info = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        folder, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    return model.eval()


def test_an_export_is_transformers_class_with_every_tensor_and_our_logits(qwen3, tmp_path):
    folder, hf, processor, ours = qwen3
    export_qwen_vl(ours, tmp_path / "back")
    back = _strict(tmp_path / "back")
    theirs, written = hf.state_dict(), back.state_dict()
    assert theirs.keys() == written.keys()
    assert all(torch.equal(theirs[name], written[name]) for name in theirs)
    assert type(transformers.AutoProcessor.from_pretrained(tmp_path / "back")).__name__ == \
        "Qwen3VLProcessor"
    encoded, batch = _theirs(processor), _ours(ours)
    with torch.no_grad():
        _assert_logits(ours.run(batch).logits, batch, back(**encoded).logits, encoded)


def test_a_saved_model_with_lora_reads_back_with_the_same_logits(qwen3, tmp_path):
    """LoRA on the LLM and the encoder, every DeepStack merger changed: `save_pretrained`
    keeps transformers' folder (DeepStack mergers in it) and the LoRA beside it; the export
    folds the LoRA in and transformers computes our logits."""
    from conftest import perturb_lora

    folder, hf, processor, _ = qwen3
    mm = MultimodalLM.from_pretrained(folder)
    mm.add_lora(r=4, encoder_targets="attn_qv")
    perturb_lora(mm, hold_key_rows=True)
    with torch.no_grad():
        for parameter in mm.deepstack.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
        before = mm.eval().run(_ours(mm)).logits
    mm.save_pretrained(tmp_path / "saved")
    read = MultimodalLM.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        torch.testing.assert_close(read.run(_ours(read)).logits, before, rtol=0, atol=0)
    export_qwen_vl(read, tmp_path / "back")
    encoded, batch = _theirs(processor), _ours(read)
    with torch.no_grad():
        _assert_logits(before, batch, _strict(tmp_path / "back")(**encoded).logits, encoded,
                       atol=1e-5)


def test_deepstack_must_be_on_exactly_a_qwen3_vl_model_to_be_written(qwen3, tmp_path):
    folder, hf, processor, ours = qwen3
    mm = MultimodalLM.from_pretrained(folder)
    mm.deepstack = None
    with pytest.raises(ValueError, match="qwen3_vl holds DeepStack mergers exactly when it "
                                         "is Qwen3-VL; this model has none"):
        export_qwen_vl(mm, tmp_path / "back")
    assert not (tmp_path / "back").exists()


@pytest.mark.filterwarnings("ignore:The tied weights mapping")
def test_llm_train_packing_merge_and_export_round_trip(qwen3, tmp_path, capsys, monkeypatch):
    """Qwen2-VL's CLI round trip on Qwen3-VL: `llm train --stage 2 --packing`, `llm merge`,
    `llm export`; transformers generates our greedy tokens from the export."""
    import test_qwen_vl_write

    monkeypatch.setitem(test_qwen_vl_write.FAMILIES, FAMILY, "Qwen3VL")
    folder, hf, processor, _ = qwen3
    test_qwen_vl_write.test_a_qwen_folder_continues_in_stage_2_on_llava_records_then_writes_back(
        (FAMILY, folder, hf, processor), tmp_path, capsys)


def test_stage_1_with_the_feature_cache_is_refused_by_name(qwen3, tmp_path, capsys):
    """The stage-1 cache holds the tower's layer, not the DeepStack taps: one line, no run."""
    import json

    from PIL import Image

    from vlm_vit.cli import main

    (tmp_path / "images").mkdir()
    Image.new("RGB", (40, 40), "red").save(tmp_path / "images" / "0.png")
    records = [{"id": "0", "image": "0.png", "conversations": [
        {"from": "human", "value": "<image>\nwhat is it"}, {"from": "gpt", "value": "red"}]}]
    (tmp_path / "data.json").write_text(json.dumps(records))
    assert main(["llm", "train", str(qwen3[0]), "--stage", "1", "--data-format", "llava",
                 "--data", str(tmp_path / "data.json"), "--image-folder",
                 str(tmp_path / "images"), "--steps", "1", "--num-workers", "0", "--quiet",
                 "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "s1")]) == 1
    err = capsys.readouterr().err.strip()
    assert "--cache holds the tower's feature layer, not the DeepStack taps" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "s1").exists()


def test_a_clip_in_a_training_record_is_timestamped_as_in_a_text_prompt(qwen3):
    """The records' path (rendered, tokenised, then expanded) writes a clip's timestamps and
    temporal patches as the text-prompt path, which equals transformers' processor above;
    the record's loss is the text prompt's."""
    from PIL import Image
    from test_qwen_vl_read import photos

    from vlm_vit_llm.chat import render_conversation
    from vlm_vit_llm.conversation_batch import load_pixels
    from vlm_vit_llm.conversations import ConversationCollate, ConversationItem
    from vlm_vit_llm.records import Turn

    folder, hf, processor, ours = qwen3
    clip = [Image.fromarray(array) for array in photos(4, size=48)]
    turns = [Turn("user", f"{IMAGE}what happens"), Turn("assistant", "a red square")]
    collate = ConversationCollate(ours, max_length=512)
    item = ConversationItem("r", turns, [load_pixels(ours.processor, Video(clip, 2.0),
                                                     ours.video_processor)])
    ids, labels, pixels = collate.encode(item)
    assert len(pixels) == 2 and all(len(piece.frames) == 2 for piece in pixels)
    record = ours.prepare([ids], [pixels], token_labels=[labels])
    text, _ = render_conversation(ours.tokenizer, turns, collate.template)
    prompt = ours.prepare([text], [[Video(clip, 2.0)]])
    assert "<0.2 seconds>" in ours.tokenizer.decode(record.input_ids[0])
    assert torch.equal(record.input_ids, prompt.input_ids)
    assert torch.equal(record.position_ids, prompt.position_ids)
    with torch.no_grad():
        torch.testing.assert_close(ours.run(record).logits, ours.run(prompt).logits,
                                   rtol=0, atol=0)
