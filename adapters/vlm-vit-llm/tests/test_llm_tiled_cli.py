"""A tiled (AnyRes) model through the command line and shards: `vlm-vit llm train` in both
stages, padded and `--packing`, keeps the tiling; LLaVA shards decode to the same
`TiledImage`s as the folder; `llm generate` and `llm export` (LLaVA-NeXT) on the result;
`--anyres` tiles a new model, a saved tiled `--tower` keeps its tiling (issue 47)."""

import json

import pytest
import torch
from conftest import tiny_tower
from test_conversation_data import gpt, human, write_records
from test_llm_shards import shard_items
from test_llm_train import write_captions
from test_llm_train_anyres import SIZES, tiled_mm, write_images

from vlm_vit import VisionTower
from vlm_vit.cli import main
from vlm_vit.data.shards.writer import write_shards
from vlm_vit.processor import Tiling
from vlm_vit_llm import MultimodalLM, TiledImage
from vlm_vit_llm.records import ConversationRecords
from vlm_vit_llm.tiling_args import parse_anyres
from vlm_vit_llm.train import ConversationDataset, ConversationItem, ConversationShardDecode

RECORDS = [  # one image a record: what the shard writer takes
    {"id": "landscape", "image": "0.png",
     "conversations": [human("<image> and?"), gpt("the green tree")]},
    {"id": "portrait", "image": "1.png",
     "conversations": [human("What is it? <image>"), gpt("two blue dogs")]},
    {"id": "text", "conversations": [human("describe the picture"), gpt("a red square")]},
    {"id": "strip", "image": "2.png", "conversations": [human("<image>"), gpt("a red square")]},
]


@pytest.fixture
def tiled_model(tmp_path, tokenizer):
    mm = tiled_mm(tokenizer, vocab_size=512)
    mm.save_pretrained(tmp_path / "tiled")
    return tmp_path / "tiled", mm.tower.tiling


def caption_args(folder, model, out, *extra):
    data = folder / "data"
    if not data.exists():
        write_captions(data)
    return ["llm", "train", str(model), "--data", str(data), "--captions",
            str(data / "captions.jsonl"), "--steps", "2", "--batch-size", "2",
            "--num-workers", "0", "--device", "cpu", "--quiet", "--out", str(out), *extra]


@pytest.mark.slow
def test_a_tiled_model_trains_both_stages_packed_then_generates_and_exports(
        tmp_path, tiled_model, capsys):
    from transformers import LlavaNextForConditionalGeneration

    model, tiling = tiled_model
    assert main(caption_args(tmp_path, model, tmp_path / "s1", "--packing")) == 0
    assert "trained stage 1 for 2 steps" in capsys.readouterr().out
    stage_1 = MultimodalLM.from_pretrained(tmp_path / "s1" / "model")
    assert stage_1.tower.tiling == tiling and stage_1.tower.image_newline is not None
    assert main(caption_args(tmp_path, tmp_path / "s1" / "model", tmp_path / "s2", "--stage",
                             "2", "--lora-r", "4")) == 0
    capsys.readouterr()
    stage_2 = tmp_path / "s2" / "model"
    assert json.loads((stage_2 / "multimodal_config.json").read_text())["llm_adapter"]
    assert MultimodalLM.from_pretrained(stage_2).tower.tiling == tiling
    image = tmp_path / "data" / "0.png"
    assert main(["llm", "generate", str(stage_2), "--image", str(image),
                 "--max-new-tokens", "3"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert main(["llm", "merge", str(stage_2), "--out", str(tmp_path / "merged")]) == 0
    assert MultimodalLM.from_pretrained(tmp_path / "merged").tower.tiling == tiling
    assert main(["llm", "export", str(tmp_path / "merged"), "--out",
                 str(tmp_path / "next")]) == 0
    assert "LlavaNextForConditionalGeneration" in capsys.readouterr().out
    exported = LlavaNextForConditionalGeneration.from_pretrained(tmp_path / "next")
    assert exported.config.image_grid_pinpoints == [list(p) for p in tiling.pinpoints]


def test_llava_shards_decode_to_the_folder_s_tiled_images(tmp_path, tokenizer):
    mm = tiled_mm(tokenizer, vocab_size=512)
    images = write_images(tmp_path / "images")
    records = write_records(tmp_path / "records.json", RECORDS, lines=False)
    write_shards(images, tmp_path / "shards", per_shard=2, llava=records, progress=False)
    dataset = ConversationDataset(ConversationRecords(records, images), mm.processor)
    decode = ConversationShardDecode(mm.processor, mm.image_token)
    by_id = shard_items(tmp_path / "shards", decode, lambda sample: sample.json()["id"])
    for index, record in enumerate(RECORDS):
        ours, theirs = by_id[record["id"]], dataset[index]
        assert isinstance(ours, ConversationItem), ours
        assert len(ours.pixels) == len(theirs.pixels) == ("image" in record)
        for a, b in zip(ours.pixels, theirs.pixels, strict=True):
            assert isinstance(a, TiledImage) and a.size == b.size
            assert torch.equal(a.views, b.views)
    assert [by_id[name].pixels[0].size for name in ("landscape", "portrait", "strip")] == SIZES


@pytest.mark.slow
def test_a_tiled_model_trains_on_llava_shards(tmp_path, tiled_model, capsys):
    model, _ = tiled_model
    images = write_images(tmp_path / "images")
    records = write_records(tmp_path / "records.json", RECORDS, lines=False)
    write_shards(images, tmp_path / "shards", per_shard=2, llava=records, progress=False)
    assert main(["llm", "train", str(model), "--data-format", "llava", "--data",
                 f"{tmp_path / 'shards'}/*.tar", "--template", "plain", "--steps", "2",
                 "--batch-size", "2", "--num-workers", "0", "--device", "cpu", "--quiet",
                 "--packing", "--out", str(tmp_path / "run")]) == 0
    assert "trained stage 1 for 2 steps" in capsys.readouterr().out
    assert MultimodalLM.from_pretrained(tmp_path / "run" / "model").tower.tiling is not None


# --anyres llava-next on the tiny tower's 32-pixel input: LLaVA-NeXT's canvases in tiles.
LLAVA_NEXT_32 = Tiling(pinpoints=[(32, 64), (64, 32), (64, 64), (96, 32), (32, 96)],
                       tile_size=32)


def new_model_args(parts, tower, out, *extra):
    """`llm train` of a new model from `tower` and the tiny LLM: one step of captions."""
    data = parts / "data"
    return ["llm", "train", "--tower", str(tower), "--llm", str(parts / "llm"), "--data",
            str(data), "--captions", str(data / "captions.jsonl"), "--steps", "1",
            "--batch-size", "2", "--num-workers", "0", "--device", "cpu", "--quiet", "--out",
            str(out), *extra]


def test_anyres_tiles_a_new_model_from_the_command_line(parts, capsys):
    assert main(new_model_args(parts, parts / "encoder", parts / "run", "--anyres",
                               "llava-next")) == 0, capsys.readouterr().err
    assert "trained stage 1 for 1 steps" in capsys.readouterr().out
    trained = MultimodalLM.from_pretrained(parts / "run" / "model")
    assert trained.tower.tiling == LLAVA_NEXT_32 and trained.processor.tiling == LLAVA_NEXT_32
    assert trained.tower.image_newline is not None


def test_a_saved_tiled_tower_keeps_its_tiling_and_refuses_anyres(parts, tiled_model, capsys):
    """A tower saved tiled, bare (`VisionTower.save_pretrained`, its tiling in config.json
    alone) or in a model's `tower/` folder (with its tiling processor), keeps its tiling as
    `--tower`; `--anyres` beside it is refused in one line."""
    model, tiling = tiled_model
    base = tiny_tower()
    VisionTower(base.encoder, base.pooler, feature_layer=-2,
                tiling=tiling).save_pretrained(parts / "bare_tower")
    for name, tower in {"bare": parts / "bare_tower", "model's": model / "tower"}.items():
        assert main(new_model_args(parts, tower, parts / name)) == 0, capsys.readouterr().err
        trained = MultimodalLM.from_pretrained(parts / name / "model")
        assert trained.tower.tiling == tiling, name
        assert trained.processor.tiling == tiling, name
        capsys.readouterr()
        assert main(new_model_args(parts, tower, parts / f"{name}_anyres", "--anyres",
                                   "llava-next")) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines == [f"vlm-vit llm: error: --anyres llava-next: --tower {tower} tiles "
                         "already (canvases 32x64,64x32,64x64 of 32-pixel tiles) and keeps its "
                         "tiling; drop --anyres, or give an untiled tower"], name


@pytest.mark.parametrize(("value", "message"), [
    ("llava_next", "--anyres llava_next is not a preset (llava-next, anyres_max_N) nor at "
                   "most 1024 canvases HEIGHTxWIDTH in pixels"),
    ("anyres_max_0", "--anyres anyres_max_0: OneVision's anyres_max_N needs N in 1..144"),
    ("32x64,64x", "--anyres 32x64,64x: canvas 64x is not HEIGHTxWIDTH in positive pixels"),
    ("32x48", "--anyres 32x48: tiling pinpoint (32, 48) is not a multiple of the tile size 32"),
    ("model", "--anyres is for a new model from --tower and --llm; MODEL "),
])
def test_a_bad_anyres_is_one_line_naming_the_flag(parts, tiled_model, capsys, value, message):
    args = new_model_args(parts, parts / "encoder", parts / "run", "--anyres", value)
    if value == "model":
        args = caption_args(parts, tiled_model[0], parts / "run", "--anyres", "llava-next")
    assert main(args) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vlm-vit llm: error: {message}"), lines


def test_anyres_values_give_llava_next_and_onevision_canvases():
    assert parse_anyres("llava-next").tiling(336).pinpoints == (
        (336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))  # transformers' default
    onevision = parse_anyres("anyres_max_9").tiling(384)
    assert onevision.max_feature_tiles == 9 and len(onevision.pinpoints) == 36
    assert onevision.pinpoints[:2] == ((384, 384), (384, 768))  # transformers' order
    assert onevision.pinpoints[-1] == (2304, 2304)
    explicit = parse_anyres("336x672, 672x336,672x672").tiling(336)
    assert explicit.pinpoints == ((336, 672), (672, 336), (672, 672))
    assert explicit.max_feature_tiles is None
