"""Post-projector embeddings in vLLM's precomputed-input layout (issue 46): for LLaVA-1.5,
LLaVA-NeXT (images of several sizes), Qwen2.5-VL and Qwen3-VL (its DeepStack features beside
each token, as vLLM's Qwen3-VL splits them) folders transformers wrote, each image's
placeholder count is the processor's, and transformers' language model fed our embeddings as
`inputs_embeds` at the placeholder positions gives the full model's logits (a real consumer
of the file, not our own forward)."""

import json

import pytest
import torch
from conftest import photos
from PIL import Image
from test_llava_next_export import pil_processor
from test_llava_read import llava_mm, their_llava
from test_llm_anyres import image, tiled_mm
from test_qwen_vl_read import IMAGE, pictures, qwen_folder

from vlm_vit_llm import MultimodalLM, export_llava
from vlm_vit_llm.embeddings import image_embeddings, load_embeddings, save_embeddings
from vlm_vit_llm.llava_next import model_class

LOGITS_ATOL = 1e-5


def language_model_logits(hf, encoded, embeds, image_token_id, **positions):
    """transformers' language model and head alone: the prompt's token embeddings with our
    image embeddings at the placeholder positions."""
    input_ids = encoded["input_ids"]
    inputs = hf.get_input_embeddings()(input_ids)
    where = input_ids == image_token_id
    assert int(where.sum()) == embeds.shape[0]
    inputs = inputs.masked_scatter(where.unsqueeze(-1), embeds.to(inputs.dtype))
    hidden = hf.model.language_model(inputs_embeds=inputs,
                                     attention_mask=encoded["attention_mask"],
                                     **positions).last_hidden_state
    return hf.lm_head(hidden)


def assert_serves(hf, encoded, embeds, image_token_id, **positions):
    with torch.no_grad():
        full = hf(**encoded).logits
        served = language_model_logits(hf, encoded, embeds, image_token_id, **positions)
    torch.testing.assert_close(served, full, rtol=0, atol=LOGITS_ATOL)


def test_llava_1_5_embeddings_serve_its_language_model(tmp_path, tokenizer):
    hf = their_llava(llava_mm(tokenizer), tmp_path, False, False)
    ours = MultimodalLM.from_pretrained(tmp_path / "theirs")
    pictures_ = photos(2)
    embedded = image_embeddings(ours, pictures_)
    assert embedded.layout == "fixed"
    embeds = embedded.vllm_input()
    assert embeds.shape == (2, ours.tower.num_image_tokens(), hf.config.text_config.hidden_size)
    prompt = "<image>\nwhat is it <image> and"
    encoded = pil_processor(tmp_path / "theirs")(text=[prompt], images=pictures_,
                                                  return_tensors="pt")
    per_image = int((encoded["input_ids"] == hf.config.image_token_id).sum()) // 2
    assert embedded.placeholder_tokens == [per_image, per_image]
    assert_serves(hf, encoded, embeds.flatten(0, 1), hf.config.image_token_id)


def test_llava_next_embeddings_of_several_sizes_serve_its_language_model(tmp_path, tokenizer):
    mm = tiled_mm(tokenizer)
    export_llava(mm, tmp_path / "export")
    hf = model_class(mm.tower.tiling).from_pretrained(tmp_path / "export").eval()
    ours = MultimodalLM.from_pretrained(tmp_path / "export")
    sizes = [(90, 120), (33, 33)]
    pictures_ = [image(*size) for size in sizes]
    embedded = image_embeddings(ours, pictures_)
    assert embedded.layout == "per_image"
    assert embedded.tensors["image_sizes"].tolist() == [list(size) for size in sizes]
    encoded = pil_processor(tmp_path / "export")(text=["<image> the dog <image>"],
                                                 images=pictures_, return_tensors="pt")
    counts = embedded.placeholder_tokens
    assert counts[0] != counts[1]  # the sizes make different counts
    assert sum(counts) == int((encoded["input_ids"] == hf.config.image_token_id).sum())
    assert_serves(hf, encoded, torch.cat(embedded.vllm_input()), hf.config.image_token_id)


def test_qwen2_5_vl_embeddings_and_grids_serve_its_language_model(tmp_path):
    hf, processor = qwen_folder(tmp_path, "qwen2_5_vl")
    ours = MultimodalLM.from_pretrained(tmp_path)
    pictures_ = pictures()
    embedded = image_embeddings(ours, pictures_)
    assert embedded.layout == "qwen_vl"
    served = embedded.vllm_input()
    prompt = f"{IMAGE}what {IMAGE} and {IMAGE}"
    encoded = processor(text=[prompt], images=pictures_, return_tensors="pt")
    assert torch.equal(served["image_grid_thw"], encoded["image_grid_thw"])
    image_token_id = hf.config.image_token_id
    placed = encoded["input_ids"] == image_token_id
    assert sum(embedded.placeholder_tokens) == int(placed.sum())
    positions, _ = hf.model.get_rope_index(encoded["input_ids"], encoded["mm_token_type_ids"],
                                           image_grid_thw=encoded["image_grid_thw"],
                                           attention_mask=encoded["attention_mask"])
    assert_serves(hf, encoded, served["image_embeds"], image_token_id, position_ids=positions)


def test_qwen3_vl_embeddings_carry_deepstack_as_vllm_splits_them(tmp_path):
    """Each token is `[merger | DeepStack level 0 | level 1]` (vLLM's `visual_dim` then
    `multiscale_dim`); transformers' language model fed the first part at the placeholders
    and the others as its DeepStack inputs gives the full model's logits."""
    hf, processor = qwen_folder(tmp_path, "qwen3_vl")
    ours = MultimodalLM.from_pretrained(tmp_path)
    pictures_ = pictures()
    embedded = image_embeddings(ours, pictures_)
    served = embedded.vllm_input()
    hidden = hf.config.text_config.hidden_size
    levels = len(hf.config.vision_config.deepstack_visual_indexes)
    assert (embedded.layout, embedded.metadata) == ("qwen_vl", {"deepstack_levels": "2"})
    assert served["image_embeds"].shape[-1] == (1 + levels) * hidden
    prompt = f"{IMAGE}what {IMAGE} and {IMAGE}"
    encoded = processor(text=[prompt], images=pictures_, return_tensors="pt")
    assert torch.equal(served["image_grid_thw"], encoded["image_grid_thw"])
    image_token_id = hf.config.image_token_id
    placed = encoded["input_ids"] == image_token_id
    main, *deepstack = served["image_embeds"].split(hidden, dim=-1)
    positions, _ = hf.model.get_rope_index(encoded["input_ids"], encoded["mm_token_type_ids"],
                                           image_grid_thw=encoded["image_grid_thw"],
                                           attention_mask=encoded["attention_mask"])
    assert_serves(hf, encoded, main, image_token_id, position_ids=positions,
                  visual_pos_masks=placed, deepstack_visual_embeds=deepstack)
    with torch.no_grad():  # the DeepStack part is what the model adds, not zeros
        without = language_model_logits(hf, encoded, main, image_token_id,
                                        position_ids=positions)
        full = hf(**encoded).logits
    assert (without - full).abs().max() > 100 * LOGITS_ATOL


def test_a_file_round_trips_and_a_foreign_file_is_refused(tmp_path, tokenizer):
    from safetensors.torch import save_file

    hf = their_llava(llava_mm(tokenizer), tmp_path, False, False)
    ours = MultimodalLM.from_pretrained(tmp_path / "theirs")
    embedded = image_embeddings(ours, photos(2))
    read = load_embeddings(save_embeddings(embedded, tmp_path / "embeds.safetensors"))
    assert (read.layout, read.placeholder_tokens, read.model_class) == (
        "fixed", embedded.placeholder_tokens, "LlavaForConditionalGeneration")
    assert torch.equal(read.tensors["image_embeds"], embedded.tensors["image_embeds"])
    save_file({"x": torch.zeros(1)}, tmp_path / "foreign.safetensors")
    with pytest.raises(ValueError, match="not an embeddings file vlm-vit-llm wrote"):
        load_embeddings(tmp_path / "foreign.safetensors")
    del hf


def test_the_command_writes_the_file_and_refuses_a_missing_image(tmp_path, tokenizer, capsys):
    from vlm_vit.cli import main

    their_llava(llava_mm(tokenizer), tmp_path, False, False)
    for index, array in enumerate(photos(2)):
        Image.fromarray(array).save(tmp_path / f"{index}.png")
    out = tmp_path / "embeds.safetensors"
    assert main(["llm", "embed", str(tmp_path / "theirs"), str(tmp_path / "0.png"),
                 str(tmp_path / "1.png"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 image(s)" in printed and "fixed" in printed
    read = load_embeddings(out)
    assert json.loads(json.dumps(read.placeholder_tokens)) == read.placeholder_tokens
    assert read.tensors["image_embeds"].shape[0] == 2
    top = tmp_path / "top.safetensors"  # `vlm-vit embed`, the spelling, is the same
    assert main(["embed", str(tmp_path / "theirs"), str(tmp_path / "0.png"),
                 str(tmp_path / "1.png"), "--out", str(top)]) == 0
    assert torch.equal(load_embeddings(top).tensors["image_embeds"],
                       read.tensors["image_embeds"])
    capsys.readouterr()
    assert main(["llm", "embed", str(tmp_path / "theirs"), str(tmp_path / "missing.png"),
                 "--out", str(tmp_path / "other.safetensors")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.png" in err[0]
    assert not (tmp_path / "other.safetensors").exists()


def test_a_cached_embed_is_bit_identical_and_misses_for_another_tower(tmp_path, tokenizer,
                                                                     capsys):
    from vlm_vit.cli import main

    their_llava(llava_mm(tokenizer), tmp_path, False, False)
    images = []
    for index, array in enumerate(photos(3)):
        Image.fromarray(array).save(tmp_path / f"{index}.png")
        images.append(str(tmp_path / f"{index}.png"))
    command = ["llm", "embed", str(tmp_path / "theirs"), *images, "--cache",
               str(tmp_path / "cache")]
    assert main([*command, "--out", str(tmp_path / "cold.safetensors")]) == 0
    assert "0 hit(s), 3 miss(es)" in capsys.readouterr().out
    assert main([*command, "--out", str(tmp_path / "warm.safetensors")]) == 0
    assert "3 hit(s), 0 miss(es)" in capsys.readouterr().out
    cold, warm = (load_embeddings(tmp_path / f"{name}.safetensors") for name in ("cold", "warm"))
    assert torch.equal(cold.tensors["image_embeds"], warm.tensors["image_embeds"])
    ours = MultimodalLM.from_pretrained(tmp_path / "theirs")
    with torch.no_grad():
        ours.tower.pooler[0].bias.add_(1.0)  # another projector: another key
    from vlm_vit.io.encode_cache import EncodeCache

    cache = EncodeCache(tmp_path / "cache")
    changed = image_embeddings(ours, images, cache)
    assert (cache.hits, cache.misses) == (0, 3)
    assert not torch.equal(changed.tensors["image_embeds"], cold.tensors["image_embeds"])


def test_qwen2_5_vl_clips_are_vllm_s_video_input_and_serve_its_language_model(tmp_path):
    """A clip beside an image: the clip's tokens, grid and seconds per temporal patch go
    apart (`multi_modal_data["video"]`), equal to transformers' processor's; placed at the
    video tokens with `get_rope_index`'s positions (which follow the clip's time), they give
    the full model's logits."""
    from test_video_processor import clip_of

    from vlm_vit_llm import Video

    hf, processor = qwen_folder(tmp_path, "qwen2_5_vl")
    ours = MultimodalLM.from_pretrained(tmp_path)
    picture, clip = pictures()[0], clip_of(4, 44, 60)
    embedded = image_embeddings(ours, [picture, Video(clip, 4.0)])
    data = embedded.vllm_data()
    assert set(data) == {"image", "video"} and embedded.metadata["videos"] == "[1]"
    prompt = f"{IMAGE}and <|vision_start|><|video_pad|><|vision_end|>what happens"
    encoded = processor(text=[prompt], images=[picture], videos=[clip], do_sample_frames=False,
                        video_metadata=[{"fps": 4.0, "total_num_frames": 4}],
                        return_tensors="pt")
    assert torch.equal(data["image"]["image_grid_thw"], encoded["image_grid_thw"])
    assert torch.equal(data["video"]["video_grid_thw"], encoded["video_grid_thw"])
    torch.testing.assert_close(data["video"]["second_per_grid_ts"],
                               torch.as_tensor(encoded["second_per_grid_ts"]).float())
    assert embedded.placeholder_tokens == [
        int((encoded["input_ids"] == token).sum())
        for token in (hf.config.image_token_id, hf.config.video_token_id)]
    positions, _ = hf.model.get_rope_index(
        encoded["input_ids"], encoded["mm_token_type_ids"],
        image_grid_thw=data["image"]["image_grid_thw"],
        video_grid_thw=data["video"]["video_grid_thw"],
        second_per_grid_ts=data["video"]["second_per_grid_ts"],
        attention_mask=encoded["attention_mask"])
    inputs = hf.get_input_embeddings()(encoded["input_ids"])
    for token, embeds in ((hf.config.image_token_id, data["image"]["image_embeds"]),
                          (hf.config.video_token_id, data["video"]["video_embeds"])):
        inputs = inputs.masked_scatter((encoded["input_ids"] == token).unsqueeze(-1), embeds)
    with torch.no_grad():
        hidden = hf.model.language_model(inputs_embeds=inputs, position_ids=positions,
                                         attention_mask=encoded["attention_mask"])
        served, full = hf.lm_head(hidden.last_hidden_state), hf(**encoded).logits
    torch.testing.assert_close(served, full, rtol=0, atol=LOGITS_ATOL)
    path = save_embeddings(embedded, tmp_path / "embeds.safetensors")
    assert set(load_embeddings(path).vllm_data()["video"]) == {
        "video_embeds", "video_grid_thw", "second_per_grid_ts"}
