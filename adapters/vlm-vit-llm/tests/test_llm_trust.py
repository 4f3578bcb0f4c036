"""Hostile input at the bridge's surfaces (issues 40 and 48): a LLaVA-NeXT config whose
pinpoints are not a bounded list of pairs, token budgets and lengths that leave nothing to
train, and a LLaVA record naming thousands of images. Each is refused or skipped in one
line naming the file or flag, before anything large is read or decoded."""

import json

import pytest
import transformers
from test_llava_next_export import TILINGS
from test_llm_anyres import tiled_mm

from vlm_vit_llm import MultimodalLM, export_llava

MAX_LINE = 300  # characters an error line may take, whatever the input


# ---- issue 40: image_grid_pinpoints ---------------------------------------------------------

@pytest.fixture
def next_folder(tmp_path, tokenizer, monkeypatch):
    """Our LLaVA-NeXT export; reading its weights (transformers' from_pretrained) fails the
    test, so a check that passes them has run before any weight is read."""
    export_llava(tiled_mm(tokenizer, TILINGS["next"]), tmp_path / "next")

    def refuse(*args, **kwargs):
        pytest.fail("the weights were read before the config was checked")

    monkeypatch.setattr(transformers.LlavaNextForConditionalGeneration, "from_pretrained",
                        refuse)
    return tmp_path / "next"


@pytest.mark.parametrize(("pinpoints", "message"), [
    ("anyres", "image_grid_pinpoints must be a list of 1 to 1024 [height, width] pairs, got "
               "str 'anyres'"),
    ([[32, 64]] * 100_000, "image_grid_pinpoints must be a list of 1 to 1024 [height, width] "
                           "pairs, got list of 100000 [[32, 64], [32, 64], "),
    ([], "image_grid_pinpoints must be a list of 1 to 1024 [height, width] pairs, got list "
         "of 0 []"),
    ([[32, 64], [32, "x" * 100_000]], "image_grid_pinpoints[1] is not a [height, width] pair "
                                      "of positive ints: [32, 'xxxxxx"),
    ([[32, 64], [32, 64, 96]], "image_grid_pinpoints[1] is not a [height, width] pair"),
    ([[32, 64], [True, 64]], "image_grid_pinpoints[1] is not a [height, width] pair"),
    ([[32, 50]], "tiling pinpoint (32, 50) is not a multiple of the tile size 32"),
])
def test_hostile_pinpoints_are_one_short_line_before_any_weight_is_read(next_folder, pinpoints,
                                                                        message):
    """`"anyres"` escaped as transformers' StrictDataclassFieldValidationError; 100,000
    pinpoints gave a one-million-character line after the whole model had loaded."""
    config = next_folder / "config.json"
    raw = json.loads(config.read_text())
    raw["image_grid_pinpoints"] = pinpoints
    config.write_text(json.dumps(raw))
    with pytest.raises(ValueError) as caught:
        MultimodalLM.from_pretrained(next_folder)
    line = str(caught.value)
    assert line.startswith(f"{config}: ") and message in line, line
    assert "\n" not in line and len(line) < MAX_LINE, len(line)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("vision_feature_select_strategy", "full" * 10_000, "vision_feature_select_strategy "
                                                         "'fullfullfull"),
    ("vision_feature_layer", "x" * 10_000, "vision_feature_layer"),
    ("model_type", "llava_next", "is not one of"),
])
def test_other_hostile_fields_are_one_short_line_naming_the_file(next_folder, field, value,
                                                                 message):
    from vlm_vit_llm.llava_next import read_llava

    config = next_folder / "config.json"
    raw = json.loads(config.read_text())
    raw[field] = value if field != "model_type" else ["llava_next"] * 10_000
    config.write_text(json.dumps(raw))
    with pytest.raises(ValueError) as caught:
        read_llava(next_folder)
    line = str(caught.value)
    assert line.startswith(f"{config}: ") and message in line, line
    assert "\n" not in line and len(line) < MAX_LINE, len(line)


# ---- issue 40: token budgets and lengths that leave nothing to train -----------------------

@pytest.fixture
def chat_parts(tmp_path, chat_tokenizer):
    """An encoder checkpoint, an LLM folder with a chat tokenizer, and an image folder."""
    from conftest import tiny_llm, tiny_tower
    from test_conversation_data import write_images

    tiny_tower().encoder.save_pretrained(tmp_path / "encoder")
    tiny_llm(vocab_size=512).save_pretrained(tmp_path / "llm")
    chat_tokenizer.save_pretrained(tmp_path / "llm")
    write_images(tmp_path / "images")
    return tmp_path


def llava_train(parts, records, *extra, images=None):
    """`vlm-vit llm train --data-format llava` on `records`: its exit code."""
    from test_conversation_data import write_records

    from vlm_vit.cli import main

    data = write_records(parts / "data.json", records, lines=False)
    return main(["llm", "train", "--data-format", "llava", "--data", str(data),
                 "--image-folder", str(images or parts / "images"), "--steps", "2",
                 "--num-workers", "0",
                 "--device", "cpu", "--tower", str(parts / "encoder"), "--llm",
                 str(parts / "llm"), "--template", "vicuna_v1", "--quiet",
                 "--out", str(parts / "run"), *extra])


def error_line(capsys, parts) -> str:
    """The one line a refused command leaves on stderr (short, but for the paths in it)."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("vlm-vit llm: error: "), lines[0]
    assert len(lines[0].replace(str(parts), "")) < MAX_LINE, lines[0]
    return lines[0]


def six_records():
    from test_conversation_data import GOOD

    return [*GOOD, dict(GOOD[0], id="five"), dict(GOOD[2], id="six")]


@pytest.mark.parametrize(("budget", "message"), [
    (10**18, "--max-tokens-per-batch 1000000000000000000 is over the most a batch may hold, "
             "10,000,000 tokens (MAX_TOKENS_PER_BATCH)"),
    (100_000, "--max-tokens-per-batch 100000 packs the 6 record(s) of {data} into 1 batch(es), "
              "fewer than --batch-size 2"),
])
def test_a_token_budget_that_makes_fewer_batches_than_a_step_names_the_flag(chat_parts, capsys,
                                                                            budget, message):
    """It said "the dataset has 1 items, fewer than one batch of 2", naming neither flag."""
    assert llava_train(chat_parts, six_records(), "--batch-size", "2",
                       "--max-tokens-per-batch", str(budget)) == 1
    assert message.format(data=chat_parts / "data.json") in error_line(capsys, chat_parts)


def test_a_max_length_that_keeps_no_assistant_token_names_the_flag(chat_parts, capsys):
    """`--packing --max-length 64` where every record's prompt passes 64 tokens: it trained
    nothing, then blamed "6 undecodable image files"."""
    long_prompt = "describe the picture, what is in the image? " * 12
    records = [dict(record, conversations=[
        {"from": "human", "value": record["conversations"][0]["value"] + " " + long_prompt},
        *record["conversations"][1:]]) for record in six_records()]
    assert llava_train(chat_parts, records, "--batch-size", "2", "--packing",
                       "--max-length", "64") == 1
    line = error_line(capsys, chat_parts)
    assert "--max-length 64 leaves nothing to train: 6 of the 6 record(s) of " in line, line
    assert "(id one): no assistant token is left within max_length 64); raise --max-length" \
        in line, line


# ---- issue 48: a LLaVA record naming thousands of images ------------------------------------

PIXELS_AT_336 = 336 * 336 * 3 * 4  # bytes of one preprocessed image (float32)


def bomb_file(folder):
    """A 200 KB conversations file: a good record, one whose 10,000 `<image>` all name one
    small file, and a text-only record."""
    from test_conversation_data import GOOD, gpt, human, write_images, write_records

    images = write_images(folder / "images")
    bomb = {"id": "bomb", "image": ["0.png"] * 10_000,
            "conversations": [human("<image>" * 10_000 + "\nwhat differs?"), gpt("nothing")]}
    data = write_records(folder / "data.json", [GOOD[0], bomb, GOOD[2], GOOD[1]], lines=False)
    return data, images


@pytest.fixture
def decodes(monkeypatch):
    """Counts the images decoded; decoding more than a record may name fails the test (on
    code that decodes all 10,000, before it runs out of memory)."""
    from vlm_vit_llm import conversations

    count = []
    real = conversations.load_pixels

    def counted(processor, image, video=None):
        count.append(image)
        if len(count) > 256:  # records.MAX_IMAGES
            pytest.fail("decoded more than 256 images")
        return real(processor, image, video)

    monkeypatch.setattr(conversations, "load_pixels", counted)
    return count


def test_a_record_naming_10000_images_is_skipped_and_named_before_any_is_decoded(tmp_path,
                                                                                decodes):
    """Issue 48, 1: `ConversationDataset(...)[i]` decoded and preprocessed all 10,000 images
    at 336 px (13.5 GB) before the collate refused the record."""
    import resource
    import tracemalloc

    from vlm_vit import ImageProcessor
    from vlm_vit_llm.records import ConversationRecords
    from vlm_vit_llm.train import ConversationDataset

    data, images = bomb_file(tmp_path)
    assert 150_000 < data.stat().st_size < 250_000
    records = ConversationRecords(data, images)
    assert len(records) == 3 and records.skipped.by_reason == {"too many images": 1}
    assert "(id bomb): 'image' names 10000 images, more than the 256 a record may hold " \
           "(MAX_IMAGES)" in records.skipped.named[0]
    with pytest.raises(ValueError, match=r"\(id bomb\): 'image' names 10000 images"):
        ConversationRecords(data, images, strict=True)

    dataset = ConversationDataset(records, ImageProcessor.for_family("clip", size=336))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracemalloc.start()
    items = [dataset[index] for index in range(len(dataset))]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert [item.where.rsplit("(id ", 1)[1] for item in items] == ["one)", "text)", "two)"]
    assert len(decodes) == 3 and [len(item.pixels) for item in items] == [1, 0, 2]
    everything = 10_000 * PIXELS_AT_336  # 13.5 GB
    print(f"peak traced {peak / 1e6:.1f} MB, max RSS grew {grown / 1e6:.1f} MB")
    assert peak < 20 * PIXELS_AT_336, peak  # measured: 0.7 MB; all images: 13.5 GB
    assert grown < everything / 50, grown


def test_llm_train_skips_and_names_the_10000_image_record(tmp_path, chat_parts, capsys,
                                                          decodes):
    """The same file through `vlm-vit llm train --data-format llava`, with an LLM whose
    context (1,000,000) holds the record's 160,000 image tokens: it is skipped by its image
    count, named on stderr, and the run trains on the rest."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(chat_parts / "llm")
    config.max_position_embeddings = 1_000_000
    config.save_pretrained(chat_parts / "llm")
    data, images = bomb_file(tmp_path / "bomb")
    raw = json.loads(data.read_text())
    assert llava_train(chat_parts, raw, "--batch-size", "2", images=images) == 0
    err = capsys.readouterr().err
    assert "skipped 1 bad record(s) of 4" in err and "(id bomb): 'image' names 10000 images" \
        in err, err
    assert len(decodes) <= 6
