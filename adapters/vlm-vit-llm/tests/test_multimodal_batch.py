"""Batch building as pure functions of token ids and per-image counts (issue 41): no model,
tokenizer or tower, so each test runs in milliseconds."""

import pytest
import torch

from vlm_vit_llm.batch_types import IGNORE_INDEX
from vlm_vit_llm.multimodal_batch import build_batch, expand

IMAGE, PAD = 9, 0


def test_each_image_token_becomes_its_image_s_count_and_is_never_learned():
    sequences, labels = expand([[1, IMAGE, 2], [IMAGE, IMAGE]], [3, 1, 2], IMAGE,
                               labels=[[1, IMAGE, 2], [IMAGE, IGNORE_INDEX]],
                               targets=[[5, IGNORE_INDEX], [6]])
    assert sequences == [[1, IMAGE, IMAGE, IMAGE, 2, 5], [IMAGE, IMAGE, IMAGE, 6]]
    assert labels == [[1, *[IGNORE_INDEX] * 3, 2, 5], [*[IGNORE_INDEX] * 3, 6]]
    with pytest.raises(ValueError, match="target 0 holds the image token"):
        expand([[1]], [], IMAGE, targets=[[IMAGE]])
    with pytest.raises(ValueError, match=r"texts\[0\] is empty"):
        expand([[]], [], IMAGE)


def test_padded_and_packed_rows_place_every_image_s_tokens_at_its_positions():
    sequences, labels = expand([[1, IMAGE], [IMAGE, 2, 3, 4]], [2, 1], IMAGE)
    first, second = torch.ones(2, 4), torch.full((1, 4), 2.0)
    features = [[first], [second]]
    padded = build_batch(sequences, labels, features, image_token_id=IMAGE, pad_token_id=PAD,
                         width=4, padding_side="left")
    assert padded.input_ids.tolist() == [[PAD, 1, IMAGE, IMAGE], [IMAGE, 2, 3, 4]]
    assert padded.position_ids.tolist() == [[0, 0, 1, 2], [0, 1, 2, 3]]
    assert padded.record_index.tolist() == [[-1, 0, 0, 0], [1, 1, 1, 1]]
    assert torch.equal(padded.image_features, torch.cat([first, second]))
    assert padded.packing is None
    packed = build_batch(sequences, labels, features, image_token_id=IMAGE, pad_token_id=PAD,
                         width=4, pack=[[1, 0]], packing="position_ids")
    assert packed.input_ids.tolist() == [[IMAGE, 2, 3, 4, 1, IMAGE, IMAGE]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert torch.equal(packed.image_features, torch.cat([second, first]))  # in row order
    assert packed.image_mask.sum().item() == 3 and packed.packing == "position_ids"
    with pytest.raises(ValueError, match="packed rows need an attention path"):
        build_batch(sequences, labels, features, image_token_id=IMAGE, pad_token_id=PAD,
                    width=4, pack=[[0, 1]])
    empty = build_batch([[1, 2]], [[IGNORE_INDEX] * 2], [[]], image_token_id=IMAGE,
                        pad_token_id=PAD, width=4, with_labels=False)
    assert empty.image_features.shape == (0, 4) and empty.labels is None
