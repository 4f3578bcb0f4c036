"""Packed training end to end: the collates, truncation as padded, token-budget batches,
the CLI flags' translation, and a bit-exact resume mid-epoch."""

import argparse

import pytest
import torch
from conftest import tiny_llm, tiny_tower
from test_conversation_data import GOOD, gpt, human, write_images, write_records
from test_llm_train import write_captions

from vlm_vit.data.samples import UndecodableImage
from vlm_vit.train import TrainConfig, Trainer
from vlm_vit_llm import MultimodalLM
from vlm_vit_llm.chat import adopt_chat_template
from vlm_vit_llm.packing_args import PackingOptions, add_packing_arguments, packing_from_args
from vlm_vit_llm.records import ConversationRecords
from vlm_vit_llm.train import (
    CaptionCollate,
    CaptionFolder,
    CaptionObjective,
    ConversationCollate,
    ConversationDataset,
    ConversationObjective,
    TokenBudgetPacks,
)

LONG = {"id": "long", "image": "0.png",
        "conversations": [human("<image>\nwhat is in the image"),
                          gpt("two blue dogs " * 90)]}
WIDE = {"id": "wide", "image": ["0.png"] * 17, "conversations": [
    human("<image>" * 17), gpt("blue")]}


@pytest.fixture
def chat_mm(chat_tokenizer):
    mm = MultimodalLM(tiny_tower(), tiny_llm(vocab_size=512), chat_tokenizer)
    adopt_chat_template(mm.tokenizer, "vicuna_v1")
    return mm


def dataset_of(tmp_path, mm, records, max_length):
    images = write_images(tmp_path / "images")
    path = write_records(tmp_path / "data.jsonl", records)
    return ConversationDataset(ConversationRecords(path, images), mm.processor,
                               image_tokens=mm.tower.num_image_tokens(), max_length=max_length)


def test_packed_collate_truncates_and_drops_exactly_as_padded(tmp_path, chat_mm):
    """A record longer than max_length is cut at the same token, one whose images alone do
    not fit is dropped with the same reason; the rest are packed, never past max_length."""
    dataset = dataset_of(tmp_path, chat_mm, [*GOOD, LONG], max_length=256)
    items = [dataset[i] for i in range(len(dataset))]
    wide = dataset_of(tmp_path / "w", chat_mm, [GOOD[2], WIDE], max_length=300)[1]
    items.append(wide)
    padded = ConversationCollate(chat_mm, max_length=256)(items)
    packed = ConversationCollate(chat_mm, max_length=256, packing=True)(items)
    assert packed.pixel_values.input_ids == padded.pixel_values.input_ids
    assert packed.pixel_values.labels == padded.pixel_values.labels
    assert [b.reason for b in packed.undecodable] == [b.reason for b in padded.undecodable]
    assert "more than max_length 256" in packed.undecodable[0].reason
    batch, tokens = packed.pixel_values, chat_mm.tower.num_image_tokens()
    cut = batch.input_ids[-1]
    assert len(cut) + cut.count(chat_mm.image_token_id) * (tokens - 1) == 256  # LONG, truncated
    lengths = [len(ids) + ids.count(chat_mm.image_token_id) * (tokens - 1)
               for ids in batch.input_ids]
    assert sorted(i for row in batch.rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 256 for row in batch.rows)
    assert len(batch.rows) < len(lengths)


def test_packed_captions_train_like_padded_ones(tmp_path, tokenizer):
    """CaptionCollate(packing=True) gives the loss of the padded caption batch."""
    data = tmp_path / "data"
    write_captions(data)
    mm = MultimodalLM(tiny_tower(), tiny_llm(), tokenizer).train_projector_only()
    dataset = CaptionFolder(data, data / "captions.jsonl", mm.processor)
    items = [dataset[i] for i in range(len(dataset))]
    objective = CaptionObjective(mm)
    padded = CaptionCollate(mm)(items)
    packed = CaptionCollate(mm, packing=True, max_length=64)(items)
    assert len(packed.pixel_values.rows) < len(items)
    expected = objective(padded.pixel_values, labels=padded.labels).loss
    torch.testing.assert_close(objective(packed.pixel_values).loss, expected,
                               rtol=1e-5, atol=1e-5)


def test_token_budget_packs_cover_every_record_once(tmp_path, chat_mm):
    dataset = dataset_of(tmp_path, chat_mm, [*GOOD, LONG] * 3, max_length=256)
    packs = TokenBudgetPacks(dataset, max_tokens=300, max_length=256)
    assert sorted(i for pack in packs.packs for i in pack) == list(range(len(dataset)))
    counts = [min(abs(int(n)), 256) for n in dataset.lengths]
    assert all(sum(counts[i] for i in pack) <= 300 for pack in packs.packs)
    assert len(packs[0]) == len(packs.packs[0])
    assert packs.describe()["max_tokens"] == 300
    with pytest.raises(ValueError, match="less than max_length"):
        TokenBudgetPacks(dataset, max_tokens=50, max_length=256)
    with pytest.raises(ValueError, match="need a dataset with `lengths`"):
        TokenBudgetPacks([1, 2], max_tokens=50, max_length=10)


def test_packing_flags_translate_and_refuse_what_cannot_go_together():
    parser = argparse.ArgumentParser()
    parser.add_argument("--group-by-length", action="store_true")
    parser.add_argument("--data-format", default="llava")
    add_packing_arguments(parser)
    assert packing_from_args(parser.parse_args([])) == PackingOptions()
    args = parser.parse_args(["--packing", "--max-tokens-per-batch", "4096",
                              "--loss-reduction", "record"])
    assert packing_from_args(args) == PackingOptions(True, 4096, "record")
    for extra, message in ((["--group-by-length"], "--group-by-length"),
                           (["--data-format", "captions"], "captions")):
        with pytest.raises(ValueError, match=message):
            packing_from_args(parser.parse_args(["--max-tokens-per-batch", "64", *extra]))
    with pytest.raises(ValueError, match="tar shards"):
        packing_from_args(parser.parse_args(["--max-tokens-per-batch", "64"]), shards=True)
    with pytest.raises(ValueError, match="must be positive"):
        packing_from_args(parser.parse_args(["--max-tokens-per-batch", "0"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--loss-reduction", "sample"])


def fit(mm, dataset, collate, run_dir, steps, resume=False, reduction="record"):
    # A constant LR, so a 2-step run resumed to 4 follows the 4-step schedule.
    config = TrainConfig(steps=steps, batch_size=2, lr=3e-3, min_lr=3e-3, weight_decay=0.0,
                         grad_accumulation=2, num_workers=0, checkpoint_every=2,
                         keep_checkpoints=0, log_every=100, device="cpu")
    return Trainer(ConversationObjective(mm, loss_reduction=reduction), dataset, config,
                   run_dir, collate=collate, progress=False).fit(resume=resume)


@pytest.mark.slow  # four trainer runs (about 30 s alone on two cores)
def test_a_packed_token_budget_run_resumes_bit_exactly_mid_epoch(tmp_path, chat_tokenizer):
    """Four steps straight, against two then a resume to four: the same packs, rows, losses
    and weights (the packs are rebuilt from the same lengths; the rows from the batch)."""
    def run(run_dir, steps, resume=False):
        mm = MultimodalLM(tiny_tower(), tiny_llm(vocab_size=512), chat_tokenizer)
        adopt_chat_template(mm.tokenizer, "vicuna_v1")
        mm.train_projector_only()
        dataset = dataset_of(tmp_path / run_dir.name, mm, [*GOOD, LONG] * 6, max_length=256)
        packs = TokenBudgetPacks(dataset, max_tokens=256, max_length=256)
        assert len(packs) >= 8  # four steps of two packs or more: the resume is mid-epoch
        collate = ConversationCollate(mm, max_length=256, packing=True)
        return mm, fit(mm, packs, collate, run_dir, steps, resume)

    assert_resumes_bit_exactly(run, tmp_path)


def assert_resumes_bit_exactly(run, tmp_path) -> None:
    """`run(dir, steps, resume)` four steps straight against two then a resume to four: the
    same losses and weights, bit for bit."""
    straight_mm, straight = run(tmp_path / "straight", 4)
    run(tmp_path / "resumed", 2)
    resumed_mm, resumed = run(tmp_path / "resumed", 4, resume=True)
    assert resumed.losses == straight.losses  # bit-exact
    for (name, a), (_, b) in zip(straight_mm.named_parameters(), resumed_mm.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_undecodable_items_inside_packs_are_dropped_and_named(chat_mm, tmp_path):
    dataset = dataset_of(tmp_path, chat_mm, GOOD, max_length=256)
    bad = UndecodableImage("x.png", "broken")
    batch = ConversationCollate(chat_mm, max_length=256, packing=True)(
        [[dataset[0], bad], [dataset[2]]])
    assert batch.undecodable == [bad] and len(batch.pixel_values) == 2
