"""`vlm-vit finetune` (image classification, fully or with LoRA / QLoRA) and `vlm-vit merge`."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
from pathlib import Path

from vlm_vit.cli.common import reading_checkpoint, refusing_pickles
from vlm_vit.commands import (
    add_lora_arguments,
    add_model_argument,
    add_optimisation_arguments,
    add_strategy_arguments,
    lora_options,
    optimisation_options,
)
from vlm_vit.presets import POOLINGS

FINETUNE_NAME = "finetune.json"  # what `merge` needs to rebuild the model
# Where a full fine-tune leaves its classifier (`ImageClassifier.save_pretrained`, what
# `predict` reads); a LoRA run gets one from `merge`.
CLASSIFIER_DIR = "classifier"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "finetune", help="fine-tune an encoder on a class-labelled folder (LoRA optional)",
        description="Image classification with a new zero-initialised head (paper 3.2) on a "
        "folder with one sub-folder per class; --lora trains only LoRA adapters (peft) and "
        "the head; a held-out share measures accuracy at the end. A full fine-tune leaves "
        "RUN_DIR/classifier, the directory `vlm-vit predict` reads; a LoRA run's adapter "
        "becomes one with `vlm-vit merge RUN_DIR --out DIR`.")
    add_model_argument(parser, help="the encoder to start from: a checkpoint or model name")
    parser.add_argument("--data", required=True, metavar="DIR_OR_SHARDS",
                        help="a folder with one sub-folder per class, or WebDataset tar "
                        "shards whose samples carry the class index in `cls` (or in a json "
                        "field, --label-field); held-out samples are chosen by a seeded hash "
                        "of their key")
    parser.add_argument("--label-field", metavar="NAME",
                        help="shards: read the class index from this field of each sample's "
                        "json instead of `cls`")
    parser.add_argument("--num-classes", type=int, metavar="K",
                        help="shards without the dataset.json of `vlm-vit shards`: the number "
                        "of classes (labels 0..K-1, K at most 1,000,000)")
    parser.add_argument("--out", required=True, type=Path, metavar="RUN_DIR")
    parser.add_argument("--pooling", choices=POOLINGS, default="cls")
    parser.add_argument("--image-size", type=int, default=None,
                        help="fine-tune at this resolution (position table interpolated)")
    parser.add_argument("--test-fraction", type=float, default=0.2)
    add_optimisation_arguments(parser, steps=500, batch_size=32, lr=1e-3,
                               lr_help="peak learning rate (default %(default)s)",
                               warmup_help="default: steps / 10", weight_decay=0.0,
                               checkpoint_every=None)
    add_strategy_arguments(parser)
    add_lora_arguments(parser, targets_help="a preset (attn, attn_qv, mlp, all) or module "
                       "names (default: attn)", default_targets=None, switch=True)
    parser.add_argument("--qlora", action="store_true",
                        help="with --lora: 4-bit NF4 block Linears")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
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


def build_model(settings: dict, say: bool = False):
    """The classifier (LoRA-wrapped when the settings say so) and its processor; `say`
    prints which format the encoder was read as, when it is another library's."""
    from vlm_vit.adapt.finetune import ImageClassifier
    from vlm_vit.io.loading import convert_checkpoint, from_converted

    overrides = {"image_size": settings["image_size"]} if settings["image_size"] else {}
    converted = convert_checkpoint(settings["encoder"])
    if say and converted.format != "native":
        rules = (f"; {len(converted.rules)} documented rule(s) decided what it does not "
                 "record (-v names them)" if converted.rules else "")
        print(f"MODEL {settings['encoder']}: read as a {converted.format} checkpoint "
              f"and converted{rules}")
    encoder, processor = from_converted(converted, settings["encoder"], **overrides)
    model = ImageClassifier(encoder, len(settings["classes"]), pooling=settings["pooling"])
    if settings["lora"] is not None:
        from vlm_vit.adapt.lora import apply_lora

        model = apply_lora(model, train_modules=("head",), quantize=settings["qlora"],
                           **settings["lora"])
    return model, processor


def run(args: argparse.Namespace) -> int:
    import torch

    from vlm_vit.data.samples import collate_labelled
    from vlm_vit.io.files import atomic_write
    from vlm_vit.processor import ImageProcessor
    from vlm_vit.train import TrainConfig, Trainer
    from vlm_vit.train.checkpoint import sharded_checkpoint_path
    from vlm_vit.train.distributed import launched_rank
    from vlm_vit.train.fsdp import is_sharded
    from vlm_vit.train.run_lock import RunLock
    from vlm_vit.train.sharded_checkpoint import load_weights

    kind, classes, settings = _settings(args)
    out = Path(args.out)
    recorded = _recorded_settings(out, settings) if args.resume and not args.overwrite else None
    torch.manual_seed(args.seed)
    with reading_checkpoint(args.model):
        model, processor = build_model(settings, say=launched_rank() == 0)
    from vlm_vit.adapt.lora import describe_trainable

    if launched_rank() == 0:
        print(describe_trainable(model))
    size = processor.size if args.image_size is None else (args.image_size, args.image_size)
    # The inference preprocessing at `size` with the checkpoint's normalisation, for folders
    # (LabelledImageFolder) and shards alike.
    preprocess = ImageProcessor(size=size, mean=tuple(processor.mean), std=tuple(processor.std))
    # The held-out split differs by storage: stratified for a folder, a key hash for shards.
    train, held_out = _PARTS[kind](args, preprocess, classes)
    config = TrainConfig(**optimisation_options(args, lr=1e-3, warmup_steps=args.steps // 10,
                                                checkpoint_every=max(args.steps // 5, 1)),
                         strategy=args.strategy, cpu_offload=args.cpu_offload)
    trainer = Trainer(model, train, config, out, collate=collate_labelled,
                      command=getattr(args, "command_line", None), progress=not args.quiet)
    main_rank = launched_rank() == 0
    # The run directory is locked from the checks to the end (the trainer takes the same
    # lock again); finetune.json only once the run is accepted: a refused one leaves the
    # earlier run's.
    with RunLock(out) if main_rank else contextlib.nullcontext():
        trainer.check_run_dir(resume=args.resume, overwrite=args.overwrite)
        if recorded is None and main_rank:
            out.mkdir(parents=True, exist_ok=True)
            with atomic_write(out / FINETUNE_NAME, "w") as handle:
                json.dump(settings, handle, indent=2)
            if args.overwrite and (out / CLASSIFIER_DIR).is_dir():  # never the old run's
                shutil.rmtree(out / CLASSIFIER_DIR)
        trainer.fit(resume=args.resume, overwrite=args.overwrite)
        if main_rank and is_sharded(model):
            # FSDP2 sharded the live model over the processes, which have ended their part;
            # rank 0 goes on with a whole copy holding the final checkpoint's weights.
            with reading_checkpoint(args.model):
                model, _ = build_model(settings)
            load_weights(sharded_checkpoint_path(out, args.steps), model)
        if main_rank and settings["lora"] is None:
            # The trained encoder, head, class names and the preprocessing it trained with,
            # in one directory that appears at once.
            classifier = model.save_pretrained(out / CLASSIFIER_DIR, classes=classes,
                                               processor=preprocess)
    if not main_rank:
        return 0
    if held_out is not None:
        _evaluate_held_out(model, held_out, classes, out)
    print(f"fine-tuned {args.steps} steps; outputs in {out}")
    if settings["lora"] is None:
        print(f"classifier: {classifier} (vlm-vit predict {classifier} IMAGES)")
    else:
        print(f"adapter: {out / 'adapter'} (vlm-vit merge {out} --out DIR writes a classifier "
              "directory that vlm-vit predict reads)")
    return 0


def _settings(args: argparse.Namespace) -> tuple[str, list[str], dict]:
    """The data's storage kind, the class names and the run's settings (`finetune.json`)."""
    from vlm_vit.data.source import storage
    from vlm_vit.eval import read_class_folder

    if args.qlora and not args.lora:
        raise ValueError("--qlora needs --lora (QLoRA trains LoRA adapters on 4-bit weights)")
    given = [flag for flag, value, default in (
        ("--lora-r", args.lora_r, 16), ("--lora-alpha", args.lora_alpha, 32.0),
        ("--lora-dropout", args.lora_dropout, 0.0), ("--lora-targets", args.lora_targets, None))
        if value != default]
    if given and not args.lora:
        raise ValueError(f"{', '.join(given)} configure LoRA, which needs --lora")
    # A folder's own reader names a missing one, as before storage() decided.
    kind = storage(args.data, "--data", check_folder=False)
    classes = _shard_classes(args) if kind == "shards" else read_class_folder(Path(args.data))[2]
    settings = {"encoder": str(args.model), "image_size": args.image_size,
                "pooling": args.pooling, "classes": classes, "qlora": args.qlora,
                "lora": lora_options(args) if args.lora else None}
    return kind, classes, settings


def _evaluate_held_out(model, held_out, classes: list[str], out: Path) -> None:
    """The held-out accuracy of the trained `model`, printed and written to eval.json."""
    import torch

    from vlm_vit.io.files import atomic_write

    model.eval()
    device = next(model.parameters()).device
    correct = total = 0
    with torch.inference_mode():
        for images, labels in held_out():
            predicted = model(images.to(device)).argmax(-1).cpu()
            correct += int((predicted == labels).sum())
            total += len(labels)
    accuracy = correct / max(total, 1)
    with atomic_write(out / "eval.json", "w") as handle:
        json.dump({"held_out_accuracy": accuracy, "test_images": total,
                   "chance": 1 / len(classes)}, handle, indent=2)
    print(f"held-out accuracy {accuracy:.3f} on {total} images (chance "
          f"{1 / len(classes):.3f})")


def run_dir_hint(path: Path) -> str | None:
    """What to give `predict` instead of a `vlm-vit finetune` run directory (None for any
    other path): the run's classifier directory, or how a LoRA run gets one."""
    from vlm_vit.io.files import read_json

    settings_path = path / FINETUNE_NAME
    if not settings_path.is_file():
        return None
    lora = read_json(settings_path).get("lora") is not None
    if lora:
        return (f"{path} is the run directory of a LoRA fine-tune; fold its adapter into a "
                f"classifier directory with `vlm-vit merge {path} --out DIR`, then give DIR")
    classifier = path / CLASSIFIER_DIR
    if not classifier.is_dir():
        return (f"{path} is a fine-tune's run directory without {CLASSIFIER_DIR}/ (has the run "
                f"finished?); a finished run leaves its classifier directory in {classifier}")
    return f"{path} is a fine-tune's run directory; its classifier directory is {classifier}"


def _recorded_settings(out: Path, settings: dict) -> dict | None:
    """The settings a run to resume recorded in its finetune.json (None when it has none).

    Raises:
        ValueError: when they differ from this run's, naming each difference (`merge` folds
            the adapter into the recorded encoder, so a resume must train that one).
    """
    from vlm_vit.io.files import read_json

    path = out / FINETUNE_NAME
    if not path.is_file():
        return None
    recorded = read_json(path)

    def same(name: str, before, after) -> bool:
        if name == "encoder" and Path(str(before)).exists() and Path(str(after)).exists():
            return Path(str(before)).resolve() == Path(str(after)).resolve()
        return before == after

    changed = [f"{name} {recorded.get(name)!r} -> {value!r}" for name, value in settings.items()
               if not same(name, recorded.get(name), value)]
    if changed:
        raise ValueError(f"{path} records other settings than this run's (recorded -> now): "
                         f"{'; '.join(changed)}; resume with the same ones, or start afresh "
                         "with --overwrite")
    return recorded


def _folder_parts(args: argparse.Namespace, processor, classes: list[str]):
    """A class folder's training subset (stratified split) and its held-out batches."""
    import numpy as np
    import torch

    from vlm_vit.data.folders import LabelledImageFolder
    from vlm_vit.eval import stratified_split

    data = LabelledImageFolder(args.data, processor.size, mean=processor.mean,
                               std=processor.std, resample=processor.resample)
    targets = np.array([label for _, label in data.samples])
    train, test = (stratified_split(targets, args.test_fraction, seed=args.seed)
                   if args.test_fraction > 0 else (np.arange(len(targets)), np.array([], int)))

    def held_out():
        for start in range(0, len(test), args.batch_size):
            chunk = test[start:start + args.batch_size]
            yield (torch.stack([data[i][0] for i in chunk]),
                   torch.as_tensor(targets[chunk]))

    return torch.utils.data.Subset(data, train.tolist()), held_out if len(test) else None


def _shard_classes(args: argparse.Namespace) -> list[str]:
    """The class names of shards: `vlm-vit shards`' dataset.json, else --num-classes."""
    from vlm_vit.adapt.finetune import MAX_CLASSES
    from vlm_vit.data.shards import expand_shards, read_dataset_index

    index = read_dataset_index(expand_shards(args.data))
    if index is not None and index.get("classes"):
        return [str(name) for name in index["classes"]]
    if args.num_classes is None or args.num_classes < 2:
        raise ValueError(f"--data {args.data}: shards without a dataset.json naming their "
                         "classes need --num-classes K (K >= 2)")
    if args.num_classes > MAX_CLASSES:
        raise ValueError(f"--num-classes {args.num_classes:,} is over the {MAX_CLASSES:,} "
                         "classes a classifier may have")
    return [str(k) for k in range(args.num_classes)]


def _shard_parts(args: argparse.Namespace, processor, classes: list[str]):
    """A training source of the shards' samples outside the held-out hash split, and the
    held-out samples' batches in one ordered pass."""
    from vlm_vit.data.shards import KeySplit, LabelledBatches, LabelledDecode
    from vlm_vit.data.source import open_source

    decode = LabelledDecode(processor, args.label_field, num_classes=len(classes))
    train = open_source(args.data, decode, seed=args.seed, name="--data",
                        select=KeySplit(args.test_fraction, args.seed, test=False))

    def held_out():
        return LabelledBatches(train.stream.shards, decode, args.batch_size,
                               select=KeySplit(args.test_fraction, args.seed, test=True))

    return train, held_out if args.test_fraction > 0 else None


# (training data, held-out batches or None) for each storage that `storage()` names.
_PARTS = {"folder": _folder_parts, "shards": _shard_parts}


def run_merge(args: argparse.Namespace) -> int:
    from vlm_vit.adapt.finetune import CLASSIFIER_CONFIG_NAME
    from vlm_vit.adapt.lora import load_adapter, merge_lora, set_adapter
    from vlm_vit.io.files import read_json

    if not (args.run_dir / FINETUNE_NAME).is_file() \
            and (args.run_dir / CLASSIFIER_CONFIG_NAME).is_file():
        raise ValueError(f"{args.run_dir} is a classifier directory already: vlm-vit predict "
                         f"reads it; merge takes the run directory of `vlm-vit finetune --lora`")
    settings = read_json(args.run_dir / FINETUNE_NAME)
    if settings.get("lora") is None:
        raise ValueError(f"{args.run_dir} is a full fine-tune: there is nothing to merge; "
                         f"its classifier directory is {args.run_dir / CLASSIFIER_DIR} "
                         f"(vlm-vit predict {args.run_dir / CLASSIFIER_DIR} IMAGES)")
    adapter = args.run_dir / "adapter"
    if not adapter.is_dir():
        raise FileNotFoundError(f"{adapter} is missing: has the run finished?")
    with reading_checkpoint(settings["encoder"]):
        model, processor = build_model(settings)
    with refusing_pickles(adapter, "the adapter"):
        model = set_adapter(load_adapter(model, adapter, "trained"), "trained")
    merged, error = merge_lora(model, report=True)
    merged.save_pretrained(args.out, classes=settings["classes"], processor=processor)
    print(f"wrote the merged classifier to {args.out} (ImageClassifier.from_pretrained; "
          f"load_encoder reads its encoder; merge error {error:.2e})")
    return 0
