"""Packed LLM rows (`vlm_vit_llm.packing`): several records per row give exactly the loss and
gradients of the same records run one at a time through transformers' own causal LM loss;
the label mask at joins; the start-up leak check; exact gradient accumulation."""

import pytest
import torch
from conftest import perturb_lora, photos, tiny_llm, tiny_tower

from vlm_vit_llm import IGNORE_INDEX, MultimodalLM, varlen_attention
from vlm_vit_llm import packing as packing_module
from vlm_vit_llm.deepstack import fed
from vlm_vit_llm.model import target_ids
from vlm_vit_llm.packing import (
    PackingLeakError,
    choose_packed_attention,
    explain_packed_attention,
    layout_rows,
)
from vlm_vit_llm.train import ConversationBatch, conversation_loss

# (prompt, answer): with images, text-only, two images; lengths 11 to 44 positions.
RECORDS = [("<image>\nwhat is in the image", "two blue dogs"),
           ("describe the picture", "a red square"),
           ("<image> and <image> the dog runs", "the green tree"),
           ("what is in the image", "one yellow star"),
           ("<image>\na photo of a cat", "the sun sets behind the hills")]
MODELS = {"llama": dict(kind="llama"), "qwen2-tied": dict(kind="qwen2", tied=True)}


def build(tokenizer, model: str, stage: str) -> MultimodalLM:
    mm = MultimodalLM(tiny_tower(), tiny_llm(**MODELS[model]), tokenizer)
    if stage == "full":
        mm.requires_grad_(True)  # every gradient: encoder, projector, LLM (tied head too)
    else:
        mm.add_lora(r=4, alpha=8, encoder_targets="attn")
        torch.manual_seed(5)
        perturb_lora(mm)
    return mm.train()


def batch_of(mm, records=RECORDS, with_images=True) -> ConversationBatch:
    pixels = iter(mm.processor.preprocess_one(p) for p in photos(4))
    ids, labels, images = [], [], []
    for prompt, answer in records:
        if not with_images:
            prompt = prompt.replace(mm.image_token, "")
        prompt_ids = list(mm.tokenizer(prompt)["input_ids"])
        target = target_ids(mm.tokenizer, answer)
        ids.append(prompt_ids + target)
        labels.append([IGNORE_INDEX] * len(prompt_ids) + target)
        images.append([next(pixels) for _ in range(prompt.count(mm.image_token))])
    return ConversationBatch(ids, labels, images)


def packed(batch: ConversationBatch, mm, max_length: int) -> ConversationBatch:
    tokens = mm.tower.num_image_tokens()
    lengths = [len(ids) + len(images) * (tokens - 1)
               for ids, images in zip(batch.input_ids, batch.images, strict=True)]
    rows = packing_module.pack_rows(lengths, max_length)
    return ConversationBatch(batch.input_ids, batch.labels, batch.images, rows=rows)


def assert_close(got, expected, name, tolerance=2e-5):
    """Within `tolerance` of the expected tensor's largest magnitude (at least 1): float32
    sums in another order (a batched tower call, one CE over all rows) differ by ~1e-6 of
    it, up to 1.08e-5 on the projector's gradients of the tied Qwen2 with LoRA and images
    (9.7e-6 for the `position_ids` path; every path within 1.5e-15 in float64); a leak or
    a wrong weight moves whole gradients."""
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(got, expected, rtol=0, atol=tolerance * scale,
                               msg=lambda message: f"{name}: {message}")


def gradients(mm) -> dict[str, torch.Tensor]:
    out = {name: p.grad.clone() for name, p in mm.named_parameters() if p.grad is not None}
    mm.zero_grad(set_to_none=True)
    return out


def reference(mm, batch: ConversationBatch, reduction: str):
    """Each record alone through transformers' causal LM with its own loss (mean over the
    record's supervised tokens), combined as `reduction` says."""
    losses, counts = [], []
    for ids, labels, images in zip(batch.input_ids, batch.labels, batch.images, strict=True):
        alone = mm.prepare([ids], [images], token_labels=[labels])
        with fed(mm.deepstack, alone):  # Qwen3-VL: its DeepStack too
            out = mm.llm(inputs_embeds=mm.embed(alone), attention_mask=alone.attention_mask,
                         position_ids=alone.position_ids, labels=alone.labels, use_cache=False)
        losses.append(out.loss)
        counts.append(sum(label != IGNORE_INDEX for label in labels[1:]))
    if reduction == "token":
        return sum(loss * n for loss, n in zip(losses, counts, strict=True)) / sum(counts)
    return sum(losses) / len(losses)


@pytest.mark.parametrize("model, stage, with_images", [
    ("llama", "full", True), ("llama", "full", False), ("qwen2-tied", "full", True),
    ("qwen2-tied", "full", False), ("llama", "lora", True),
    pytest.param("llama", "lora", False, marks=pytest.mark.slow),
    pytest.param("qwen2-tied", "lora", True, marks=pytest.mark.slow),
    pytest.param("qwen2-tied", "lora", False, marks=pytest.mark.slow)])
def test_packed_loss_and_every_gradient_equal_records_alone(tokenizer, model, stage,
                                                            with_images):
    """Under both reductions and the three CPU attention paths (SDPA per record, transformers'
    packed-sequence detection, and the block-diagonal mask)."""
    mm = build(tokenizer, model, stage)
    batch = packed(batch_of(mm, with_images=with_images), mm, max_length=48)
    assert len(batch.rows) < len(batch)  # rows really hold several records
    assert_every_path_equals_records_alone(
        mm, batch, {"tower", "llm"} if with_images else {"llm"})


# The tower's position table gets the sum of every patch's gradient over every image, which
# packed rows add in another order: with transformers 5.25 one entry is 2.5e-5 of the
# largest apart on the position-ids and block-mask paths; every other tensor within 2e-5.
SUMMED_OVER_PATCHES = {"tower.encoder.pos_embed": 3e-5}


def assert_every_path_equals_records_alone(mm, batch: ConversationBatch, trained: set[str]):
    """Under both reductions, on each CPU attention path, the packed loss and every gradient
    against the records run alone (`reference`); `trained`: the parts that get gradients."""
    for reduction in ("token", "record"):
        expected = reference(mm, batch, reduction)
        expected.backward()
        expected_gradients = gradients(mm)
        assert {name.split(".")[0] for name in expected_gradients} == trained
        for path in ("varlen_sdpa", "position_ids", "block_mask"):
            assert mm.set_packed_attention(path) == path
            loss = conversation_loss(mm, batch, reduction).loss
            loss.backward()
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
            got = gradients(mm)
            assert got.keys() == expected_gradients.keys()
            for name, gradient in expected_gradients.items():
                assert_close(got[name], gradient, f"{reduction} {path} {name}",
                             tolerance=SUMMED_OVER_PATCHES.get(name, 2e-5))


def test_padded_batches_take_the_same_loss(tokenizer):
    """The padded path (one record per row) under both reductions equals the reference too."""
    mm = build(tokenizer, "llama", "full")
    batch = batch_of(mm)
    for reduction in ("token", "record"):
        expected = reference(mm, batch, reduction)
        torch.testing.assert_close(conversation_loss(mm, batch, reduction).loss, expected,
                                   rtol=1e-5, atol=1e-5)


def test_rows_mask_every_join_label_token_by_token():
    sequences = [[1, 5, 6, 7], [1, 8, 9], [1, 4]]
    labels = [[IGNORE_INDEX, IGNORE_INDEX, 6, 7], [8, 8, 9], [4, 4]]  # a join label is dropped
    out = layout_rows(sequences, labels, [[0, 2], [1]], pad_id=0)
    assert out["input_ids"].tolist() == [[1, 5, 6, 7, 1, 4], [1, 8, 9, 0, 0, 0]]
    assert out["labels"].tolist() == [[-100, -100, 6, 7, -100, 4], [-100, 8, 9, -100, -100, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    assert out["record_index"].tolist() == [[0, 0, 0, 0, 2, 2], [1, 1, 1, -1, -1, -1]]
    assert out["attention_mask"].tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0]]
    one = layout_rows(sequences, labels, [[0, 2], [1]], pad_id=0, one_row=True)
    assert one["input_ids"].tolist() == [[1, 5, 6, 7, 1, 4, 1, 8, 9]]
    assert one["labels"].tolist() == [[-100, -100, 6, 7, -100, 4, -100, 8, 9]]
    with pytest.raises(ValueError, match="exactly once"):
        layout_rows(sequences, labels, [[0, 1]], pad_id=0)


def test_a_packed_batch_splices_images_in_row_order(tokenizer):
    """Packed rows put each record's image tokens where its placeholders are, though the
    rows reorder the records: the logits of every record equal it alone."""
    mm = build(tokenizer, "llama", "full").eval()
    batch = packed(batch_of(mm), mm, max_length=48)
    assert batch.rows[0][0] != 0  # first-fit decreasing reorders
    prepared = mm.prepare(batch.input_ids, batch.images, token_labels=batch.labels,
                          pack=batch.rows)
    with torch.no_grad():
        logits = mm.run(prepared).logits
        for index, (ids, images) in enumerate(zip(batch.input_ids, batch.images, strict=True)):
            alone = mm([ids], [images]).logits[0]
            torch.testing.assert_close(logits[prepared.record_index == index], alone,
                                       rtol=1e-4, atol=1e-4)


def leaking_with(**changes):
    original = packing_module.packed_llm_inputs

    def mutated(*args):
        inputs = original(*args)
        for name, make in changes.items():
            inputs[name] = make(args[1]) if callable(make) else make
        return inputs

    return mutated


def whole_rows(kwargs, batch, length):
    """A broken `varlen_attention._spans`: every row one record, so records see each other."""
    return [[(0, length)] for _ in range(batch)]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("path, mutation", [("position_ids", "use_cache"),
                                            ("position_ids", "mask_2d"),
                                            ("varlen_sdpa", "whole_rows")])
def test_the_start_up_check_catches_a_leaking_path(tokenizer, monkeypatch, model, path,
                                                   mutation):
    mm = build(tokenizer, model, "full")
    if mutation == "whole_rows":
        monkeypatch.setattr(varlen_attention, "_spans", whole_rows)
    else:
        change = {"use_cache": {"use_cache": True},
                  "mask_2d": {"attention_mask": lambda ids: torch.ones_like(ids)}}[mutation]
        monkeypatch.setattr(packing_module, "packed_llm_inputs", leaking_with(**change))
    name = type(mm.llm).__name__
    with pytest.raises(PackingLeakError, match=f"leak into each other on {name} with the "
                                               f"'{path}' attention path"):
        mm.set_packed_attention(path)
    monkeypatch.undo()
    assert mm.packed_attention() == "varlen_sdpa"  # tiny Llama and Qwen2 on sdpa


def test_the_path_is_chosen_once_and_the_cache_is_refused(tokenizer, monkeypatch):
    mm = build(tokenizer, "llama", "full")
    checks = []
    original = packing_module.check_packed_attention
    monkeypatch.setattr("vlm_vit_llm.model.check_packed_attention",
                        lambda *a: checks.append(a) or original(*a))
    batch = packed(batch_of(mm), mm, max_length=48)
    conversation_loss(mm, batch)
    conversation_loss(mm, batch)
    assert len(checks) == 1
    prepared = mm.prepare(batch.input_ids, batch.images, pack=batch.rows)
    with pytest.raises(ValueError, match="use_cache=True cannot go with packed rows"):
        mm.run(prepared, use_cache=True)


@pytest.mark.parametrize("reduction", ["token", "record"])
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_gradient_accumulation_is_exact(tokenizer, pack, reduction):
    """The trainer weighs each micro-batch's loss by its share of the records; the parts'
    weighted losses and gradients add up to the whole batch's under either reduction."""
    mm = build(tokenizer, "llama", "full")
    batch = batch_of(mm)
    if pack:
        batch = packed(batch, mm, max_length=48)
    whole = conversation_loss(mm, batch, reduction).loss
    whole.backward()
    expected = gradients(mm)
    parts = batch.tensor_split(3)
    assert len(parts) > 1
    total = 0.0
    for part in parts:
        weighted = conversation_loss(mm, part, reduction).loss * len(part) / len(batch)
        weighted.backward()
        total = total + weighted.detach()
    torch.testing.assert_close(total, whole.detach(), rtol=1e-5, atol=1e-6)
    got = gradients(mm)
    for name, gradient in expected.items():
        assert_close(got[name], gradient, name)


def test_packed_rows_split_whole(tokenizer):
    """Micro-batches hold whole rows; asked for more parts than rows, rows of several
    records are split, so the parts are as many as asked while there are records (every
    rank of a data-parallel run then runs as many micro-batches)."""
    mm = build(tokenizer, "llama", "full")
    batch = packed(batch_of(mm), mm, max_length=48)
    assert len(batch.rows) < len(batch) <= 8
    for sections in (len(batch.rows), len(batch), 8):
        parts = batch.tensor_split(sections)
        assert len(parts) == min(sections, len(batch))
        assert sorted(i for p in parts for i in p.input_ids) == sorted(batch.input_ids)
        for part in parts:
            assert part.rows == [list(range(len(part)))]
            assert part.whole == batch.whole


@pytest.mark.parametrize(("implementation", "path", "why"), [
    ("sdpa", "varlen_sdpa", "an sdpa LLM with full attention in every layer"),
    ("eager", "position_ids", "an eager LLM"),
])
def test_the_chosen_path_comes_with_its_reason(implementation, path, why):
    llm = tiny_llm()
    llm.set_attn_implementation(implementation)
    chosen, reason = explain_packed_attention(llm)
    assert chosen == path == choose_packed_attention(llm)
    assert reason.startswith(f"{why}: records kept apart by "), reason
