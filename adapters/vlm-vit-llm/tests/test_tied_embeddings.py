"""LLMs whose output head is their input embedding matrix (`tie_word_embeddings=True`, as
Qwen2-0.5B, Gemma and small Llamas): the bridge, its folders and the LLaVA export keep the
tie, one tensor and not two copies."""

import json

import pytest
import torch
from conftest import CORPUS, assert_export_matches, perturb_lora, photos, tiny_llm, tiny_tower
from safetensors.torch import load_file

from vlm_vit_llm import MultimodalLM, export_llava

PROMPTS = ["<image>\nwhat is in the image", "<image> the dog <image>"]
KINDS = ["llama", "qwen2"]


@pytest.fixture(scope="session")
def qwen2_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer, as Qwen2's. Qwen2 gets its own kind: transformers 5 reads a
    folder whose config says qwen2 with Qwen2's tokenizer class, whatever class was saved."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 10, trainer)
    folder = tmp_path_factory.mktemp("qwen2_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                            pad_token="<|endoftext|>").save_pretrained(folder)
    return folder


@pytest.fixture(params=KINDS)
def kind_and_tokenizer(request, tokenizer):
    """("llama", the conftest's SentencePiece tokenizer) or ("qwen2", a byte-level BPE)."""
    if request.param == "llama":
        return "llama", tokenizer
    from transformers import AutoTokenizer

    return "qwen2", AutoTokenizer.from_pretrained(request.getfixturevalue("qwen2_tokenizer_dir"))


def assert_tied(llm) -> None:
    base = llm.get_base_model() if hasattr(llm, "peft_config") else llm
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight


def tied_mm(kind, tokenizer, lora: bool = False) -> MultimodalLM:
    """The vocabulary is the tokenizer's exactly, so adding the image token resizes it."""
    mm = MultimodalLM(tiny_tower(), tiny_llm(len(tokenizer), kind=kind, tied=True), tokenizer)
    if lora:
        mm.add_lora(r=4, encoder_targets="attn")
        perturb_lora(mm)
    return mm.eval()


def inputs(mm):
    images = photos(3)
    return [[images[0]], [images[1], images[2]]], images


def test_the_image_token_resize_keeps_the_tie(kind_and_tokenizer):
    kind, tokenizer = kind_and_tokenizer
    rows = len(tokenizer)
    mm = tied_mm(kind, tokenizer)
    assert mm.llm.get_input_embeddings().num_embeddings == rows + 1 == len(mm.tokenizer)
    assert_tied(mm.llm)
    per_prompt, _ = inputs(mm)
    with torch.no_grad():
        out = mm(PROMPTS, per_prompt, targets=["a red square", "two blue dogs"])
    assert out.logits.shape[-1] == rows + 1 and torch.isfinite(out.loss)


@pytest.mark.parametrize("lora", [False, True])
def test_a_saved_tied_model_loads_tied_with_the_same_logits(tmp_path, kind_and_tokenizer, lora):
    kind, tokenizer = kind_and_tokenizer
    mm = tied_mm(kind, tokenizer, lora)
    mm.save_pretrained(tmp_path / "mm")
    # `save_pretrained(state_dict=base_state(...))` writes the shared matrix once.
    written = load_file(tmp_path / "mm" / "llm" / "model.safetensors")
    assert [name for name in written if "embed_tokens" in name or "lm_head" in name] == \
        ["model.embed_tokens.weight"]
    loaded = MultimodalLM.from_pretrained(tmp_path / "mm").eval()
    assert_tied(loaded.llm)
    assert hasattr(loaded.llm, "peft_config") == lora
    per_prompt, _ = inputs(mm)
    with torch.no_grad():
        torch.testing.assert_close(loaded(PROMPTS, per_prompt).logits,
                                   mm(PROMPTS, per_prompt).logits, rtol=0, atol=0)


def test_merging_lora_keeps_the_tie(kind_and_tokenizer):
    kind, tokenizer = kind_and_tokenizer
    mm = tied_mm(kind, tokenizer, lora=True)
    merged = mm.merged()
    assert_tied(merged.llm)
    per_prompt, _ = inputs(mm)
    with torch.no_grad():
        torch.testing.assert_close(merged(PROMPTS, per_prompt).logits,
                                   mm(PROMPTS, per_prompt).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lora", [False, True])
def test_the_llava_export_of_a_tied_llm_is_tied_and_gives_our_logits(tmp_path,
                                                                      kind_and_tokenizer, lora):
    kind, tokenizer = kind_and_tokenizer
    mm = tied_mm(kind, tokenizer, lora)
    export_llava(mm, tmp_path / "llava")
    assert_tied(mm.llm)  # ours untouched

    written = load_file(tmp_path / "llava" / "model.safetensors")
    shared = [name for name in written if "embed_tokens" in name or "lm_head" in name]
    assert len(shared) == 1, shared  # one matrix on disk, not two copies
    per_prompt, images = inputs(mm)
    hf = assert_export_matches(mm, tmp_path / "llava", PROMPTS, per_prompt, images)
    assert hf.config.tie_word_embeddings
    assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_lora_that_unties_the_head_is_refused(tmp_path, tokenizer):
    """LoRA on the embeddings alone would leave the tied head behind: LLaVA's layout holds one
    matrix for both, so the export refuses instead of dropping one side's update."""
    mm = MultimodalLM(tiny_tower(), tiny_llm(len(tokenizer), tied=True), tokenizer)
    mm.add_lora(r=4, llm_targets=["embed_tokens"])
    with torch.no_grad():  # peft starts an embedding's LoRA with lora_embedding_A at zero
        for name, parameter in mm.named_parameters():
            if "lora_embedding_A" in name:
                parameter.normal_(0, 0.05)
    with pytest.raises(ValueError, match="ties 'lm_head.weight' to 'model.embed_tokens.weight'"):
        export_llava(mm, tmp_path / "llava")
    assert not (tmp_path / "llava").exists()


# ---- a LLaVA-NeXT / OneVision folder transformers wrote (issue 40) -------------------------

def their_folder(tokenizer, folder, family: str, top: bool, text: bool, kind="llama"):
    """`save_pretrained` of transformers' own tiny random LLaVA-NeXT (or OneVision) whose
    config says `tie_word_embeddings` `top` at the top level and `text` in its text config,
    with our export's processor; returns (the model transformers reads back, its class)."""
    from test_llava_next_export import TILINGS
    from test_llm_anyres import tiled_mm
    from transformers import AutoConfig, AutoProcessor

    from vlm_vit_llm.llava_next import model_class

    mm = tiled_mm(tokenizer, TILINGS[family], kind)
    export_llava(mm, folder / "export")
    raw = json.loads((folder / "export" / "config.json").read_text())
    raw["tie_word_embeddings"], raw["text_config"]["tie_word_embeddings"] = top, text
    (folder / "theirs").mkdir()
    (folder / "theirs" / "config.json").write_text(json.dumps(raw))
    their_class = model_class(mm.tower.tiling)
    model = their_class(AutoConfig.from_pretrained(folder / "theirs"))
    torch.manual_seed(3)
    with torch.no_grad():  # trained: a separate head now differs from the embeddings
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    model.save_pretrained(folder / "theirs")
    AutoProcessor.from_pretrained(folder / "export").save_pretrained(folder / "theirs")
    return their_class.from_pretrained(folder / "theirs").eval()


@pytest.mark.filterwarnings("ignore:The tied weights mapping")
@pytest.mark.parametrize("family", ["next", "onevision"])
@pytest.mark.parametrize(("top", "text"), [(False, False), (False, True), (True, False),
                                           (True, True)])
def test_a_llava_next_folder_ties_its_head_as_transformers_does(tmp_path, kind_and_tokenizer,
                                                                family, top, text):
    """LLaVA-NeXT ties by the top-level flag alone; OneVision (and LLaVA-1.5) also by the
    text config's: a NeXT folder saying (False, True) holds a trained separate head, which
    `from_pretrained` tied to the embeddings (every logit about 20 off on this model; issue
    44 reported it for Qwen2)."""
    from test_llava_next_export import pil_processor
    from test_llm_anyres import LOGITS_ATOL, image

    kind, tokenizer = kind_and_tokenizer
    hf = their_folder(tokenizer, tmp_path, family, top, text, kind)
    theirs_tied = hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    assert theirs_tied == (top or (text and family == "onevision"))
    read = MultimodalLM.from_pretrained(tmp_path / "theirs")
    if theirs_tied:
        assert_tied(read.llm)
    else:
        assert not torch.equal(read.llm.get_output_embeddings().weight,
                               read.llm.get_input_embeddings().weight)
    prompts = ["<image>\nwhat is in the image", "the dog runs in the park"]
    pictures = [image(90, 120)]
    batch = read.prepare(prompts, [pictures, []])
    encoded = pil_processor(tmp_path / "theirs")(text=prompts, images=pictures,
                                                 return_tensors="pt", padding=True)
    with torch.no_grad():
        ours, theirs = read.run(batch).logits, hf(**encoded).logits
    for row in range(2):
        mine, real = encoded["attention_mask"][row].bool(), batch.attention_mask[row].bool()
        assert encoded["input_ids"][row][mine].tolist() == batch.input_ids[row][real].tolist()
        torch.testing.assert_close(ours[row][real], theirs[row][mine], rtol=0,
                                   atol=LOGITS_ATOL)


def test_an_untied_llava_next_folder_without_its_head_is_refused(tmp_path, tokenizer):
    """A tied model's folder (the embeddings alone on disk) whose config is then set untied:
    transformers would start the head at random; the read refuses, naming the file."""
    their_folder(tokenizer, tmp_path, "next", True, True)
    config = tmp_path / "theirs" / "config.json"
    raw = json.loads(config.read_text())
    raw["tie_word_embeddings"], raw["text_config"]["tie_word_embeddings"] = False, False
    config.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"config.json: tie_word_embeddings is off .* no "
                                         r"lm_head.weight"):
        MultimodalLM.from_pretrained(tmp_path / "theirs")
