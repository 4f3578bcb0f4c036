"""LLaVA stage 1 end to end, offline: caption four photos with a projector-only run, then
export to transformers' LlavaForConditionalGeneration. Needs `adapters/vlm-vit-llm`.

    python examples/llava_stage1.py                          # a tiny random Llama, ~1 minute
    python examples/llava_stage1.py --llm path/to/llm       # any causal LM folder you have

Without `--llm` the language model is a small random Llama whose tokenizer is trained here on
the captions, so the only thing that can tell the captions apart is the image.
"""

import argparse
import atexit
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import vlm_vit
from vlm_vit.train import TrainConfig, Trainer

TOLERANCE = 1e-4  # the export's logits against our model's
CAPTIONS = {"astronaut": "a woman in a space suit", "coffee": "a cup of coffee",
            "chelsea": "a cat with green eyes", "rocket": "a rocket on the launch pad"}


def write_photos(folder: Path, size: int) -> Path:
    """scikit-image's photos with captions, as a captions folder (JSON lines)."""
    from skimage import data

    lines = []
    for name, caption in CAPTIONS.items():
        Image.fromarray(getattr(data, name)()).convert("RGB").resize((size, size)).save(
            folder / f"{name}.png")
        lines.append(json.dumps({"image": f"{name}.png", "caption": caption}))
    (folder / "captions.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "captions.jsonl"


def tiny_llm(folder: Path, width: int):
    """A random 2-layer Llama and a SentencePiece tokenizer trained on the captions."""
    import sentencepiece as spm
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer

    (folder / "text.txt").write_text("\n".join(list(CAPTIONS.values()) * 20) + "\n")
    spm.SentencePieceTrainer.train(input=str(folder / "text.txt"), model_prefix=str(folder / "sp"),
                                   vocab_size=60, model_type="bpe", unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, minloglevel=2)
    (folder / "sp.model").rename(folder / "tokenizer.model")
    # A wide initialisation lets a random LM's logits be sharp, as a trained LM's are.
    config = LlamaConfig(vocab_size=64, hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         initializer_range=0.5, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config), LlamaTokenizer.from_pretrained(folder)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llm", type=Path, help="a Hugging Face causal LM folder")
    parser.add_argument("--work", type=Path, help="keep the data, runs and export here "
                        "(default: a temporary folder, removed at the end)")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlavaForConditionalGeneration
    from vlm_vit_llm import MultimodalLM, export_llava
    from vlm_vit_llm.train import CaptionCollate, CaptionFolder, CaptionObjective

    torch.manual_seed(0)
    work = args.work or Path(tempfile.mkdtemp(prefix="llava-stage1-"))
    if args.work is None:
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    else:
        work.mkdir(parents=True, exist_ok=True)
    write_photos(work, args.image_size)
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
    mm = MultimodalLM(tower, llm, tokenizer).train_projector_only()

    dataset = CaptionFolder(work, work / "captions.jsonl", mm.processor)
    train = TrainConfig(steps=args.steps, batch_size=4, lr=args.lr, warmup_steps=10,
                        weight_decay=0.0, num_workers=0, checkpoint_every=0, device="cpu")
    Trainer(CaptionObjective(mm), dataset, train, work / "run",
            collate=CaptionCollate(mm), progress=False).fit()

    mm.eval()
    images = [[work / f"{name}.png"] for name in CAPTIONS]
    said_all = mm.generate(["<image>\n"] * 4, images, do_sample=False)
    for (name, caption), said in zip(CAPTIONS.items(), said_all, strict=True):
        print(f"{name:<10} -> {said!r} (trained on {caption!r})")

    export_llava(mm, work / "llava")
    hf = LlavaForConditionalGeneration.from_pretrained(work / "llava").eval()
    batch = mm.prepare(["<image>\n"], images[:1])
    pixels = mm.processor([work / "astronaut.png"])
    with torch.no_grad():
        theirs = hf(input_ids=batch.input_ids, pixel_values=pixels).logits
        ours = mm(["<image>\n"], images[:1]).logits
    difference = float(np.abs((ours - theirs).numpy()).max())
    kept = f" in {work / 'llava'}" if args.work else " (removed at the end; --work keeps it)"
    print(f"LLaVA export{kept}: max |ours - transformers| logits = "
          f"{difference:.1e}")
    if not difference <= TOLERANCE:
        print(f"the export differs from our model by more than {TOLERANCE}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
