"""MultimodalLM: the splice, padding, labels, generation, freezing, and save/load."""

import pytest
import torch
from conftest import IMAGE_SIZE, LLM_WIDTH, perturb_lora, photos, tiny_llm, tiny_tower

from vlm_vit import build_pooler
from vlm_vit_llm import IGNORE_INDEX, MultimodalLM, Video

PROMPTS = ["describe the picture", "<image>\nwhat is in the image", "<image> and <image> the"]


def pixels(count: int, seed: int = 0, height: int = IMAGE_SIZE, width: int = IMAGE_SIZE):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, height, width, generator=generator) for _ in range(count)]


def test_the_splice_puts_each_images_tokens_at_its_placeholder(mm):
    """Prompts with 0, 1 and 2 images: every image token holds its own image's projected
    tokens, in order, and every other position the LLM's embedding of its token."""
    images = pixels(3)
    per_prompt = [[], [images[0]], [images[1], images[2]]]
    batch = mm.prepare(PROMPTS, per_prompt)
    embeds = mm.embed(batch)
    count = mm.tower.num_image_tokens()
    assert count == 16
    with torch.no_grad():  # images of one size run as one batch, so this is bit-exact
        expected = mm.tower(torch.stack(images))
    table = mm.llm.get_input_embeddings().weight
    image_index = 0
    for row, (prompt, row_images) in enumerate(zip(PROMPTS, per_prompt, strict=True)):
        # The expanded ids are the tokenised prompt with each placeholder repeated `count` x.
        ids = mm.tokenizer(prompt)["input_ids"]
        expanded = [t for token in ids
                    for t in ([token] * count if token == mm.image_token_id else [token])]
        length = len(expanded)
        assert batch.input_ids[row, :length].tolist() == expanded
        assert batch.attention_mask[row].tolist() == [1] * length + [0] * (
            batch.input_ids.shape[1] - length)
        positions = torch.nonzero(batch.image_mask[row]).flatten().tolist()
        assert len(positions) == count * len(row_images)
        for k in range(len(row_images)):
            block = positions[k * count:(k + 1) * count]
            assert block == list(range(block[0], block[0] + count))  # contiguous
            torch.testing.assert_close(embeds[row, block], expected[image_index],
                                       rtol=0, atol=0)
            image_index += 1
        text = [p for p in range(length) if p not in set(positions)]
        torch.testing.assert_close(embeds[row, text], table[batch.input_ids[row, text]],
                                   rtol=0, atol=0)
    assert image_index == 3


def test_a_prompt_alone_gives_the_logits_it_gives_in_a_padded_batch(mm):
    images = pixels(3)
    per_prompt = [[], [images[0]], [images[1], images[2]]]
    with torch.no_grad():
        batched = mm(PROMPTS, per_prompt).logits
        batch = mm.prepare(PROMPTS, per_prompt)
        for row in range(3):
            alone = mm([PROMPTS[row]], [per_prompt[row]]).logits[0]
            length = int(batch.attention_mask[row].sum())
            torch.testing.assert_close(batched[row, :length], alone, rtol=1e-5, atol=1e-5)


def test_left_padding_counts_positions_from_the_first_real_token(mm):
    batch = mm.prepare(PROMPTS, [[], pixels(1), pixels(2)], padding_side="left")
    for row in range(3):
        mask = batch.attention_mask[row].bool()
        assert mask[-1] and batch.position_ids[row][mask].tolist() == list(range(int(mask.sum())))


def test_batched_generation_equals_one_prompt_at_a_time(mm):
    images = pixels(3)
    per_prompt = [[], [images[0]], [images[1], images[2]]]
    together = mm.generate(PROMPTS, per_prompt, max_new_tokens=6, do_sample=False)
    alone = [mm.generate([p], [i], max_new_tokens=6, do_sample=False)[0]
             for p, i in zip(PROMPTS, per_prompt, strict=True)]
    assert together == alone
    assert any(together)


def test_labels_cover_only_the_target_and_its_end(mm):
    target = "a red square"
    batch = mm.prepare(PROMPTS[:2], [[], pixels(1)], targets=["two blue dogs", target])
    ids = mm.encode_target(target)
    assert ids[-1] == mm.tokenizer.eos_token_id
    row = batch.labels[1]
    learned = row[row != IGNORE_INDEX].tolist()
    assert learned == ids
    start = int(batch.attention_mask[1].sum()) - len(ids)
    assert batch.input_ids[1, start:start + len(ids)].tolist() == ids  # at the end
    assert not (batch.image_mask & (batch.labels != IGNORE_INDEX)).any()
    out = mm(PROMPTS[:2], [[], pixels(1)], targets=["two blue dogs", target])
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)


def test_images_of_different_sizes_get_their_own_token_counts(mm):
    small, wide = pixels(1)[0], pixels(1, height=IMAGE_SIZE, width=2 * IMAGE_SIZE)[0]
    batch = mm.prepare(["<image><image>"], [[small, wide]])
    assert int(batch.image_mask.sum()) == 16 + 32
    with torch.no_grad():
        expected = torch.cat([mm.tower(small[None])[0], mm.tower(wide[None])[0]])
    torch.testing.assert_close(mm.embed(batch)[batch.image_mask], expected)


def per_image_features(mm):
    """The reference: one tower call per image, each alone."""
    return lambda pixels: [mm.tower(image[None])[0] for image in pixels]


def test_images_of_several_sizes_run_in_one_packed_encoder_call(mm, monkeypatch):
    sizes = [(IMAGE_SIZE, IMAGE_SIZE), (IMAGE_SIZE, 2 * IMAGE_SIZE), (2 * IMAGE_SIZE, IMAGE_SIZE)]
    images = [pixels(1, seed=i, height=h, width=w)[0] for i, (h, w) in enumerate(sizes)]
    prompts, per_prompt = ["<image> and <image>", "<image>\nwhat"], [images[:2], images[2:]]
    calls = []
    mm.tower.encoder.register_forward_hook(lambda module, args, out: calls.append(args[0]))
    with torch.no_grad():
        packed = mm(prompts, per_prompt).logits
        assert len(calls) == 1 and isinstance(calls[0], list) and len(calls[0]) == 3
        monkeypatch.setattr(mm, "image_features", per_image_features(mm))
        alone = mm(prompts, per_prompt).logits
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_training_on_packed_images_gives_the_per_image_gradients(tokenizer, monkeypatch):
    sizes = [(IMAGE_SIZE, 2 * IMAGE_SIZE), (IMAGE_SIZE, IMAGE_SIZE)]
    images = [pixels(1, seed=i, height=h, width=w)[0] for i, (h, w) in enumerate(sizes)]
    grads = []
    for reference in (False, True):
        mm = MultimodalLM(tiny_tower(), tiny_llm(), tokenizer)
        mm.add_lora(r=4, encoder_targets="attn")
        perturb_lora(mm)
        if reference:
            monkeypatch.setattr(mm, "image_features", per_image_features(mm))
        out = mm(["<image> then <image>"], [images], targets=["two squares"])
        out.loss.backward()
        grads.append({n: p.grad for n, p in mm.named_parameters() if p.grad is not None})
    packed, alone = grads
    assert packed.keys() == alone.keys() and any("tower.encoder" in n for n in packed)
    for name, grad in packed.items():
        torch.testing.assert_close(grad, alone[name], atol=1e-5, rtol=1e-5)


def test_pil_images_and_arrays_go_through_the_processor(mm):
    from PIL import Image

    photo = photos(1)[0]
    batch = mm.prepare(["<image>", "<image>"], [[photo], [Image.fromarray(photo)]])
    first, second = batch.image_features.split(16)
    torch.testing.assert_close(first, second)


@pytest.mark.parametrize(("prompt", "count", "message"), [
    ("<image> and <image>", 1, "2 '<image>' placeholder"),
    ("no placeholder", 1, "0 '<image>' placeholder"),
    ("<image>", 0, "1 '<image>' placeholder"),
])
def test_a_prompt_whose_placeholders_do_not_match_its_images_is_refused(mm, prompt, count,
                                                                         message):
    with pytest.raises(ValueError, match=message):
        mm.prepare([prompt], [pixels(count)])


def test_bad_calls_are_refused_by_name(mm):
    with pytest.raises(ValueError, match="2 prompts but images for 1"):
        mm.prepare(["a", "b"], [[]])
    with pytest.raises(ValueError, match="not one string"):
        mm.prepare("<image>", [pixels(1)])
    with pytest.raises(ValueError, match=r"\[C, H, W\]"):
        mm.prepare(["<image>"], [[torch.zeros(3, 32)]])
    with pytest.raises(ValueError, match="a clip of 2 frames needs a tower with temporal"):
        mm.prepare(["<image>"], [[Video(torch.zeros(2, 3, 32, 32))]])
    with pytest.raises(ValueError, match="a pixel tensor of 2 frames"):
        mm.prepare(["<image>"], [[torch.zeros(2, 3, 32, 32)]])
    with pytest.raises(ValueError, match="target 0 holds the image token"):
        mm.prepare(["<image>"], [pixels(1)], targets=["a <image> b"])
    with pytest.raises(ValueError, match="longer than the LLM's context of 256"):
        mm.prepare(["<image>" * 17], [pixels(17)])


def test_a_tower_of_the_wrong_width_or_without_tokens_is_refused(tokenizer):
    tower = tiny_tower()
    tower.pooler = build_pooler("mlp2x_gelu", in_dim=32, out_dim=LLM_WIDTH + 1)
    with pytest.raises(ValueError, match=f"out_dim={LLM_WIDTH}"):
        MultimodalLM(tower, tiny_llm(), tokenizer)
    tower.pooler = build_pooler("mean", in_dim=32)
    with pytest.raises(ValueError, match="one\\s+vector per image"):
        MultimodalLM(tower, tiny_llm(), tokenizer)


def test_the_image_token_is_added_and_the_embeddings_grow(tokenizer):
    llm = tiny_llm(vocab_size=len(tokenizer))  # no spare row
    mm = MultimodalLM(tiny_tower(), llm, tokenizer, image_token="<img>")
    assert mm.image_token_id == len(tokenizer) - 1
    assert llm.get_input_embeddings().num_embeddings == len(tokenizer)
    assert mm.prepare(["<img>"], [pixels(1)]).image_mask.sum() == 16


def _grads(module):
    return {name for name, p in module.named_parameters() if p.grad is not None}


def test_stage_1_trains_the_projector_only_and_keeps_no_encoder_graph(mm):
    mm.train_projector_only()
    grad_modes = []
    mm.tower.encoder.register_forward_hook(
        lambda module, args, out: grad_modes.append(
            (torch.is_grad_enabled(), out.features[0].requires_grad)))
    out = mm(["<image>\nwhat"], [pixels(1)], targets=["a red square"])
    out.loss.backward()
    assert grad_modes == [(False, False)]  # no graph through the frozen encoder
    assert _grads(mm) == {name for name, _ in mm.named_parameters()
                          if name.startswith("tower.pooler.")}
    assert _grads(mm.tower.pooler) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_stage_2_trains_lora_and_the_projector(mm):
    mm.add_lora(r=4, encoder_targets="attn")
    out = mm(["<image>\nwhat"], [pixels(1)], targets=["a red square"])
    out.loss.backward()
    trained = _grads(mm)
    assert trained == {name for name, p in mm.named_parameters() if p.requires_grad}
    assert any(".lora_A." in n and n.startswith("llm.") for n in trained)
    assert any(".lora_B." in n and n.startswith("tower.encoder.") for n in trained)
    # The tower reads layer -2: the last block never runs, so its LoRA stays frozen.
    assert not any(".blocks.2." in n for n in trained)
    assert any(".blocks.1." in n for n in trained)
    assert {n for n in trained if ".lora_" not in n} == {
        f"tower.pooler.{n}" for n in ("0.weight", "0.bias", "2.weight", "2.bias")}
    with pytest.raises(ValueError, match="already on"):
        mm.add_lora()


@pytest.mark.parametrize("lora", [False, True])
def test_save_and_load_give_the_same_model(mm, tmp_path, lora):
    if lora:
        mm.add_lora(r=4, encoder_targets="attn_qv")
        perturb_lora(mm, hold_key_rows=True)
    mm.eval()
    images = pixels(2)
    prompts, per_prompt = ["<image> the", "<image>\nwhat"], [[images[0]], [images[1]]]
    with torch.no_grad():
        before = mm(prompts, per_prompt).logits
    mm.save_pretrained(tmp_path / "model")
    loaded = MultimodalLM.from_pretrained(tmp_path / "model").eval()
    assert loaded.image_token_id == mm.image_token_id
    with torch.no_grad():
        after = loaded(prompts, per_prompt).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)
    if lora:
        assert (tmp_path / "model" / "llm_adapter").is_dir()
        assert (tmp_path / "model" / "vision_adapter").is_dir()
        merged = mm.merged()
        with torch.no_grad():
            torch.testing.assert_close(merged(prompts, per_prompt).logits, before,
                                       rtol=1e-4, atol=1e-4)
        assert not hasattr(merged.llm, "peft_config")


def test_from_pretrained_refuses_a_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "multimodal_config.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a vlm-vit-llm model"):
        MultimodalLM.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError):
        MultimodalLM.from_pretrained(tmp_path / "missing")
