"""One dtype vocabulary (issue 41): every Python API that takes a dtype takes a `torch.dtype`
or its usual string (`vlm_vit.presets.parse_dtype`), and refuses any other naming them."""

from __future__ import annotations

import pytest
import torch

from vlm_vit import VisionEncoder, VisionTower, build_pooler
from vlm_vit.adapt.finetune import ImageClassifier
from vlm_vit.io.loading import load_encoder, load_tower, load_with_processor
from vlm_vit.presets import parse_dtype

from .conftest import tiny_config

SPELLINGS = [("float32", torch.float32), ("fp32", torch.float32), ("FP32", torch.float32),
             ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
             ("float16", torch.float16), ("fp16", torch.float16),
             (torch.bfloat16, torch.bfloat16), (torch.half, torch.float16), (None, None)]


@pytest.mark.parametrize("value, expected", SPELLINGS)
def test_parse_dtype_reads_each_usual_spelling(value, expected):
    assert parse_dtype(value) is expected


@pytest.mark.parametrize("value", ["int8", "double", "bf-16", torch.float64, torch.int8, 16])
def test_parse_dtype_refuses_the_rest_naming_what_it_takes(value):
    with pytest.raises(ValueError, match=r"unknown dtype .*\(known: float32/fp32, "
                                         r"bfloat16/bf16, float16/fp16, or their torch.dtype"):
        parse_dtype(value)


def test_int8_is_read_only_where_quantization_is_offered():
    assert parse_dtype("int8", ("float32", "int8")) is torch.int8
    assert parse_dtype(torch.int8, ("float32", "int8")) is torch.int8


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A classifier directory over a tower: every loader below reads it."""
    torch.manual_seed(0)
    tower = VisionTower(VisionEncoder(tiny_config()),
                        build_pooler("mlp2x_gelu", in_dim=32, out_dim=16))
    directory = tmp_path_factory.mktemp("saved") / "classifier"
    ImageClassifier(tower, num_classes=3).save_pretrained(directory)
    return directory


LOADERS = {
    "VisionEncoder.from_pretrained": VisionEncoder.from_pretrained,
    "VisionTower.from_pretrained": VisionTower.from_pretrained,
    "ImageClassifier.from_pretrained": ImageClassifier.from_pretrained,
    "load_encoder": load_encoder,
    "load_with_processor": lambda path, dtype: load_with_processor(path, dtype=dtype)[0],
    "load_tower": load_tower,
    "VisionEncoder.from_state_dict": lambda path, dtype: VisionEncoder.from_state_dict(
        VisionEncoder(tiny_config()).state_dict(), tiny_config(), dtype=dtype),
}


@pytest.mark.parametrize("dtype", ["bf16", "bfloat16", torch.bfloat16])
@pytest.mark.parametrize("name", sorted(LOADERS))
def test_every_loader_takes_a_dtype_or_its_string(name, dtype, saved):
    model = LOADERS[name](saved, dtype=dtype)
    assert {t.dtype for t in model.state_dict().values()} == {torch.bfloat16}


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_every_loader_refuses_an_unknown_dtype_naming_the_spellings(name, saved):
    with pytest.raises(ValueError, match=r"unknown dtype 'double' \(known: float32/fp32"):
        LOADERS[name](saved, dtype="double")
