"""`vlm-vit finetune` (image classification, fully or with LoRA / QLoRA) and `vlm-vit merge`."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from vlm_vit.files import atomic_write, read_json

FINETUNE_NAME = "finetune.json"  # what `merge` needs to rebuild the model


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "finetune", help="fine-tune an encoder on a class-labelled folder (LoRA optional)",
        description="Image classification with a new zero-initialised head (paper 3.2) on a "
        "folder with one sub-folder per class; --lora trains only LoRA adapters (peft) and "
        "the head; a held-out share measures accuracy at the end.")
    parser.add_argument("--encoder", required=True, metavar="PATH")
    parser.add_argument("--data", required=True, type=Path, metavar="DIR")
    parser.add_argument("--out", required=True, type=Path, metavar="RUN_DIR")
    parser.add_argument("--lora", metavar="SPEC",
                        help="e.g. r=16,alpha=32,targets=attn_qv (targets: attn, attn_qv, mlp, "
                        "all)")
    parser.add_argument("--qlora", action="store_true", help="4-bit NF4 block Linears")
    parser.add_argument("--pooling", choices=["cls", "mean"], default="cls")
    parser.add_argument("--image-size", type=int, default=None,
                        help="fine-tune at this resolution (position table interpolated)")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grad-checkpointing", action="store_true")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier run's files in the run directory")
    parser.set_defaults(run=run)

    merge = subparsers.add_parser(
        "merge", help="fold a LoRA fine-tune's adapter into the encoder",
        description="Writes the encoder of a `vlm-vit finetune --lora` run with the adapter "
        "folded into its weights (native format), plus the classifier head.")
    merge.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    merge.add_argument("--out", required=True, type=Path, metavar="DIR")
    merge.set_defaults(run=run_merge)


def parse_lora(spec: str) -> dict:
    """`r=16,alpha=32,targets=attn_qv,dropout=0.1` as keyword arguments for `apply_lora`."""
    kinds = {"r": int, "alpha": float, "dropout": float, "targets": str}
    options = {}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        if key not in kinds or not value:
            raise ValueError(f"--lora takes r=, alpha=, dropout=, targets=; got {part!r}")
        try:
            options[key] = kinds[key](value)
        except ValueError as error:
            raise ValueError(f"--lora {key}={value!r}: {error}") from error
    return options


def build_model(settings: dict):
    """The classifier (LoRA-wrapped when the settings say so) and its processor."""
    from vlm_vit.finetune import ImageClassifier
    from vlm_vit.loading import load_with_processor

    overrides = {"image_size": settings["image_size"]} if settings["image_size"] else {}
    encoder, processor = load_with_processor(settings["encoder"], **overrides)
    model = ImageClassifier(encoder, len(settings["classes"]), pooling=settings["pooling"])
    if settings["lora"] is not None:
        from vlm_vit.lora import apply_lora

        model = apply_lora(model, train_modules=("head",), quantize=settings["qlora"],
                           **settings["lora"])
    return model, processor


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from vlm_vit.evaluate import read_class_folder, stratified_split
    from vlm_vit.train import TrainConfig, Trainer
    from vlm_vit.train.data import LabelledImageFolder, collate_labelled

    if args.qlora and not args.lora:
        raise ValueError("--qlora needs --lora (QLoRA trains LoRA adapters on 4-bit weights)")
    _, labels, classes = read_class_folder(args.data)  # fails early on a bad folder
    settings = {"encoder": str(args.encoder), "image_size": args.image_size,
                "pooling": args.pooling, "classes": classes, "qlora": args.qlora,
                "lora": parse_lora(args.lora) if args.lora else None}
    torch.manual_seed(args.seed)
    model, processor = build_model(settings)
    from vlm_vit.lora import describe_trainable

    if int(os.environ.get("RANK", "0")) == 0:
        print(describe_trainable(model))
    size = processor.size if args.image_size is None else (args.image_size, args.image_size)
    data = LabelledImageFolder(args.data, size, mean=processor.mean, std=processor.std)
    targets = np.array([label for _, label in data.samples])
    train, test = (stratified_split(targets, args.test_fraction, seed=args.seed)
                   if args.test_fraction > 0 else (np.arange(len(targets)), np.array([], int)))
    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                         warmup_steps=args.steps // 10, weight_decay=0.0,
                         grad_checkpointing=args.grad_checkpointing, seed=args.seed,
                         num_workers=args.num_workers, device=args.device,
                         checkpoint_every=max(args.steps // 5, 1))
    args.out.mkdir(parents=True, exist_ok=True)
    with atomic_write(args.out / FINETUNE_NAME, "w") as handle:
        json.dump(settings, handle, indent=2)
    Trainer(model, torch.utils.data.Subset(data, train.tolist()), config, args.out,
            collate=collate_labelled).fit(resume=args.resume, overwrite=args.overwrite)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if len(test):
        model.eval()
        device = next(model.parameters()).device
        correct = 0
        with torch.inference_mode():
            for start in range(0, len(test), args.batch_size):
                chunk = test[start:start + args.batch_size]
                images = torch.stack([data[i][0] for i in chunk]).to(device)
                correct += int((model(images).argmax(-1).cpu().numpy() == targets[chunk]).sum())
        accuracy = correct / len(test)
        with atomic_write(args.out / "eval.json", "w") as handle:
            json.dump({"held_out_accuracy": accuracy, "test_images": len(test),
                       "chance": 1 / len(classes)}, handle, indent=2)
        print(f"held-out accuracy {accuracy:.3f} on {len(test)} images (chance "
              f"{1 / len(classes):.3f})")
    print(f"fine-tuned {args.steps} steps; outputs in {args.out}")
    return 0


def run_merge(args: argparse.Namespace) -> int:
    from vlm_vit.lora import load_adapter, merge_lora, set_adapter

    settings = read_json(args.run_dir / FINETUNE_NAME)
    if settings.get("lora") is None:
        raise ValueError(f"{args.run_dir} is a full fine-tune: its encoder is already in "
                         f"{args.run_dir / 'encoder'}, there is nothing to merge")
    adapter = args.run_dir / "adapter"
    if not adapter.is_dir():
        raise FileNotFoundError(f"{adapter} is missing: has the run finished?")
    model, processor = build_model(settings)
    model = set_adapter(load_adapter(model, adapter, "trained"), "trained")
    merged, error = merge_lora(model, report=True)
    merged.save_pretrained(args.out, classes=settings["classes"], processor=processor)
    print(f"wrote the merged classifier to {args.out} (ImageClassifier.from_pretrained; "
          f"load_encoder reads its encoder; merge error {error:.2e})")
    return 0
