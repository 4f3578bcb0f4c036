"""LLaVA's two stages on LLaVA-format conversation data, offline: a few records built from
scikit-image photos (multi-turn, one with two images, one text-only), stage 1 (projector
only, the `plain` template) and stage 2 (LoRA on the LLM, the `vicuna_v1` chat template),
chat generation, and export to transformers. Needs `adapters/vlm-vit-llm`. The tiny model
learns the five records by heart: the point is the pipeline, not what it says.

    python examples/llava_instruct.py                        # a tiny random Llama, ~1 minute
    python examples/llava_instruct.py --llm path/to/llm     # any causal LM folder you have

The records are written as LLaVA-Instruct's JSON: `{"id", "image": path | [paths] | absent,
"conversations": [{"from": "human" | "gpt", "value": ...}, ...]}`.
"""

import argparse
import atexit
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from PIL import Image

import vlm_vit
from vlm_vit.train import TrainConfig, Trainer

PHOTOS = ["astronaut", "coffee", "chelsea", "rocket"]
RECORDS = [
    {"id": "astronaut", "image": "astronaut.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is in the picture?"},
        {"from": "gpt", "value": "a woman in a space suit"},
        {"from": "human", "value": "Where is she?"},
        {"from": "gpt", "value": "in front of a flag"}]},
    {"id": "coffee", "image": "coffee.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is in the picture?"},
        {"from": "gpt", "value": "a cup of coffee"}]},
    {"id": "pair", "image": ["chelsea.png", "rocket.png"], "conversations": [
        {"from": "human", "value": "<image> and <image>: which one flies?"},
        {"from": "gpt", "value": "the rocket, not the cat"}]},
    {"id": "rocket", "image": "rocket.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is in the picture?"},
        {"from": "gpt", "value": "a rocket on the launch pad"}]},
    {"id": "text-only", "conversations": [
        {"from": "human", "value": "What colour is the sky?"},
        {"from": "gpt", "value": "blue on a clear day"}]},
]
TOLERANCE = 1e-4  # the export's logits against our merged model's


def write_data(folder: Path, size: int) -> Path:
    from skimage import data

    for name in PHOTOS:
        Image.fromarray(getattr(data, name)()).convert("RGB").resize((size, size)).save(
            folder / f"{name}.png")
    path = folder / "instruct.json"
    path.write_text(json.dumps(RECORDS, indent=1))
    return path


def tiny_llm(folder: Path, width: int):
    """A random 2-layer Llama and a SentencePiece tokenizer trained on the conversations."""
    import sentencepiece as spm
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer
    from vlm_vit_llm.chat import VICUNA_SYSTEM

    text = [turn["value"] for record in RECORDS for turn in record["conversations"]]
    (folder / "text.txt").write_text("\n".join((text + [VICUNA_SYSTEM, "USER: ASSISTANT:"])
                                               * 20) + "\n")
    spm.SentencePieceTrainer.train(input=str(folder / "text.txt"), model_prefix=str(folder / "sp"),
                                   vocab_size=300, model_type="bpe", unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, byte_fallback=True, minloglevel=2)
    (folder / "sp.model").rename(folder / "tokenizer.model")
    config = LlamaConfig(vocab_size=320, hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         initializer_range=0.5, bos_token_id=1, eos_token_id=2,
                         max_position_embeddings=512)
    return LlamaForCausalLM(config), LlamaTokenizer.from_pretrained(folder)


def train(mm, records, template: str, run_dir: Path, steps: int, lr: float) -> list[float]:
    from vlm_vit_llm.chat import adopt_chat_template
    from vlm_vit_llm.train import ConversationCollate, ConversationDataset, ConversationObjective

    adopt_chat_template(mm.tokenizer, template)
    dataset = ConversationDataset(records, mm.processor, mm.tower.num_image_tokens())
    config = TrainConfig(steps=steps, batch_size=5, lr=lr, warmup_steps=5, weight_decay=0.0,
                         num_workers=0, checkpoint_every=0, device="cpu")
    result = Trainer(ConversationObjective(mm), dataset, config, run_dir,
                     collate=ConversationCollate(mm), progress=False).fit()
    return result.losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llm", type=Path, help="a Hugging Face causal LM folder")
    parser.add_argument("--work", type=Path, help="keep the data, runs and export here "
                        "(default: a temporary folder, removed at the end)")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--stage-1-steps", type=int, default=100)
    parser.add_argument("--stage-2-steps", type=int, default=200)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlavaForConditionalGeneration
    from vlm_vit_llm import MultimodalLM, export_llava
    from vlm_vit_llm.chat import chat_prompt, chat_template
    from vlm_vit_llm.records import ConversationRecords, Turn

    torch.manual_seed(0)
    work = args.work or Path(tempfile.mkdtemp(prefix="llava-instruct-"))
    if args.work is None:
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    else:
        work.mkdir(parents=True, exist_ok=True)
    records = ConversationRecords(write_data(work, args.image_size), work)
    if args.llm:
        llm, tokenizer = (AutoModelForCausalLM.from_pretrained(args.llm),
                          AutoTokenizer.from_pretrained(args.llm))
    else:
        llm, tokenizer = tiny_llm(work, width=64)
    config = vlm_vit.EncoderConfig.from_name(
        "clip-vit-b/16", image_size=args.image_size, width=64, depth=3, heads=4, mlp_width=128)
    projector = vlm_vit.build_pooler("mlp2x_gelu", in_dim=64,
                                     out_dim=llm.get_input_embeddings().embedding_dim)
    tower = vlm_vit.VisionTower(vlm_vit.VisionEncoder(config), projector, feature_layer=-2)
    processor = vlm_vit.ImageProcessor.for_family("clip", size=args.image_size,
                                                  crop_rounding="floor")
    mm = MultimodalLM(tower, llm, tokenizer, processor=processor)

    losses = train(mm.train_projector_only(), records, "plain", work / "stage1",
                   args.stage_1_steps, lr=1e-2)
    print(f"stage 1 (projector, plain): loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    losses = train(mm.add_lora(r=16, alpha=32), records, "vicuna_v1", work / "stage2",
                   args.stage_2_steps, lr=1e-2)
    print(f"stage 2 (LoRA + projector, vicuna_v1): loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    mm.eval()
    template = chat_template(mm.tokenizer)
    for index in range(len(records)):
        record = records[index]
        prompt = chat_prompt(mm.tokenizer, record.turns[:1], template)
        said = mm.generate([prompt], [record.images], do_sample=False, max_new_tokens=32)[0]
        print(f"{record.turns[0].text!r:<45} -> {said!r}")

    export_llava(mm, work / "llava")
    hf = LlavaForConditionalGeneration.from_pretrained(work / "llava").eval()
    first = records[2]  # the two-image record
    prompt = chat_prompt(mm.tokenizer, [Turn("user", first.turns[0].text)], template)
    batch = mm.prepare([prompt], [first.images])
    pixels = mm.processor(first.images)
    with torch.no_grad():
        theirs = hf(input_ids=batch.input_ids, pixel_values=pixels).logits
        ours = mm([prompt], [first.images]).logits
        # The export holds W + BA, summed once: the same floats as peft's merge of our model.
        merged = mm.merged()([prompt], [first.images]).logits
    difference = (merged - theirs).abs().max().item()
    kept = f" in {work / 'llava'}" if args.work else " (removed at the end; --work keeps it)"
    print(f"LLaVA export{kept}: max |ours - transformers| logits = "
          f"{difference:.1e} (our model with LoRA merged); merging LoRA itself moves them by "
          f"{(merged - ours).abs().max().item():.1e} (float32 rounding, logits up to "
          f"{ours.abs().max().item():.0f})")
    if not difference <= TOLERANCE:
        print(f"the export differs from our model by more than {TOLERANCE}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
