"""M-RoPE position ids (issue 44) against transformers' own `get_rope_index` of Qwen2-VL,
Qwen2.5-VL and Qwen3-VL, on random prompts mixing text, images and videos, several per
prompt, left-padded; packed rows restart them per record."""

import random

import pytest
import torch
import transformers

from vlm_vit_llm.mrope import VisionSpan, batch_positions, packed_positions, rope_delta

MERGE = 2
FAMILIES = ["Qwen2VL", "Qwen2_5_VL", "Qwen3VL"]


@pytest.fixture(scope="module", params=FAMILIES)
def their_model(request):
    """A tiny transformers model of the family: its `get_rope_index` is the reference."""
    name = request.param
    config = getattr(transformers, name + "Config")(
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, embed_dim=16,
                           out_hidden_size=32, intermediate_size=32, spatial_merge_size=MERGE),
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=100,
                         eos_token_id=2, rope_parameters={"rope_type": "default",
                                                          "mrope_section": [2, 3, 3],
                                                          "rope_theta": 10000.0}))
    return name, getattr(transformers, name + "Model")(config).eval()


def random_record(rng: random.Random, family: str, tokens_per_second: float):
    """A record as (token types, spans, transformers' image grids, video grids, seconds per
    video grid): text between every image and video (Qwen's vision start and end tokens;
    Qwen3-VL's timestamps between a video's frames)."""
    types, spans, images, videos, seconds = [], [], [], [], []

    def text(count):
        types.extend([0] * count)

    text(rng.randint(1, 4))
    for _ in range(rng.randint(0, 3)):
        t, h, w = rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 4)
        if rng.random() < 0.5:  # an image
            images.append([1, h * MERGE, w * MERGE])
            spans.append(VisionSpan(len(types), (1, h, w)))
            types.extend([1] * h * w)
        elif family == "Qwen3VL":  # a video, frame by frame, timestamps between
            videos.append([t, h * MERGE, w * MERGE])
            for frame in range(t):
                if frame:
                    text(rng.randint(1, 2))
                spans.append(VisionSpan(len(types), (1, h, w)))
                types.extend([2] * h * w)
        else:
            step = rng.choice([0.5, 1.0, 1.5, 2.0])
            videos.append([t, h * MERGE, w * MERGE])
            seconds.append(step)
            time_step = tokens_per_second * step if family == "Qwen2_5_VL" else 1.0
            spans.append(VisionSpan(len(types), (t, h, w), time_step))
            types.extend([2] * t * h * w)
        text(rng.randint(1, 4))
    return types, spans, images, videos, seconds


def theirs(model, records, pad_left=True):
    """transformers' ids for the records, one per row, padded on the left."""
    width = max(len(record[0]) for record in records)
    types = torch.zeros(len(records), width, dtype=torch.int)
    mask = torch.zeros(len(records), width, dtype=torch.long)
    for row, (kinds, *_) in enumerate(records):
        where = slice(width - len(kinds), width) if pad_left else slice(0, len(kinds))
        types[row, where] = torch.tensor(kinds, dtype=torch.int)
        mask[row, where] = 1
    images = [grid for record in records for grid in record[2]]
    videos = [grid for record in records for grid in record[3]]
    seconds = [value for record in records for value in record[4]]
    extra = {"second_per_grid_ts": torch.tensor(seconds)} if seconds else {}
    positions, deltas = model.get_rope_index(
        torch.ones_like(mask), types,
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None, attention_mask=mask, **extra)
    return positions, deltas.flatten(), mask


@pytest.mark.parametrize("seed", range(4))
def test_batch_ids_equal_get_rope_index_on_mixed_padded_prompts(their_model, seed):
    family, model = their_model
    tokens_per_second = getattr(model.config.vision_config, "tokens_per_second", 1)
    rng = random.Random(seed)
    records = [random_record(rng, family, tokens_per_second) for _ in range(5)]
    assert any(record[1] for record in records)
    expected, deltas, mask = theirs(model, records)
    ours = batch_positions(mask, [record[1] for record in records])
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    for row, (kinds, *_) in enumerate(records):
        real = mask[row].bool()
        assert rope_delta(ours[:, row, real], len(kinds)) == deltas[row].item()


def test_a_packed_row_restarts_each_record_s_ids(their_model):
    """Each record's slice of the packed row equals transformers' ids for it alone."""
    family, model = their_model
    tokens_per_second = getattr(model.config.vision_config, "tokens_per_second", 1)
    rng = random.Random(7)
    records = [random_record(rng, family, tokens_per_second) for _ in range(4)]
    lengths = [len(record[0]) for record in records]
    packed = packed_positions(lengths, [record[1] for record in records],
                              width=sum(lengths) + 3)
    offset = 0
    for record, length in zip(records, lengths):
        alone, _, _ = theirs(model, [record])
        torch.testing.assert_close(packed[:, offset:offset + length], alone[:, 0], rtol=0,
                                   atol=0)
        offset += length
    assert packed[:, offset:].eq(0).all()


@pytest.mark.parametrize("spans", [
    [VisionSpan(3, (1, 2, 2)), VisionSpan(5, (1, 1, 1))],  # overlapping
    [VisionSpan(8, (1, 2, 2))],  # past the end
    [VisionSpan(0, (1, 0, 2))],  # an empty grid
])
def test_spans_that_do_not_fit_are_refused(spans):
    with pytest.raises(ValueError, match="does not fit a record of 10 tokens"):
        packed_positions([10], [spans])
