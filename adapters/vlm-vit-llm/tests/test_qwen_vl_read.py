"""transformers' Qwen2-VL and Qwen2.5-VL folders read as a `MultimodalLM` (issue 44): tiny
models built at random by transformers and saved with their processors; ours gives
transformers' token ids, 3D positions (`get_rope_index`), logits and greedy tokens on prompts
with one, two and no images; what cannot be read is one line before any weight is."""

import json

import pytest
import torch
import transformers
from conftest import CORPUS, photos
from PIL import Image

from vlm_vit_llm import MultimodalLM

LOGITS_ATOL = 1e-4
MAX_LINE = 300
FAMILIES = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}
SPECIAL = ["<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = [f"{IMAGE}what is in the image", f"the dog {IMAGE} runs {IMAGE}", "a red square"]
# Every class name prefix `qwen_folder` builds; Qwen3-VL's own tests are test_qwen3_vl.py.
CLASS_NAMES = {**FAMILIES, "qwen3_vl": "Qwen3VL"}
VISION = {  # tiny towers: patch 8, 2x2 merge, 2 frames a temporal patch
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
    "qwen2_5_vl": dict(depth=2, hidden_size=32, out_hidden_size=64, num_heads=2,
                       intermediate_size=64, window_size=32, fullatt_block_indexes=[1],
                       tokens_per_second=2),
    # a 6 x 6 position table; DeepStack mergers after blocks 0 and 1 feed LLM layers 0 and 1
    "qwen3_vl": dict(depth=3, hidden_size=32, out_hidden_size=64, num_heads=2,
                     intermediate_size=48, num_position_embeddings=36,
                     deepstack_visual_indexes=[0, 1]),
}
TEXT = {"qwen2_vl": {}, "qwen2_5_vl": {}, "qwen3_vl": dict(head_dim=16)}
VIDEO_PROCESSORS = {"qwen3_vl": "Qwen3VLVideoProcessor"}
MEAN_STD = {"qwen3_vl": dict(image_mean=[0.5] * 3, image_std=[0.5] * 3)}  # Qwen3-VL's own
# The video processors' own bounds, not the image processor's (Qwen2-VL's the same). Qwen3-VL's
# reads only `size`, its bounds over the clip's frames: 5000 pixels, which shrink the tests'
# 4 (or 3) frames of 48 x 48 to 32 x 32.
VIDEO_SIZES = {"qwen2_5_vl": dict(max_pixels=56 * 56, fps=2.0),  # fps: what sampling keeps
               "qwen3_vl": dict(size={"shortest_edge": 16 * 16, "longest_edge": 5000})}


def qwen_tokenizer():
    """A byte-level BPE with Qwen's vision tokens, as Qwen2's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer,
                                                eos_token="<|endoftext|>",
                                                pad_token="<|endoftext|>")


def qwen_folder(folder, family: str, tie: tuple[bool, bool] = (False, False)):
    """`save_pretrained` of a tiny random model of the family (every weight off its init)
    and its processor, `tie_word_embeddings` at the top level and in the text config as
    `tie` says; returns transformers' reading of it and its processor (PIL)."""
    tokenizer = qwen_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL}
    config = getattr(transformers, CLASS_NAMES[family] + "Config")(
        vision_config=dict(VISION[family], patch_size=8, spatial_merge_size=2,
                           temporal_patch_size=2),
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=len(tokenizer) + 4, eos_token_id=0, bos_token_id=0,
                         max_position_embeddings=512, tie_word_embeddings=tie[1],
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                          "rope_theta": 10000.0}, **TEXT[family]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie[0])
    model_class = getattr(transformers, CLASS_NAMES[family] + "ForConditionalGeneration")
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    model.save_pretrained(folder)
    sizes = dict(min_pixels=16 * 16, max_pixels=64 * 64, patch_size=8, merge_size=2,
                 temporal_patch_size=2)
    video = getattr(transformers, VIDEO_PROCESSORS.get(family, "Qwen2VLVideoProcessor"))
    getattr(transformers, CLASS_NAMES[family] + "Processor")(
        image_processor=transformers.Qwen2VLImageProcessorPil(**sizes, **MEAN_STD.get(family, {})),
        tokenizer=tokenizer, video_processor=video(**{**sizes, **VIDEO_SIZES.get(family, {})})
    ).save_pretrained(folder)
    processor = transformers.AutoProcessor.from_pretrained(folder)
    processor.image_processor = transformers.AutoImageProcessor.from_pretrained(folder,
                                                                               backend="pil")
    return model_class.from_pretrained(folder).eval(), processor


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def qwen(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf, processor = qwen_folder(folder, request.param)
    return folder, hf, processor, MultimodalLM.from_pretrained(folder)


def pictures():
    """Three photos of different sizes: 56 x 40, 40 x 40 and 24 x 72."""
    arrays = photos(3, size=40)
    return [Image.fromarray(arrays[0]).resize((40, 56)), Image.fromarray(arrays[1]),
            Image.fromarray(arrays[2]).resize((72, 24))]


def test_the_logits_are_transformers_on_its_own_processor_s_input(qwen):
    folder, hf, processor, ours = qwen
    images = pictures()
    encoded = processor(text=PROMPTS, images=images, return_tensors="pt", padding=True)
    batch = ours.prepare(PROMPTS, [images[:1], images[1:], []])
    assert batch.position_ids.shape == (3, *batch.input_ids.shape)
    with torch.no_grad():
        theirs, mine = hf(**encoded).logits, ours.run(batch).logits
    for row in range(len(PROMPTS)):
        real, kept = encoded["attention_mask"][row].bool(), batch.attention_mask[row].bool()
        assert encoded["input_ids"][row][real].tolist() == batch.input_ids[row][kept].tolist()
        torch.testing.assert_close(mine[row][kept], theirs[row][real], rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tie", [(True, False), (False, True)], ids=["top", "text"])
def test_the_tie_is_transformers_s_at_either_config_level(tmp_path, family, tie):
    """Tied at either level, transformers ties (its config carries the text level's up) and
    saves no head; ours reads the same head and logits."""
    hf, processor = qwen_folder(tmp_path, family, tie)
    assert hf.lm_head.weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()
    ours = MultimodalLM.from_pretrained(tmp_path)
    images = pictures()
    encoded = processor(text=PROMPTS, images=images, return_tensors="pt", padding=True)
    batch = ours.prepare(PROMPTS, [images[:1], images[1:], []])
    with torch.no_grad():
        theirs, mine = hf(**encoded).logits, ours.run(batch).logits
    kept = batch.attention_mask.bool()
    torch.testing.assert_close(mine[kept], theirs[encoded["attention_mask"].bool()], rtol=0,
                               atol=LOGITS_ATOL)


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_the_3d_positions_are_get_rope_index_s(qwen, padding_side):
    folder, hf, processor, ours = qwen
    images = pictures()
    encoded = processor(text=PROMPTS, images=images, return_tensors="pt", padding=True,
                        padding_side=padding_side)
    theirs, _ = hf.model.get_rope_index(
        encoded["input_ids"], encoded["mm_token_type_ids"],
        image_grid_thw=encoded["image_grid_thw"], attention_mask=encoded["attention_mask"])
    batch = ours.prepare(PROMPTS, [images[:1], images[1:], []], padding_side=padding_side)
    assert torch.equal(batch.attention_mask, encoded["attention_mask"])
    assert torch.equal(batch.position_ids, theirs)


def test_greedy_generation_gives_transformers_tokens(qwen):
    folder, hf, processor, ours = qwen
    images = pictures()
    prompts = PROMPTS[:2]
    encoded = processor(text=prompts, images=images, return_tensors="pt", padding=True,
                        padding_side="left")
    with torch.no_grad():
        theirs = hf.generate(**encoded, max_new_tokens=6, do_sample=False)
    new = theirs[:, encoded["input_ids"].shape[1]:]
    assert new.shape[1] == 6
    expected = [text.strip() for text in ours.tokenizer.batch_decode(
        new, skip_special_tokens=True)]
    assert ours.generate(prompts, [images[:1], images[1:]], max_new_tokens=6,
                         do_sample=False) == expected


def test_every_decoding_step_s_logits_are_transformers(qwen):
    """The prefill takes the 3D ids and every decoding step continues from them
    (`mrope.generation_inputs`); without them all would take 1-D positions."""
    from vlm_vit_llm.mrope import generation_inputs

    folder, hf, processor, ours = qwen
    images = pictures()
    prompts = PROMPTS[:2]
    settings = dict(max_new_tokens=4, do_sample=False, output_logits=True,
                    return_dict_in_generate=True, pad_token_id=ours.pad_token_id)
    encoded = processor(text=prompts, images=images, return_tensors="pt", padding=True,
                        padding_side="left")
    batch = ours.prepare(prompts, [images[:1], images[1:]], padding_side="left")
    with torch.no_grad():
        theirs = hf.generate(**encoded, **settings)
        mine = ours.llm.generate(inputs_embeds=ours.embed(batch),
                                 attention_mask=batch.attention_mask,
                                 **generation_inputs(batch), **settings)
    assert len(mine.logits) == len(theirs.logits) == 4
    for step, (a, b) in enumerate(zip(mine.logits, theirs.logits)):
        torch.testing.assert_close(a, b, rtol=0, atol=LOGITS_ATOL, msg=f"step {step}")


@pytest.fixture
def qwen_copy(qwen, tmp_path, monkeypatch):
    """A copy of the folder whose weights (transformers' from_pretrained) fail the test."""
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(qwen[0], folder)
    for name in FAMILIES.values():
        model_class = getattr(transformers, name + "ForConditionalGeneration")

        def refuse(*args, **kwargs):
            pytest.fail("the weights were read before the folder was checked")
        monkeypatch.setattr(model_class, "from_pretrained", refuse)
    return folder


def _edit(path, change):
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize(("file", "change", "message"), [
    ("config.json", lambda raw: raw.update(image_token_id=5),
     "image_token_index 5, but the tokenizer gives '<|image_pad|>' the id"),
    ("processor_config.json", lambda raw: raw["image_processor"].update(patch_size=14),
     "patch_size 14, but the vision tower's is 8"),
    ("processor_config.json", lambda raw: raw["image_processor"].update(merge_size=3),
     "merge_size 3, but the vision tower's is 2"),
    ("processor_config.json", lambda raw: raw["image_processor"].update(
        size={"shortest_edge": 10 ** 9, "longest_edge": 16}), "pixel bounds 1000000000 to 16"),
    ("processor_config.json", lambda raw: raw.pop("image_processor"), "no image processor"),
    ("config.json", lambda raw: raw.update(model_type="glm4v"),
     "model_type 'glm4v' is not a multimodal model vlm-vit-llm reads"),
    ("config.json", lambda raw: raw["vision_config"].update(out_hidden_size=48, hidden_size=48),
     "the vision merger gives width 48, but the language model's hidden_size is 64"),
])
def test_what_cannot_be_read_is_one_line_before_any_weight_is(qwen_copy, file, change,
                                                              message):
    _edit(qwen_copy / file, change)
    with pytest.raises(ValueError) as caught:
        MultimodalLM.from_pretrained(qwen_copy)
    line = str(caught.value)
    assert line.startswith(str(qwen_copy)) and message in line, line
    assert "\n" not in line and len(line) < MAX_LINE, len(line)


def test_an_untied_head_the_weights_lack_is_refused_before_any_weight_is(qwen_copy):
    from safetensors.torch import load_file, save_file

    weights = qwen_copy / "model.safetensors"
    tensors = load_file(weights)
    del tensors["lm_head.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="tie_word_embeddings is off but the weights hold no "
                                         "lm_head.weight"):
        MultimodalLM.from_pretrained(qwen_copy)


@pytest.mark.parametrize("fps", [None, 2.0])
def test_a_video_gives_transformers_logits_and_positions(qwen, fps):
    """A clip: transformers' `<|video_pad|>` prompt with its video processor against ours on
    the same prompt (a clip may also stand at the image placeholder); the positions are the
    video's (Qwen2.5-VL spaces its temporal patches by `tokens_per_second * temporal_patch /
    fps`)."""
    from vlm_vit_llm import Video

    folder, hf, processor, ours = qwen
    frames = [Image.fromarray(array) for array in photos(4, size=48)]  # no resize: see below
    theirs_prompt = "<|vision_start|><|video_pad|><|vision_end|>what happens"
    settings = {} if fps is None else {"video_metadata": [{"fps": fps, "total_num_frames": 4}]}
    encoded = processor(text=[theirs_prompt], videos=[frames], return_tensors="pt",
                        do_sample_frames=False, **settings)
    for placeholder in ("<|video_pad|>", "<|image_pad|>"):  # a clip may stand at either
        batch = ours.prepare([f"<|vision_start|>{placeholder}<|vision_end|>what happens"],
                             [[Video(frames, fps)]])
        assert torch.equal(batch.image_mask, encoded["input_ids"] == hf.config.video_token_id)
    batch = ours.prepare([theirs_prompt], [[Video(frames, fps)]])
    assert torch.equal(batch.input_ids, encoded["input_ids"])  # transformers' prompt, its ids
    theirs_ids, _ = hf.model.get_rope_index(
        encoded["input_ids"], encoded["mm_token_type_ids"],
        video_grid_thw=encoded["video_grid_thw"], attention_mask=encoded["attention_mask"],
        **({"second_per_grid_ts": encoded["second_per_grid_ts"]}
           if "second_per_grid_ts" in encoded else {}))
    assert torch.equal(batch.position_ids, theirs_ids)
    with torch.no_grad():
        theirs, mine = hf(**encoded).logits, ours.run(batch).logits
    torch.testing.assert_close(mine, theirs, rtol=0, atol=LOGITS_ATOL)


def test_an_image_at_the_video_placeholder_is_refused_by_name(qwen):
    folder, hf, processor, ours = qwen
    assert ours.video_token == "<|video_pad|>"
    with pytest.raises(ValueError, match=r"prompt 0: a '<\|video_pad\|>' placeholder takes a "
                                         r"clip, Video\(frames\), not Image"):
        ours.prepare(["<|vision_start|><|video_pad|><|vision_end|>what"], [pictures()[:1]])


def test_the_video_token_survives_a_save(qwen, tmp_path):
    folder, hf, processor, ours = qwen
    ours.save_pretrained(tmp_path / "saved")
    assert MultimodalLM.from_pretrained(tmp_path / "saved").video_token == "<|video_pad|>"
