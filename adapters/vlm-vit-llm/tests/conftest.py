"""Tiny models for the LLM bridge's tests: a CLIP-shaped tower, a random Llama, and a
SentencePiece tokenizer trained here on a small text. Everything is offline."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from vlm_vit import EncoderConfig, VisionEncoder, VisionTower, build_pooler  # noqa: E402

CAPTIONS = ["a red square", "two blue dogs", "the green tree", "one yellow star"]
CORPUS = CAPTIONS + [
    "describe the picture", "what is in the image", "a photo of a cat on a mat",
    "the dog runs in the park", "a small house by the sea", "three birds fly over a lake",
    "an old man reads a book", "the sun sets behind the hills", "a child plays with a ball",
]
LLM_WIDTH = 64
IMAGE_SIZE = 32


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A SentencePiece BPE model trained on `CORPUS`, as a Llama tokenizer folder."""
    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("tokenizer")
    text = folder / "corpus.txt"
    text.write_text("\n".join(CORPUS * 10) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(folder / "sp"), vocab_size=120, model_type="bpe",
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=1.0, minloglevel=2)
    (folder / "sp.model").rename(folder / "tokenizer.model")
    return folder


@pytest.fixture
def tokenizer(tokenizer_dir):
    from transformers import LlamaTokenizer

    return LlamaTokenizer.from_pretrained(tokenizer_dir)


def tiny_llm(vocab_size: int = 128, seed: int = 0, kind: str = "llama", tied: bool = False):
    """A random two-layer Llama (or Qwen2) of width `LLM_WIDTH`; `tied`: its head is its
    embedding matrix (`tie_word_embeddings`, as Qwen2-0.5B, Gemma and small Llamas)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    torch.manual_seed(seed)
    config = config_class(vocab_size=vocab_size, hidden_size=LLM_WIDTH, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                          tie_word_embeddings=tied, initializer_range=0.5)
    return model_class(config).eval()


def assert_export_matches(mm, folder: Path, prompts, per_prompt, images):
    """The `LlavaForConditionalGeneration` in `folder` gives `mm`'s logits on the real tokens
    (1e-4, plus 1e-5 of the largest logit: a LoRA merged into float32 weights rounds apart
    from one run beside them, 1.7e-4 on logits of 16 with peft 0.21.2); returns it."""
    from transformers import LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(folder).eval()
    batch = mm.prepare(prompts, per_prompt)
    pixel_values = torch.stack([mm.processor.preprocess_one(image) for image in images])
    with torch.no_grad():
        ours = mm(prompts, per_prompt).logits
        theirs = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    pixel_values=pixel_values).logits
    mask = batch.attention_mask.bool()
    scale = float(ours[mask].abs().max())
    torch.testing.assert_close(theirs[mask], ours[mask], rtol=1e-4, atol=1e-4 + 1e-5 * scale)
    return hf


def tiny_tower(seed: int = 0, feature_layer: int | None = -2) -> VisionTower:
    """A CLIP-shaped encoder on 32 x 32 images (16 patches) with an mlp2x_gelu projector."""
    torch.manual_seed(seed)
    config = EncoderConfig(image_size=IMAGE_SIZE, patch_size=8, width=32, depth=3, heads=4,
                           mlp_width=64, pre_norm=True, act="quick_gelu", norm_eps=1e-5,
                           patch_bias=False)
    pooler = build_pooler("mlp2x_gelu", in_dim=32, out_dim=LLM_WIDTH)
    return VisionTower(VisionEncoder(config).eval(), pooler, feature_layer=feature_layer)


@pytest.fixture
def mm(tokenizer):
    from vlm_vit_llm import MultimodalLM

    return MultimodalLM(tiny_tower(), tiny_llm(), tokenizer)


def perturb_lora(mm, hold_key_rows: bool = False) -> None:
    """LoRA starts as a no-op; make every adapter count. With `hold_key_rows`, the key rows
    of a fused qkv's lora_B stay 0, as `attn_qv` requires."""
    with torch.no_grad():
        for name, parameter in mm.named_parameters():
            if "lora_B" in name:
                noise = torch.randn_like(parameter) * 0.05
                if hold_key_rows and ".attn.qkv." in name:
                    width = parameter.shape[0] // 3
                    noise[width:2 * width] = 0
                parameter.add_(noise)


def photos(count: int = 4, size: int = IMAGE_SIZE) -> list[np.ndarray]:
    """Distinct real photos from scikit-image, as uint8 RGB arrays."""
    from skimage import data, transform

    names = ["astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field",
             "immunohistochemistry"]
    out = []
    for name in names[:count]:
        image = transform.resize(getattr(data, name)(), (size, size), anti_aliasing=True)
        out.append((image * 255).round().astype(np.uint8))
    return out


CHAT_CORPUS = CORPUS + [
    "USER: what is in the image ASSISTANT: two blue dogs",
    "A chat between a curious human and an artificial intelligence assistant. The assistant "
    "gives helpful, detailed, and polite answers to the human's questions.",
    "How many dogs are there? There are two. Which colour is the tree? It is green.",
]


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory) -> Path:
    """A SentencePiece BPE Llama tokenizer with byte fallback (every character has tokens,
    as in real LLM tokenizers), trained on `CHAT_CORPUS`."""
    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("chat_tokenizer")
    text = folder / "corpus.txt"
    text.write_text("\n".join(CHAT_CORPUS * 10) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(folder / "sp"), vocab_size=400, model_type="bpe",
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=1.0, byte_fallback=True,
        minloglevel=2)
    (folder / "sp.model").rename(folder / "tokenizer.model")
    return folder


@pytest.fixture
def chat_tokenizer(chat_tokenizer_dir):
    from transformers import LlamaTokenizer

    return LlamaTokenizer.from_pretrained(chat_tokenizer_dir)


CHATML_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def chatml_tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer (built with `tokenizers`, as GPT-2 and Qwen2 are) with a
    Qwen2-style ChatML chat template and its special tokens, saved as a transformers folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CHAT_CORPUS * 10, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:])
    wrapped.chat_template = CHATML_TEMPLATE
    folder = tmp_path_factory.mktemp("chatml_tokenizer")
    wrapped.save_pretrained(folder)
    return folder


@pytest.fixture
def chatml_tokenizer(chatml_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chatml_tokenizer_dir)


@pytest.fixture
def parts(tmp_path, tokenizer):
    """An encoder checkpoint, an LLM folder with its tokenizer, and captioned images: what
    `vlm-vit llm train --tower ... --llm ...` starts from."""
    from test_llm_train import write_captions

    tiny_tower().encoder.save_pretrained(tmp_path / "encoder")
    tiny_llm().save_pretrained(tmp_path / "llm")
    tokenizer.save_pretrained(tmp_path / "llm")
    write_captions(tmp_path / "data")
    return tmp_path
