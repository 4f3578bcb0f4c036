"""Packed rows with M-RoPE (issue 44): records of a Qwen2-VL or Qwen2.5-VL model read from
transformers, several per row, give the loss and every gradient of the same records run
alone through transformers' own model and loss, on every CPU attention path; the packed 3-D
ids restart per record (transformers' `get_rope_index` of each record alone); the start-up
leak check runs on these models and catches a leak."""

import pytest
import torch
from conftest import perturb_lora
from test_llm_packing import assert_every_path_equals_records_alone
from test_qwen_vl_read import FAMILIES, IMAGE, pictures, qwen_folder

from vlm_vit_llm import IGNORE_INDEX, MultimodalLM
from vlm_vit_llm import packing as packing_module
from vlm_vit_llm.model import target_ids
from vlm_vit_llm.packing import PackingLeakError, check_packed_attention
from vlm_vit_llm.train import ConversationBatch

# (prompt, answer, images): one image, none, two; 6 to 60 positions with the pictures' sizes.
RECORDS = [(f"{IMAGE}what is in the image", "two blue dogs", [0]),
           ("describe the picture", "a red square", []),
           (f"{IMAGE} and {IMAGE} the dog runs", "the green tree", [1, 2]),
           ("what is in the image", "one yellow star", []),
           (f"{IMAGE}a photo of a cat", "the sun sets behind the hills", [2])]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    qwen_folder(folder, request.param)
    return folder


def build(folder, stage: str) -> MultimodalLM:
    mm = MultimodalLM.from_pretrained(folder)
    if stage == "full":
        mm.requires_grad_(True)  # every gradient: encoder, merger, LLM
    else:
        mm.add_lora(r=4, alpha=8, encoder_targets="attn_qv")
        torch.manual_seed(5)
        perturb_lora(mm, hold_key_rows=True)
    return mm.train()


def records_batch(mm) -> ConversationBatch:
    images = [mm.processor.preprocess_one(picture) for picture in pictures()]
    ids, labels, pixels = [], [], []
    for prompt, answer, which in RECORDS:
        prompt_ids = list(mm.tokenizer(prompt)["input_ids"])
        target = target_ids(mm.tokenizer, answer)
        ids.append(prompt_ids + target)
        labels.append([IGNORE_INDEX] * len(prompt_ids) + target)
        pixels.append([images[index] for index in which])
    lengths = [mm.prepare([one], [images_of]).input_ids.shape[1]
               for one, images_of in zip(ids, pixels, strict=True)]
    rows = packing_module.pack_rows(lengths, max_length=max(lengths) + 12)
    assert len(rows) < len(RECORDS)  # rows really hold several records
    return ConversationBatch(ids, labels, pixels, rows=rows)


@pytest.mark.parametrize("stage", ["full", pytest.param("lora", marks=pytest.mark.slow)])
def test_packed_loss_and_every_gradient_equal_records_alone(folder, stage):
    """Under both reductions and the three CPU attention paths, float32 within 2e-5 of the
    largest gradient (as for 1-D LLMs: `test_llm_packing.assert_close`)."""
    mm = build(folder, stage)
    assert_every_path_equals_records_alone(mm, records_batch(mm), {"tower", "llm"})


def test_packed_ids_restart_per_record_as_each_alone(folder):
    mm = build(folder, "full")
    batch = records_batch(mm)
    mm.set_packed_attention("position_ids")
    packed = mm.prepare(batch.input_ids, batch.images, token_labels=batch.labels,
                        pack=batch.rows)
    assert packed.position_ids.shape == (4, *packed.input_ids.shape)
    assert torch.equal(packed.position_ids[0], packed.position_ids[0].clamp(min=0))
    for record, (ids, images) in enumerate(zip(batch.input_ids, batch.images, strict=True)):
        alone = mm.prepare([ids], [images])  # the padded path: get_rope_index's ids (tested)
        where = packed.record_index == record
        assert torch.equal(packed.position_ids[1:, where], alone.position_ids[:, 0])
        assert torch.equal(packed.position_ids[0, where], torch.arange(int(where.sum())))
    # images make the 3-D ids differ from the text ones: the test sees them
    assert not torch.equal(packed.position_ids[1], packed.position_ids[0])


@pytest.mark.parametrize("path", ["varlen_sdpa", "position_ids", "block_mask"])
def test_the_start_up_check_passes_each_path_and_catches_a_leak(folder, path, monkeypatch):
    mm = build(folder, "full")
    assert check_packed_attention(mm.llm, path) < 1e-4
    monkeypatch.setattr(packing_module, "block_causal_mask",
                        lambda index, dtype: torch.zeros(index.shape[0], 1, index.shape[1],
                                                         index.shape[1], dtype=dtype))
    whole = packing_module.varlen_attention.record_boundaries  # each row one record:
    monkeypatch.setattr(packing_module.varlen_attention, "record_boundaries",
                        lambda positions: whole(torch.arange(positions.numel()).view(
                            positions.shape)))
    if path == "position_ids":  # transformers' detection: positions that never restart
        real = packing_module.packed_llm_inputs
        monkeypatch.setattr(packing_module, "packed_llm_inputs", lambda *args: {
            **real(*args), "position_ids": torch.arange(args[1].shape[-1]).expand(
                args[1].shape)})
    with pytest.raises(PackingLeakError, match=f"{type(mm.llm).__name__} with the '{path}'"):
        check_packed_attention(mm.llm, path)


def test_each_image_counts_its_own_tokens_before_the_tower_runs(folder):
    """At native resolution an image's token count is its own (the collate truncates and
    packs by it), not the processor's nominal size's."""
    from vlm_vit_llm.train import ConversationCollate

    mm = build(folder, "full")
    collate = ConversationCollate(mm, max_length=200, packing=True)
    counts = []
    for picture in pictures():
        pixels = mm.processor.preprocess_one(picture)
        counts.append(collate.count_tokens(pixels))
        assert counts[-1] == int(mm.prepare([IMAGE], [[pixels]]).image_mask.sum())
    assert sorted(counts) == [4, 8, 8]  # 40 x 40 is 2 x 2 tokens; 56 x 40 and 24 x 72 are 8
    side = 8 * 2  # patch x merge
    assert collate.least_image_tokens == mm.processor.min_output_pixels // side ** 2 == 1
    assert collate.image_tokens == mm.processor.max_output_pixels // side ** 2  # the bound


def test_a_packed_token_budget_run_resumes_bit_exactly(folder, tmp_path):
    """Four steps of token-budget packs with LoRA straight, against two then a resume to
    four: the same losses and weights, bit for bit."""
    from test_conversation_data import GOOD, write_images, write_records
    from test_llm_packing_train import assert_resumes_bit_exactly, fit

    from vlm_vit_llm.chat import adopt_chat_template
    from vlm_vit_llm.readers import record_placeholder
    from vlm_vit_llm.records import ConversationRecords
    from vlm_vit_llm.train import ConversationCollate, ConversationDataset, TokenBudgetPacks

    placeholder, image_text = record_placeholder(folder)
    images = write_images(tmp_path / "images")
    path = write_records(tmp_path / "data.jsonl", GOOD * 12)

    def run(run_dir, steps, resume=False):
        torch.manual_seed(0)  # the same LoRA start in every run
        mm = build(folder, "lora")
        adopt_chat_template(mm.tokenizer, "vicuna_v1")
        collate = ConversationCollate(mm, max_length=200, packing=True)
        records = ConversationRecords(path, images, image_token=placeholder,
                                      image_text=image_text)
        dataset = ConversationDataset(records, mm.processor, image_tokens=collate.image_tokens,
                                      max_length=200,
                                      least_image_tokens=collate.least_image_tokens)
        packs = TokenBudgetPacks(dataset, max_tokens=200, max_length=200)
        assert len(packs) >= 8  # four steps of two packs or more: the resume is mid-epoch
        return mm, fit(mm, packs, collate, run_dir, steps, resume)

    assert_resumes_bit_exactly(run, tmp_path)
