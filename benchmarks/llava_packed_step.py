"""Packed LLM rows against padded batches in LLaVA training steps: supervised tokens per
second and peak memory, stage 1 (projector only) and stage 2 (LoRA on the LLM).

    python benchmarks/llava_packed_step.py            # a ~100M Llama, CPU float32 (minutes)
    python benchmarks/llava_packed_step.py --quick    # a ~25M Llama, fewer records

Four arms train on the same records, on identical weights, one optimizer step per batch:

- `packed`: ours, each batch's records packed into rows of at most `--max-length` tokens
  (`ConversationBatch(rows=...)`, attention confined per record: `vlm_vit_llm.packing`). On
  an sdpa LLM the path is `varlen_sdpa` (`vlm_vit_llm.varlen_attention`): the rows run end to
  end in one row without padding, one causal SDPA per record; `--packed-attention
  position_ids` measures transformers' packed-sequence path (a dense mask per padded row).
- `padded`: ours, the same batches, one record per row padded to the longest.
- `grouped`: ours padded, batches of similar lengths (`GlobalBatchSampler(lengths=...)`, what
  `--group-by-length` uses; text-only records apart), the same records in other batches.
- `hf_padded`: transformers' `LlavaForConditionalGeneration` loaded from our `export_llava`,
  on `padded`'s batches (input ids, mask, pixels and labels from our `prepare`).

Each arm's call is one pass over all the records (`--batches` batches of `--batch-size`);
the arms alternate in one process after a warm-up (medians, `timing.alternate`); the rate is
the records' supervised tokens (the same for every arm) over that time. The peak memory of a
pass (after a first one) is measured per arm in a child process.

The records (seeded, synthetic: nothing is downloaded). Their shape follows LLaVA-Instruct-
150K's three kinds in the LLaVA paper's counts (58k conversations, 23k detailed descriptions,
77k complex reasoning, Liu et al. 2023, section 3), with LLaVA-1.5's 665k mix adding
text-only records (its 40k ShareGPT conversations: 6%); 5% of the records hold two images.
Token counts per turn are this script's assumption, not measured on the data (not available
offline), and every length is scaled by 1/4 with the image (576 -> 144 tokens: a 168 px image,
patch 14), so a row of 512 stands for LLaVA's 2048:

    kind           share  QA pairs  question tokens  answer tokens (uniform, after 1/4 scale)
    conversation   0.35   1-6      4-12             3-25
    detail         0.14   1        4-10             25-60
    reasoning      0.46   1        6-16             20-55
    text-only      0.06   1-8      5-40             5-80     (no image)

The printed histogram is the generated records' lengths (text plus image tokens).
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
from timing import (  # noqa: E402
    alternate,
    flush_denormals,
    peak_memory_in_child,
    peak_memory_mib,
    write_json,  # noqa: E402
)

from vlm_vit import EncoderConfig, VisionEncoder, VisionTower, build_pooler  # noqa: E402

ARMS = ("packed", "padded", "grouped", "hf_padded")
KINDS = {  # share, QA pairs, question tokens, answer tokens, images
    "conversation": (0.35, (1, 6), (4, 12), (3, 25)),
    "detail": (0.14, (1, 1), (4, 10), (25, 60)),
    "reasoning": (0.46, (1, 1), (6, 16), (20, 55)),
    "text-only": (0.06, (1, 8), (5, 40), (5, 80)),
}
TWO_IMAGES = 0.05
TURN_TOKENS = 3  # a template's role words around each turn
PRESETS = {"full": dict(llm_width=768, llm_layers=8, batches=4, batch_size=8, repeats=3),
           "quick": dict(llm_width=384, llm_layers=4, batches=3, batch_size=8, repeats=3)}


def records(count: int, image_token_id: int, vocab: int, image_tokens: int, max_length: int,
            seed: int = 0):
    """(ids, labels, image count) per record: token ids of the shape in the docstring, cut
    to `max_length` positions (images first, so never through an image) as the collate
    truncates."""
    rng = np.random.default_rng(seed)
    names = list(KINDS)
    shares = np.array([KINDS[name][0] for name in names])
    out = []
    for _ in range(count):
        kind = names[rng.choice(len(names), p=shares / shares.sum())]
        _, pairs, question, answer = KINDS[kind]
        images = 0 if kind == "text-only" else 2 if rng.random() < TWO_IMAGES else 1
        ids, labels = [1], [-100]  # beginning of sequence
        for pair in range(rng.integers(pairs[0], pairs[1] + 1)):
            asked = list(rng.integers(3, vocab, rng.integers(question[0], question[1] + 1)
                                      + TURN_TOKENS))
            if pair == 0:
                asked = [image_token_id] * images + asked
            said = list(rng.integers(3, vocab, rng.integers(answer[0], answer[1] + 1))) + [2]
            ids += asked + said
            labels += [-100] * len(asked) + said
        keep = max_length - images * (image_tokens - 1)
        ids, labels = ids[:keep], labels[:keep]
        out.append(([int(i) for i in ids], [int(i) for i in labels], images))
    return out


def build(args: argparse.Namespace, folder: Path, stage: int):
    """(our model, transformers' LLaVA on the same weights), both set up for `stage`."""
    from llava_step_vs_hf import tokenizer_in
    from transformers import LlamaConfig, LlamaForCausalLM, LlavaForConditionalGeneration
    from vlm_vit_llm import MultimodalLM, export_llava

    torch.manual_seed(0)
    config = EncoderConfig(image_size=168, patch_size=14, width=384, depth=6, heads=6,
                           mlp_width=1536, pre_norm=True, act="quick_gelu", norm_eps=1e-5,
                           patch_bias=False)
    width = args.llm_width
    tower = VisionTower(VisionEncoder(config).eval(),
                        build_pooler("mlp2x_gelu", in_dim=config.width, out_dim=width),
                        feature_layer=-2)
    llm = LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=width, intermediate_size=width * 8 // 3,
        num_hidden_layers=args.llm_layers, num_attention_heads=width // 64,
        num_key_value_heads=width // 64, max_position_embeddings=2048,
        attn_implementation="sdpa"))
    mm = MultimodalLM(tower, llm, tokenizer_in(folder))
    export_llava(mm, folder / "llava")
    hf = LlavaForConditionalGeneration.from_pretrained(folder / "llava",
                                                       attn_implementation="sdpa")
    if stage == 1:
        mm.train_projector_only()
        hf.requires_grad_(False)
    else:
        import peft

        mm.add_lora(r=16, alpha=32)
        hf.requires_grad_(False)
        hf.model.language_model = peft.get_peft_model(hf.model.language_model, peft.LoraConfig(
            r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    hf.model.multi_modal_projector.requires_grad_(True)
    mm.set_packed_attention(args.packed_attention)  # None: the best; checked and logged
    return mm.train(), hf.train()


def arm_batches(mm, args: argparse.Namespace):
    """Per arm, its list of batches over the same records (and their supervised tokens)."""
    from vlm_vit_llm.packing import pack_rows
    from vlm_vit_llm.train import ConversationBatch

    from vlm_vit.train.distributed import GlobalBatchSampler

    count = args.batches * args.batch_size
    made = records(count, mm.image_token_id, 32000, mm.tower.num_image_tokens(),
                   args.max_length, seed=args.seed)
    torch.manual_seed(1)
    size = mm.tower.encoder.config.image_size
    pixels = [[torch.randn(3, *size) for _ in range(images)] for _, _, images in made]
    image_tokens = mm.tower.num_image_tokens()
    lengths = [len(ids) + images * (image_tokens - 1) for ids, _, images in made]

    def batch(indices, packed=False):
        rows = pack_rows([lengths[i] for i in indices], args.max_length) if packed else None
        return ConversationBatch([made[i][0] for i in indices], [made[i][1] for i in indices],
                                 [pixels[i] for i in indices], rows=rows)

    plain = [list(range(b * args.batch_size, (b + 1) * args.batch_size))
             for b in range(args.batches)]
    signed = [n if made[i][2] else -n for i, n in enumerate(lengths)]
    grouped = list(GlobalBatchSampler(count, args.batch_size, seed=args.seed, lengths=signed,
                                      group_batches=args.batches))
    batches = {"packed": [batch(b, packed=True) for b in plain],
               "padded": [batch(b) for b in plain], "grouped": [batch(b) for b in grouped],
               "hf_padded": [batch(b) for b in plain]}
    supervised = sum(sum(label != -100 for label in labels[1:]) for _, labels, _ in made)
    return batches, supervised, lengths


def steps(mm, hf, batches):
    """Per arm, a call that runs one optimizer step on each of its batches."""
    from vlm_vit_llm.train import conversation_loss

    optimizers = {name: torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                          lr=1e-5) for name, model in (("ours", mm),
                                                                       ("hf", hf))}
    hf_inputs = []
    for batch in batches["hf_padded"]:
        prepared = mm.prepare(batch.input_ids, batch.images, token_labels=batch.labels)
        images = [image for row in batch.images for image in row]
        hf_inputs.append(dict(input_ids=prepared.input_ids, labels=prepared.labels,
                              attention_mask=prepared.attention_mask,
                              pixel_values=torch.stack(images) if images else None))

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

    return {"packed": ours("packed"), "padded": ours("padded"), "grouped": ours("grouped"),
            "hf_padded": theirs}


def logits_difference(mm, hf, batch) -> float:
    """Ours padded against transformers' LLaVA on one batch, on the real tokens."""
    prepared = mm.prepare(batch.input_ids, batch.images, token_labels=batch.labels)
    images = [image for row in batch.images for image in row]
    with torch.no_grad():
        ours = mm.run(prepared).logits
        theirs = hf(input_ids=prepared.input_ids, attention_mask=prepared.attention_mask,
                    pixel_values=torch.stack(images)).logits
    mask = prepared.attention_mask.bool()
    return (ours[mask] - theirs[mask]).abs().max().item()


def child(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        mm, hf = build(args, Path(scratch), args.stage)
        batches, _, _ = arm_batches(mm, args)
        run = steps(mm, hf, batches)[args.child]
        run()  # first-call work and optimizer state are not the step's memory
        print(peak_memory_mib(run, "cpu"))


def shape_of(args: argparse.Namespace) -> list[str]:
    return ["--llm-width", str(args.llm_width), "--llm-layers", str(args.llm_layers),
            "--batches", str(args.batches), "--batch-size", str(args.batch_size),
            "--max-length", str(args.max_length), "--seed", str(args.seed),
            *(["--packed-attention", args.packed_attention] if args.packed_attention else [])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~25M LLM, fewer records")
    parser.add_argument("--llm-width", type=int, default=None)
    parser.add_argument("--llm-layers", type=int, default=None)
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--packed-attention", default=None,
                        help="force the packed arm's attention path (vlm_vit_llm.packing.PATHS)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--keep-denormals", action="store_true")
    parser.add_argument("--stage", type=int, default=1, help=argparse.SUPPRESS)
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
    result = {"llm_width": args.llm_width, "llm_layers": args.llm_layers,
              "batch_size": args.batch_size, "batches": args.batches,
              "max_length": args.max_length, "repeats": args.repeats, "stages": {}}
    for stage in args.stages:
        with tempfile.TemporaryDirectory() as scratch:
            mm, hf = build(args, Path(scratch), stage)
            llm_parameters = sum(p.numel() for p in mm.llm.parameters())
            path = mm.packed_attention()
            batches, supervised, lengths = arm_batches(mm, args)
            difference = logits_difference(mm, hf, batches["padded"][0])
            seconds = alternate(steps(mm, hf, batches), args.repeats)
            rows = {name: sum(len(b.rows) if b.rows else len(b) for b in arm)
                    for name, arm in batches.items()}
            del mm, hf
        rates = {name: supervised / seconds[name] for name in ARMS}
        entry = {"llm_parameters": llm_parameters, "packed_attention": path,
                 "supervised_tokens": supervised,
                 "record_tokens": sum(lengths), "max_abs_logit_difference": difference,
                 "rows": rows, "pass_seconds": seconds, "supervised_tokens_per_s": rates,
                 "speed_packed_over_padded": rates["packed"] / rates["padded"],
                 "speed_packed_over_grouped": rates["packed"] / rates["grouped"],
                 "speed_packed_over_hf_padded": rates["packed"] / rates["hf_padded"]}
        if not args.no_memory:
            memory = {name: peak_memory_in_child(__file__, [*shape_of(args), "--stage",
                                                            str(stage), "--child", name])
                      for name in ARMS}
            entry["peak_memory_mib"] = memory
            entry["memory_packed_over_padded"] = memory["packed"] / max(memory["padded"], 1e-9)
            entry["memory_packed_over_hf_padded"] = memory["packed"] / max(
                memory["hf_padded"], 1e-9)
        result["stages"][str(stage)] = entry
        for name in ("speed_packed_over_padded", "speed_packed_over_grouped",
                     "speed_packed_over_hf_padded", "memory_packed_over_padded",
                     "memory_packed_over_hf_padded"):
            if name in entry:
                result[f"stage{stage}_{name}"] = entry[name]
    histogram, edges = np.histogram(lengths, bins=[0, 100, 150, 200, 250, 300, 400, 512])
    result["length_histogram"] = {f"{a}-{b}": int(n) for a, b, n in
                                  zip(edges[:-1], edges[1:], histogram, strict=True)}
    print(f"LLaVA steps, packed vs padded: Llama {args.llm_layers}x{args.llm_width} "
          f"({llm_parameters / 1e6:.0f}M parameters), {args.batches} batches of "
          f"{args.batch_size} records, rows of {args.max_length}, cpu float32, median of "
          f"{args.repeats}")
    print(f"  record lengths (text + image tokens): {result['length_histogram']}")
    for stage, entry in result["stages"].items():
        print(f"  stage {stage} ({entry['supervised_tokens']} supervised tokens a pass; "
              f"packed attention {entry['packed_attention']}; "
              f"max logit diff ours/HF {entry['max_abs_logit_difference']:.1e})")
        for name in ARMS:
            memory = entry.get("peak_memory_mib", {}).get(name)
            extra = f", peak memory {memory:6.0f} MiB" if memory is not None else ""
            print(f"    {name:<10} {entry['supervised_tokens_per_s'][name]:8.1f} supervised "
                  f"tokens/s ({entry['rows'][name]} rows){extra}")
        print(f"    packed over padded {entry['speed_packed_over_padded']:.2f}x, over grouped "
              f"{entry['speed_packed_over_grouped']:.2f}x, over HF LLaVA padded "
              f"{entry['speed_packed_over_hf_padded']:.2f}x")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
