"""transformers' LLaVA-1.5 folders (`LlavaForConditionalGeneration`) read as a `MultimodalLM`
(issue 44): one transformers wrote itself gives transformers' logits on transformers' own
processor output, its head tied exactly when transformers ties it; our export reads back with
our logits; what we cannot represent is one line naming the file, before any weight is read."""

import json

import pytest
import torch
import transformers
from conftest import photos, tiny_llm, tiny_tower
from safetensors.torch import load_file, save_file
from test_llava_next_export import pil_processor
from test_tied_embeddings import kind_and_tokenizer, qwen2_tokenizer_dir  # noqa: F401

from vlm_vit import VisionTower, build_pooler
from vlm_vit.processor import ImageProcessor
from vlm_vit_llm import MultimodalLM, export_llava

LOGITS_ATOL = 1e-4
MAX_LINE = 300
PROMPTS = ["<image>\nwhat is in the image", "<image> the dog <image>", "the dog runs in the park"]


def llava_mm(tokenizer, kind="llama", feature_layer=-2, keep_prefix=False, processor=None):
    """A tiny CLIP-shaped tower (its projector as wide as the layers it reads) on a tiny LLM
    whose vocabulary is the tokenizer's, every tower weight off its init."""
    base = tiny_tower()
    layers = len(feature_layer) if isinstance(feature_layer, list) else 1
    pooler = build_pooler("mlp2x_gelu", in_dim=32 * layers, out_dim=base.pooler[0].out_features)
    tower = VisionTower(base.encoder, pooler, feature_layer=feature_layer,
                        keep_prefix=keep_prefix, processor=processor)
    mm = MultimodalLM(tower, tiny_llm(len(tokenizer), kind=kind), tokenizer)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in mm.named_parameters():
            if name.startswith("tower."):
                parameter.add_(torch.randn_like(parameter) * 0.02)
    return mm.eval()


def their_llava(mm, folder, top: bool, text: bool):
    """`save_pretrained` of transformers' own LLaVA built from our export's config with
    `tie_word_embeddings` `top` at the top level and `text` in the text config, every weight
    then trained off ours, with our export's processor; returns transformers' reading of it."""
    export_llava(mm, folder / "export")
    raw = json.loads((folder / "export" / "config.json").read_text())
    raw["tie_word_embeddings"], raw["text_config"]["tie_word_embeddings"] = top, text
    (folder / "theirs").mkdir()
    (folder / "theirs" / "config.json").write_text(json.dumps(raw))
    model = transformers.LlavaForConditionalGeneration(
        transformers.AutoConfig.from_pretrained(folder / "theirs"))
    torch.manual_seed(3)
    with torch.no_grad():  # trained: a separate head now differs from the embeddings
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    model.save_pretrained(folder / "theirs")
    transformers.AutoProcessor.from_pretrained(folder / "export").save_pretrained(
        folder / "theirs")
    return transformers.LlavaForConditionalGeneration.from_pretrained(folder / "theirs").eval()


def assert_reads_as_transformers(read, hf, folder, prompts=PROMPTS, count=3):
    """Token ids equal to transformers' processor's (PIL backend), logits within 1e-4 on every
    real token, for prompts with one, two and no images."""
    pictures = photos(count)
    per_prompt, taken = [], 0
    for prompt in prompts:
        per_prompt.append(pictures[taken:taken + prompt.count("<image>")])
        taken += prompt.count("<image>")
    batch = read.prepare(prompts, per_prompt)
    encoded = pil_processor(folder)(text=prompts, images=pictures[:taken], return_tensors="pt",
                                    padding=True)
    with torch.no_grad():
        ours, theirs = read.run(batch).logits, hf(**encoded).logits
    for row in range(len(prompts)):
        mine, real = encoded["attention_mask"][row].bool(), batch.attention_mask[row].bool()
        assert encoded["input_ids"][row][mine].tolist() == batch.input_ids[row][real].tolist()
        torch.testing.assert_close(ours[row][real], theirs[row][mine], rtol=0, atol=LOGITS_ATOL)


def is_tied(llm) -> bool:
    return llm.get_output_embeddings().weight is llm.get_input_embeddings().weight


@pytest.mark.filterwarnings("ignore:The tied weights mapping")
@pytest.mark.parametrize(("top", "text"), [(False, False), (False, True), (True, False),
                                           (True, True)])
def test_a_llava_folder_transformers_wrote_reads_back_with_its_logits(
        tmp_path, kind_and_tokenizer, top, text):  # noqa: F811 (the imported fixture)
    """It failed with "multimodal_config.json does not exist". LLaVA ties by either flag
    (its config copies the text config's up); a separate head is kept, trained."""
    kind, tokenizer = kind_and_tokenizer
    hf = their_llava(llava_mm(tokenizer, kind), tmp_path, top, text)
    assert is_tied(hf) == (top or text)
    read = MultimodalLM.from_pretrained(tmp_path / "theirs")
    assert is_tied(read.llm) == is_tied(hf) and not read.training
    if not is_tied(hf):
        torch.testing.assert_close(read.llm.get_output_embeddings().weight,
                                   hf.get_output_embeddings().weight, rtol=0, atol=0)
    assert_reads_as_transformers(read, hf, tmp_path / "theirs")


@pytest.mark.parametrize(("feature_layer", "keep_prefix"), [([-2, -3], False), (-1, True)])
def test_feature_layer_lists_and_full_selection_read_back(tmp_path, tokenizer, feature_layer,
                                                          keep_prefix):
    """`vision_feature_layer` a list (the layers concatenated on channels, the projector as
    wide) and the "full" selection (the class token kept)."""
    mm = llava_mm(tokenizer, feature_layer=feature_layer, keep_prefix=keep_prefix)
    hf = their_llava(mm, tmp_path, False, False)
    read = MultimodalLM.from_pretrained(tmp_path / "theirs")
    assert read.tower.feature_layer == feature_layer and read.tower.keep_prefix == keep_prefix
    assert_reads_as_transformers(read, hf, tmp_path / "theirs")


def test_our_export_reads_back_with_our_logits_and_processor(tmp_path, tokenizer):
    """mean = std = 0.5 (not CLIP's): transformers 5 saves the image processor inside
    processor_config.json, which the NeXT reader did not look in (it fell back to CLIP's)."""
    processor = ImageProcessor(size=32, mean=(0.5,) * 3, std=(0.5,) * 3, crop_rounding="floor")
    mm = llava_mm(tokenizer, processor=processor)
    read = MultimodalLM.from_pretrained(export_llava(mm, tmp_path / "export"))
    assert (read.processor.mean, read.processor.std) == (mm.processor.mean, mm.processor.std)
    assert read.processor.size == mm.processor.size
    pictures = photos(3)
    per_prompt = [pictures[:1], pictures[1:], []]
    ours_batch, read_batch = mm.prepare(PROMPTS, per_prompt), read.prepare(PROMPTS, per_prompt)
    with torch.no_grad():
        ours, theirs = mm.run(ours_batch).logits, read.run(read_batch).logits
    for row in range(len(PROMPTS)):  # the export pads with unk; mm has no pad token
        mine, real = ours_batch.attention_mask[row].bool(), read_batch.attention_mask[row].bool()
        assert ours_batch.input_ids[row][mine].tolist() == read_batch.input_ids[row][real].tolist()
        torch.testing.assert_close(theirs[row][real], ours[row][mine], rtol=0, atol=LOGITS_ATOL)


def test_the_next_reader_reads_the_image_processor_from_processor_config(tmp_path, tokenizer):
    from test_llava_next_export import TILINGS
    from test_llm_anyres import tiled_mm

    mm = tiled_mm(tokenizer, TILINGS["next"])
    mm.processor = ImageProcessor(size=32, mean=(0.5,) * 3, std=(0.5,) * 3,
                                  tiling=TILINGS["next"])
    mm.tower.processor = mm.processor
    read = MultimodalLM.from_pretrained(export_llava(mm, tmp_path / "next"))
    assert (read.processor.mean, read.processor.std) == ((0.5,) * 3, (0.5,) * 3)


def test_llava_hf_hub_key_names_read_back(tmp_path, tokenizer):
    """llava-hf's checkpoints name the tower `vision_tower.vision_model.*` (transformers'
    saves drop `vision_model.`): transformers maps both, so do we."""
    hf = their_llava(llava_mm(tokenizer), tmp_path, False, False)
    weights = tmp_path / "theirs" / "model.safetensors"
    tensors = load_file(weights)
    renamed = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): tensor
               for name, tensor in tensors.items()}
    assert renamed != tensors
    save_file(renamed, weights, metadata={"format": "pt"})
    assert_reads_as_transformers(MultimodalLM.from_pretrained(tmp_path / "theirs"), hf,
                                 tmp_path / "theirs")


@pytest.mark.filterwarnings("ignore:The tied weights mapping")
def test_two_different_matrices_on_disk_stay_apart(tmp_path, tokenizer):
    """A config saying tied over a folder holding a head unlike the embeddings: transformers
    keeps them apart (and warns); so do we."""
    their_llava(llava_mm(tokenizer), tmp_path, False, False)
    config = tmp_path / "theirs" / "config.json"
    raw = json.loads(config.read_text())
    raw["tie_word_embeddings"] = raw["text_config"]["tie_word_embeddings"] = True
    config.write_text(json.dumps(raw))
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "theirs").eval()
    assert not is_tied(hf)
    read = MultimodalLM.from_pretrained(tmp_path / "theirs")
    assert not is_tied(read.llm)
    assert_reads_as_transformers(read, hf, tmp_path / "theirs")


@pytest.fixture
def llava_folder(tmp_path, tokenizer, monkeypatch):
    """Transformers' own LLaVA folder (head tied); reading its weights fails the test, so a
    check that passes them has run before any weight is read."""
    their_llava(llava_mm(tokenizer), tmp_path, True, True)

    def refuse(*args, **kwargs):
        pytest.fail("the weights were read before the folder was checked")

    monkeypatch.setattr(transformers.LlavaForConditionalGeneration, "from_pretrained", refuse)
    return tmp_path / "theirs"


def _edit(path, change):
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def change(raw):
        for key in keys[:-1]:
            raw = raw[key]
        raw[keys[-1]] = value
    return change


def _untie(raw):
    raw["tie_word_embeddings"] = raw["text_config"]["tie_word_embeddings"] = False


@pytest.mark.parametrize(("file", "change", "message"), [
    ("config.json", _set("vision_config", "model_type", "siglip_vision_model"),
     "vision_config model_type 'siglip_vision_model': vlm-vit reads LLaVA's CLIP vision tower"),
    ("config.json", _set("projector_hidden_act", "relu"), "projector_hidden_act 'relu'"),
    ("config.json", _set("multimodal_projector_bias", False), "multimodal_projector_bias False"),
    ("config.json", _set("vision_feature_select_strategy", "x" * 10_000),
     "vision_feature_select_strategy 'xxxxx"),
    ("config.json", _set("vision_feature_layer", [True]), "vision_feature_layer [True] is not"),
    ("config.json", _set("vision_feature_layer", [-2] * 100_000), "vision_feature_layer [-2, "),
    ("config.json", _set("vision_feature_layer", 9),
     "vision_feature_layer 9: the vision tower has 3 layers"),
    ("config.json", _set("image_token_index", 5), "image_token_index 5, but the tokenizer gives"),
    ("config.json", _set("text_config", "hidden_size", 48),
     "multi_modal_projector.linear_1.weight is [64, 32] on disk, but the config needs [48, 32]"),
    ("config.json", _set("vision_config", "hidden_size", 48),
     "multi_modal_projector.linear_1.weight is [64, 32] on disk, but the config needs [64, 48]"),
    ("config.json", _set("text_config", "model_type", "t5"),
     "text_config model_type 't5' has no causal LM in transformers"),
    ("config.json", _untie, "tie_word_embeddings is off (top level False, text_config False) "
                            "but the weights hold no lm_head.weight"),
    ("processor_config.json", _set("image_processor", "do_pad", True), "do_pad true"),
    ("processor_config.json", _set("image_processor", "crop_size", {"height": 48, "width": 48}),
     "the image processor ends at (48, 48), but the vision tower takes 32 x 32"),
    ("processor_config.json", lambda raw: raw.pop("image_processor"), "no image processor"),
])
def test_what_we_cannot_represent_is_one_line_before_any_weight_is_read(llava_folder, file,
                                                                        change, message):
    _edit(llava_folder / file, change)
    with pytest.raises(ValueError) as caught:
        MultimodalLM.from_pretrained(llava_folder)
    line = str(caught.value)
    assert line.startswith(f"{llava_folder}") and message in line, line
    assert "\n" not in line and len(line) < MAX_LINE, len(line)


@pytest.mark.parametrize("model_type", ["blip-2", "llama", "x" * 10_000])
def test_a_folder_of_another_model_type_is_one_line(llava_folder, model_type):
    config = llava_folder / "config.json"
    _edit(config, _set("model_type", model_type))
    with pytest.raises(ValueError) as caught:
        MultimodalLM.from_pretrained(llava_folder)
    line = str(caught.value)
    assert line.startswith(f"{config}: model_type ") and ("not a multimodal model vlm-vit-llm "
                                                          "reads (llava, llava_next, "
                                                          "llava_onevision, qwen2_vl, "
                                                          "qwen2_5_vl, qwen3_vl)") in line, line
    assert "\n" not in line and len(line) < MAX_LINE, len(line)


def test_a_llava_folder_reads_by_its_hub_name_from_the_cache(tmp_path, tokenizer, monkeypatch):
    from vlm_vit.testing import offline_hub_cache, put_in_hub_cache

    hf = their_llava(llava_mm(tokenizer), tmp_path, False, True)
    cache = offline_hub_cache(tmp_path / "hf_home", monkeypatch)
    put_in_hub_cache(cache, "llava-hf/tiny-llava", tmp_path / "theirs")
    read = MultimodalLM.from_pretrained("llava-hf/tiny-llava")
    assert_reads_as_transformers(read, hf, tmp_path / "theirs")


def test_a_shard_index_naming_a_file_outside_the_folder_is_refused(llava_folder, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    save_file({"x": torch.zeros(1)}, outside)
    index = llava_folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}))
    with pytest.raises(ValueError, match=r"weights file '../elsewhere.safetensors' is not a "
                                         r"file inside the folder"):
        MultimodalLM.from_pretrained(llava_folder)


@pytest.mark.filterwarnings("ignore:The tied weights mapping")
def test_a_llava_folder_continues_in_stage_2_packed_then_writes_back(tmp_path, tokenizer,
                                                                     capsys):
    """`llm train THEIR_FOLDER --stage 2 --packing`, `llm merge`, `llm export`: transformers
    loads what comes back strictly and greedily generates our tokens."""
    from test_llm_train import write_captions

    from vlm_vit.cli import main

    their_llava(llava_mm(tokenizer), tmp_path, False, False)
    write_captions(tmp_path / "data")
    assert main(["llm", "train", str(tmp_path / "theirs"), "--stage", "2", "--lora-r", "4",
                 "--packing", "--data", str(tmp_path / "data"), "--captions",
                 str(tmp_path / "data" / "captions.jsonl"), "--steps", "2", "--batch-size",
                 "2", "--num-workers", "0", "--device", "cpu", "--quiet", "--out",
                 str(tmp_path / "s2")]) == 0
    assert "trained stage 2 for 2 steps" in capsys.readouterr().out
    assert main(["llm", "merge", str(tmp_path / "s2" / "model"), "--out",
                 str(tmp_path / "merged")]) == 0
    assert main(["llm", "export", str(tmp_path / "merged"), "--out", str(tmp_path / "back")]) == 0
    hf, info = transformers.LlavaForConditionalGeneration.from_pretrained(
        tmp_path / "back", output_loading_info=True)
    assert not any(info.values()), info
    ours = MultimodalLM.from_pretrained(tmp_path / "merged").eval()
    prompt, picture = "<image>\nwhat is in the image", photos(1)
    encoded = pil_processor(tmp_path / "back")(text=[prompt], images=picture,
                                               return_tensors="pt")
    with torch.no_grad():
        theirs = hf.eval().generate(**encoded, max_new_tokens=5, do_sample=False)
    new = theirs[0, encoded["input_ids"].shape[1]:]
    assert len(new) == 5  # no early end: five tokens to agree on
    assert ours.generate([prompt], [picture], max_new_tokens=5, do_sample=False) == [
        ours.tokenizer.decode(new, skip_special_tokens=True)]
