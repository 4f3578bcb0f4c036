"""A stage-2 step on a Qwen2.5-VL-shaped model: ours on packed rows (M-RoPE ids restarting
per record) against transformers' `Qwen2_5_VLForConditionalGeneration` on padded batches,
supervised tokens per second and peak memory.

    python benchmarks/qwen_vl_packed_step.py            # real layer counts, narrow widths
    python benchmarks/qwen_vl_packed_step.py --quick    # fewer layers and records

The model is built at random by transformers with Qwen2.5-VL-7B's layer counts (a 32-block
windowed vision tower with full attention in blocks 7, 15, 23 and 31, a 2x2 merger, a
28-layer GQA language model) at narrow widths, saved, and read by both sides: ours through
`MultimodalLM.from_pretrained` (the reader of issue 44), transformers' by its own class.
Both train stage 2 the same way: LoRA (r 16) on the language model's q, k, v and o
projections and the merger fully, everything else frozen.

Arms, on the same records and weights, one AdamW step per batch:

- `packed`: ours, each batch's records packed into rows of at most `--max-length` tokens
  (`[4, R, L]` position ids: text positions, then each record's own 3-D ids; the varlen
  SDPA path on this sdpa LLM).
- `padded`: ours, the same batches, one record per row padded to the longest.
- `hf_padded`: transformers, the same padded batches: our `prepare`'s input ids, mask and
  labels, its processor's pixel values and `image_grid_thw` for the same images (so
  `get_rope_index` runs inside, as in training with transformers).

The records are `llava_packed_step.records` (LLaVA-Instruct-shaped, lengths scaled by 1/4);
each image has its own size (sides 112 to 336 pixels in steps of 28, seeded), so an image
takes 16 to 144 tokens as at Qwen's native resolution. Timing alternates the arms in one
process after a warm-up (medians); peak memory is a pass's, in a child process per arm.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from llava_packed_step import records  # noqa: E402
from timing import (  # noqa: E402
    alternate,
    flush_denormals,
    peak_memory_in_child,
    peak_memory_mib,
    write_json,
)

ARMS = ("packed", "padded", "hf_padded")
SPECIAL = ["<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
VOCAB = 32000
SIDES = range(112, 337, 28)  # image sides at patch 14, merge 2
PRESETS = {"full": dict(vision_depth=32, llm_layers=28, batches=3, batch_size=8, repeats=3),
           "quick": dict(vision_depth=8, llm_layers=4, batches=2, batch_size=8, repeats=3)}


def save_model(args: argparse.Namespace, folder: Path) -> None:
    """A Qwen2.5-VL folder at random init: Qwen2.5-VL-7B's layer counts, narrow widths."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(["describe the image", "what is in the picture"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL}
    depth = args.vision_depth
    config = transformers.Qwen2_5_VLConfig(
        vision_config=dict(depth=depth, hidden_size=args.vision_width, num_heads=2,
                           intermediate_size=args.vision_width * 2,
                           out_hidden_size=args.llm_width, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=list(range(depth // 4 - 1, depth, depth // 4))),
        text_config=dict(hidden_size=args.llm_width, intermediate_size=args.llm_width * 3,
                         num_hidden_layers=args.llm_layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096,
                         eos_token_id=0, bos_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [2 * args.llm_width // 64,
                                                            3 * args.llm_width // 64,
                                                            3 * args.llm_width // 64]}),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():  # off the init, so the loss check below is not ln(vocabulary)
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    model.save_pretrained(folder)
    sizes = dict(min_pixels=56 * 56, max_pixels=336 * 336, patch_size=14, merge_size=2,
                 temporal_patch_size=2)
    transformers.Qwen2_5_VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessorPil(**sizes), tokenizer=tokenizer,
        video_processor=transformers.Qwen2VLVideoProcessor(**sizes)).save_pretrained(folder)


def build(folder: Path):
    """(ours, transformers', transformers' processor), both set up for stage 2."""
    import peft
    import transformers
    from vlm_vit_llm import MultimodalLM

    mm = MultimodalLM.from_pretrained(folder)
    mm.add_lora(r=16, alpha=32)  # and the merger (the projector) trains fully
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        folder, attn_implementation="sdpa")
    hf.requires_grad_(False)
    hf.model.language_model = peft.get_peft_model(hf.model.language_model, peft.LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    hf.model.visual.merger.requires_grad_(True)
    processor = transformers.AutoProcessor.from_pretrained(folder)
    processor.image_processor = transformers.AutoImageProcessor.from_pretrained(
        folder, backend="pil")
    return mm.train(), hf.train(), processor


def arm_batches(mm, processor, args: argparse.Namespace):
    """Per arm, its batches over the same records, transformers' inputs, and the
    supervised tokens and record lengths."""
    from PIL import Image
    from vlm_vit_llm.packing import pack_rows
    from vlm_vit_llm.train import ConversationBatch

    count = args.batches * args.batch_size
    image_id = mm.image_token_id
    made = records(count, image_id, VOCAB, max(SIDES) ** 2 // 28 ** 2, args.max_length,
                   seed=args.seed)
    rng = np.random.default_rng(args.seed + 1)
    shift = len(SPECIAL) + 3  # text ids clear of the special tokens
    made = [([i if i == image_id else i + shift if i < shift else i for i in ids], labels, n)
            for ids, labels, n in made]
    pictures = [[Image.fromarray(rng.integers(0, 256, (int(rng.choice(SIDES)),
                                                       int(rng.choice(SIDES)), 3),
                                              dtype=np.uint8)) for _ in range(images)]
                for _, _, images in made]
    pixels = [[mm.processor.preprocess_one(picture) for picture in row] for row in pictures]
    lengths = [mm.prepare([ids], [row]).input_ids.shape[1]
               for (ids, _, _), row in zip(made, pixels, strict=True)]
    plain = [list(range(b * args.batch_size, (b + 1) * args.batch_size))
             for b in range(args.batches)]

    def batch(indices, packed=False):
        rows = pack_rows([lengths[i] for i in indices], args.max_length) if packed else None
        return ConversationBatch([made[i][0] for i in indices], [made[i][1] for i in indices],
                                 [pixels[i] for i in indices], rows=rows)

    hf_inputs = []
    for indices in plain:
        prepared = mm.prepare([made[i][0] for i in indices], [pixels[i] for i in indices],
                              token_labels=[made[i][1] for i in indices])
        images = [picture for i in indices for picture in pictures[i]]
        vision = processor.image_processor(images=images, return_tensors="pt")
        hf_inputs.append(dict(input_ids=prepared.input_ids, labels=prepared.labels,
                              attention_mask=prepared.attention_mask,
                              mm_token_type_ids=(prepared.input_ids == image_id).int(),
                              pixel_values=vision["pixel_values"],
                              image_grid_thw=vision["image_grid_thw"]))
    batches = {"packed": [batch(b, packed=True) for b in plain],
               "padded": [batch(b) for b in plain]}
    supervised = sum(sum(label != -100 for label in labels[1:]) for _, labels, _ in made)
    return batches, hf_inputs, supervised, lengths


def steps(mm, hf, batches, hf_inputs):
    """Per arm, a call that runs one optimizer step on each of its batches."""
    from vlm_vit_llm.train import conversation_loss

    optimizers = {name: torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                          lr=1e-5) for name, model in (("ours", mm),
                                                                       ("hf", hf))}

    def ours(name):
        def run():
            for batch in batches[name]:
                loss = conversation_loss(mm, batch).loss
                optimizers["ours"].zero_grad(set_to_none=True)
                loss.backward()
                optimizers["ours"].step()
        return run

    def theirs():
        for inputs in hf_inputs:
            loss = hf(**inputs).loss
            optimizers["hf"].zero_grad(set_to_none=True)
            loss.backward()
            optimizers["hf"].step()

    return {"packed": ours("packed"), "padded": ours("padded"), "hf_padded": theirs}


def loss_difference(mm, hf, batches, hf_inputs) -> float:
    """Ours packed against transformers padded on the first batch: the same mean loss."""
    from vlm_vit_llm.train import conversation_loss

    with torch.no_grad():
        ours = conversation_loss(mm, batches["packed"][0]).loss
        theirs = hf(**hf_inputs[0]).loss
    return abs(ours.item() - theirs.item())


def child(args: argparse.Namespace) -> None:
    mm, hf, processor = build(Path(args.folder))
    batches, hf_inputs, _, _ = arm_batches(mm, processor, args)
    run = steps(mm, hf, batches, hf_inputs)[args.child]
    run()  # first-call work and optimizer state are not the step's memory
    print(peak_memory_mib(run, "cpu"))


def shape_of(args: argparse.Namespace) -> list[str]:
    return ["--batches", str(args.batches), "--batch-size", str(args.batch_size),
            "--max-length", str(args.max_length), "--seed", str(args.seed),
            "--folder", args.folder]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer layers and records")
    parser.add_argument("--vision-depth", type=int, default=None)
    parser.add_argument("--vision-width", type=int, default=128)
    parser.add_argument("--llm-layers", type=int, default=None)
    parser.add_argument("--llm-width", type=int, default=256)
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--max-length", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--keep-denormals", action="store_true")
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    for name, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    flush_denormals(args.keep_denormals)
    if args.child:
        child(args)
        return

    import logging

    logging.getLogger("vlm_vit_llm").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as scratch:
        args.folder = str(Path(scratch) / "qwen2_5_vl")
        save_model(args, Path(args.folder))
        mm, hf, processor = build(Path(args.folder))
        parameters = sum(p.numel() for p in hf.parameters())
        path = mm.packed_attention()
        batches, hf_inputs, supervised, lengths = arm_batches(mm, processor, args)
        difference = loss_difference(mm, hf, batches, hf_inputs)
        seconds = alternate(steps(mm, hf, batches, hf_inputs), args.repeats)
        rows = {"packed": sum(len(b.rows) for b in batches["packed"]),
                "padded": sum(len(b) for b in batches["padded"])}
        rows["hf_padded"] = rows["padded"]
        del mm, hf
        rates = {name: supervised / seconds[name] for name in ARMS}
        result = {"settings_note": f"vision {args.vision_depth} x {args.vision_width}, LLM "
                                   f"{args.llm_layers} x {args.llm_width}, LoRA r 16, rows of "
                                   f"{args.max_length}",
                  "device": "cpu", "dtype": "float32",
                  "vision_depth": args.vision_depth, "llm_layers": args.llm_layers,
                  "parameters": parameters, "batch_size": args.batch_size,
                  "batches": args.batches, "max_length": args.max_length,
                  "repeats": args.repeats, "packed_attention": path,
                  "supervised_tokens": supervised, "record_tokens": sum(lengths),
                  "loss_difference_packed_vs_hf": difference, "rows": rows,
                  "pass_seconds": seconds, "supervised_tokens_per_s": rates,
                  "speed_packed_over_padded": rates["packed"] / rates["padded"],
                  "speed_packed_over_hf_padded": rates["packed"] / rates["hf_padded"]}
        if not args.no_memory:
            memory = {name: peak_memory_in_child(__file__, [*shape_of(args), "--child", name])
                      for name in ARMS}
            result["peak_memory_mib"] = memory
            result["memory_packed_over_padded"] = memory["packed"] / max(memory["padded"], 1e-9)
            result["memory_packed_over_hf_padded"] = memory["packed"] / max(
                memory["hf_padded"], 1e-9)
    print(f"Qwen2.5-VL stage-2 steps, packed vs padded: vision {args.vision_depth} blocks, "
          f"LLM {args.llm_layers} layers ({parameters / 1e6:.0f}M parameters), "
          f"{args.batches} batches of {args.batch_size} records, rows of {args.max_length}, "
          f"cpu float32, median of {args.repeats}")
    print(f"  {supervised} supervised tokens a pass, {sum(lengths)} record tokens; packed "
          f"attention {path}; |loss ours packed - HF padded| {difference:.1e}")
    for name in ARMS:
        memory = result.get("peak_memory_mib", {}).get(name)
        extra = f", peak memory {memory:6.0f} MiB" if memory is not None else ""
        print(f"    {name:<10} {rates[name]:8.1f} supervised tokens/s ({rows[name]} rows){extra}")
    print(f"    packed over padded {result['speed_packed_over_padded']:.2f}x, over HF padded "
          f"{result['speed_packed_over_hf_padded']:.2f}x")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
