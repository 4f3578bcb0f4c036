"""Trainer checkpoint size of a bridge run: the whole objective's state dict against
`BridgeObjective.state_dict()` (the trainable tensors and a fingerprint), plus AdamW's state.

    python adapters/vlm-vit-llm/benchmarks/checkpoint_size.py --json sizes.json

A random ~130M-parameter Llama (hidden 768, 12 layers, 12 heads, MLP 2048, vocabulary
32000, untied head; nothing is downloaded) behind a tiny CLIP-shaped tower with an
`mlp2x_gelu` projector; stage 1 trains the projector, stage 2 adds LoRA (r=16) on the
attention projections. Each state is written with `torch.save` to a temporary file and
measured with `os.path.getsize`. AdamW holds moments for the trainable parameters only,
before and after alike; it gets one step on zero gradients so its state exists.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from torch import nn

from vlm_vit import EncoderConfig, VisionEncoder, VisionTower, build_pooler
from vlm_vit.train.trainer import parameter_groups
from vlm_vit_llm import MultimodalLM
from vlm_vit_llm.objective import BridgeObjective

MB = 1e6


def tokenizer():
    """A word-level tokenizer of a few words: the LLM's vocabulary stays as configured."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "a", "photo", "of", "the", "dog"]
    model = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def build(stage: str, args: argparse.Namespace) -> MultimodalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llm = LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.mlp,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        max_position_embeddings=2048, tie_word_embeddings=False))
    encoder = VisionEncoder(EncoderConfig(image_size=32, patch_size=8, width=32, depth=3,
                                          heads=4, mlp_width=64, pre_norm=True))
    tower = VisionTower(encoder, build_pooler("mlp2x_gelu", in_dim=32, out_dim=args.hidden),
                        feature_layer=-2)
    mm = MultimodalLM(tower, llm, tokenizer())
    return mm.train_projector_only() if stage == "stage 1" else mm.add_lora(r=args.lora_rank)


def saved_mb(state, folder: str) -> float:
    path = os.path.join(folder, "state.pt")
    torch.save(state, path)
    return os.path.getsize(path) / MB


def measure(stage: str, args: argparse.Namespace, folder: str) -> dict:
    mm = build(stage, args)
    started = time.perf_counter()
    objective = BridgeObjective(mm)
    fingerprint_s = time.perf_counter() - started
    optimizer = torch.optim.AdamW(parameter_groups(objective, 0.05), lr=1e-4)
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    before = saved_mb(nn.Module.state_dict(objective), folder)  # what the trainer saved so far
    after = saved_mb(objective.state_dict(), folder)
    adamw = saved_mb(optimizer.state_dict(), folder)
    return {
        "stage": stage,
        "parameters": sum(p.numel() for p in objective.parameters()),
        "trainable": sum(p.numel() for p in objective.parameters() if p.requires_grad),
        "objective_before_mb": before, "objective_after_mb": after, "optimizer_mb": adamw,
        "checkpoint_before_mb": before + adamw, "checkpoint_after_mb": after + adamw,
        "fingerprint_s": fingerprint_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--mlp", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        rows = [measure(stage, args, folder) for stage in ("stage 1", "stage 2")]
    print(f"{'':8} {'params':>12} {'trainable':>10} {'objective MB':>20} {'AdamW MB':>9} "
          f"{'checkpoint MB':>20} {'fingerprint s':>14}")
    print(f"{'':8} {'':>12} {'':>10} {'before -> after':>20} {'':>9} {'before -> after':>20}")
    for row in rows:
        print(f"{row['stage']:8} {row['parameters']:>12,} {row['trainable']:>10,} "
              f"{row['objective_before_mb']:>9.2f} -> {row['objective_after_mb']:>6.3f} "
              f"{row['optimizer_mb']:>9.3f} "
              f"{row['checkpoint_before_mb']:>9.2f} -> {row['checkpoint_after_mb']:>6.3f} "
              f"{row['fingerprint_s']:>14.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"config": vars(args), "results": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
