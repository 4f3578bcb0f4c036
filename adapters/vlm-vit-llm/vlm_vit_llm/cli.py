"""`vlm-vit llm train|generate|export`, added to the core CLI through the entry point group
`vlm_vit.commands` (the core knows nothing of it)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from vlm_vit.commands import (
    add_lora_arguments,
    add_model_argument,
    add_strategy_arguments,
    precision_name,
)
from vlm_vit_llm.embed_cli import add_embed_parser
from vlm_vit_llm.model_args import existing as _existing
from vlm_vit_llm.model_args import flagged as _flagged
from vlm_vit_llm.model_args import load_multimodal
from vlm_vit_llm.model_args import model_path as _model
from vlm_vit_llm.packing_args import PackingOptions, add_packing_arguments, packing_from_args
from vlm_vit_llm.tiling_args import AnyRes, add_anyres_argument, anyres_from_args

STAGES = (1, 2)
DATA_FORMATS = ("captions", "llava")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """The entry point: adds `llm` and its subcommands."""
    parser = subparsers.add_parser(
        "llm", help="image tokens into a Hugging Face causal LM (LLaVA): train, generate, "
        "merge, export, embed",
        description="A vision tower feeding a causal LM (plugin vlm-vit-llm).")
    commands = parser.add_subparsers(dest="llm_command", required=True, metavar="SUBCOMMAND")

    _add_train(commands)

    generate = commands.add_parser("generate", help="continue a prompt about images")
    generate.add_argument("model", type=Path, metavar="MODEL_DIR_OR_NAME")
    generate.add_argument("--image", type=Path, action="append", default=[], metavar="FILE",
                          help="an image (repeat for several, in placeholder order)")
    generate.add_argument("--prompt", default=None,
                          help="with one <image> per image (default: the placeholders alone)")
    generate.add_argument("--chat", action="store_true",
                          help="the prompt is a user message, rendered with the model's chat "
                          "template (the one it was trained with)")
    generate.add_argument("--max-new-tokens", type=int, default=32)
    generate.set_defaults(run=run_generate)

    merge = commands.add_parser(
        "merge", help="fold a stage-2 model's LoRA into its weights: a plain model",
        description="Folds the LoRA adapters of MODEL (LLM and encoder) into the weights they "
        "adapt and writes a plain multimodal model to --out, atomically: no adapter folders, "
        "loadable without peft, and a start for another `llm train --stage 2`.")
    merge.add_argument("model", type=Path, metavar="MODEL_DIR_OR_NAME")
    merge.add_argument("--out", required=True, type=Path, metavar="DIR",
                       help="where the merged model goes (not MODEL, nor a folder holding it)")
    merge.set_defaults(run=run_merge)

    add_embed_parser(commands)

    export = commands.add_parser("export", help="write the Hugging Face LLaVA layout "
                                 "(LLaVA-NeXT or OneVision for a tiled tower; a Qwen2-VL or "
                                 "Qwen2.5-VL model as its own class), LoRA merged")
    export.add_argument("model", type=Path, metavar="MODEL_DIR_OR_NAME")
    export.add_argument("--out", required=True, type=Path, metavar="DIR")
    export.set_defaults(run=run_export)


def _add_train(commands: argparse._SubParsersAction) -> None:
    """`llm train`."""
    train = commands.add_parser(
        "train", help="LLaVA stage 1 (projector only) or 2 (+ LoRA) on conversations or "
        "captions",
        description="Trains on LLaVA-format conversations (--data-format llava: --data "
        "FILE.json or .jsonl, --image-folder DIR; rendered with the tokenizer's chat "
        "template, the loss on the assistant turns) or captioned images (--data-format "
        'captions: --data DIR, --captions FILE.jsonl with {"image": "a.jpg", "caption": '
        '"..."} per line). Either may be tar shards instead (--data SHARDS, as `vlm-vit '
        "shards --captions` or `--llava` writes them), which carry their images, captions "
        "and records: no --captions or --image-folder. A bad shard sample is named "
        "(shard:key) and skipped, counted with the images that do not decode; a caption "
        "sample without an image is counted as such. Starts from MODEL (a saved "
        "multimodal model) or builds one from --tower and --llm. Leaves RUN_DIR/model.")
    _add_model_arguments(train)
    train.add_argument("--data", required=True, metavar="PATH_OR_SHARDS",
                       help="llava: the conversations file; captions: the image folder; or, "
                       "for either, tar shards (a brace pattern like shards/{00000..00031}.tar, "
                       "a glob, a folder of .tar files or a URL)")
    train.add_argument("--data-format", choices=DATA_FORMATS, default="captions")
    train.add_argument("--out", required=True, type=Path, metavar="RUN_DIR")
    train.add_argument("--stage", type=int, choices=STAGES, default=1)
    _add_data_arguments(train)
    add_packing_arguments(train)
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--batch-size", type=int, default=32)
    train.add_argument("--lr", type=float, default=None, help="default: 1e-3 stage 1, 2e-4 stage 2")
    train.add_argument("--warmup-steps", type=int, default=None, help="default: steps / 30")
    train.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                       type=precision_name, help="autocast precision, also spelled float32, "
                       "bfloat16, float16 (default: bf16 on a GPU, fp32 on a CPU)")
    train.add_argument("--device", default="auto")
    train.add_argument("--grad-checkpointing", action="store_true",
                       help="recompute activations in backward (LLM and encoder): less memory")
    add_strategy_arguments(train)
    train.add_argument("--num-workers", type=int, default=2)
    train.add_argument("--checkpoint-every", type=int, default=500, metavar="N",
                       help="steps between checkpoints (default %(default)s; Ctrl-C or "
                       "SIGTERM also saves one, at the step it stops)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--resume", action="store_true")
    train.add_argument("--overwrite", action="store_true",
                        help="replace an earlier run's files in the run directory")
    train.add_argument("--quiet", action="store_true",
                       help="no progress bars (training's and transformers' loading bars)")
    train.add_argument("--cache", type=Path, metavar="DIR",
                       help="stage 1: reuse and store the frozen tower's features of each "
                       "image here (vlm_vit.io.feature_cache: keyed by the pixels, weights, "
                       "processor, layers and precision; never stale)")
    train.add_argument("--cache-max-gb", type=float, metavar="GB",
                       help="with --cache: evict the least recently used entries beyond GB")
    _add_lora_arguments(train)
    train.set_defaults(run=run_train)


def _add_model_arguments(train: argparse.ArgumentParser) -> None:
    """Where `llm train` starts: MODEL, or --tower with --llm."""
    add_model_argument(train, optional=True, help="a multimodal model saved by an earlier run "
                       "(RUN_DIR/model), or its Hub name; or none, and --tower with --llm")
    start = train.add_argument_group("a new model")
    start.add_argument("--tower", metavar="PATH_OR_NAME",
                       help="a vision checkpoint, saved tower or model name (with --llm, "
                       "instead of MODEL); a saved tiled tower keeps its tiling (--anyres)")
    start.add_argument("--llm", type=Path, metavar="DIR_OR_NAME",
                       help="a Hugging Face causal LM folder with its tokenizer, or its name")
    start.add_argument("--projector", default="mlp2x_gelu", help="pooler for a new tower")
    start.add_argument("--feature-layer", type=int, default=-2,
                       help="hidden state a new tower reads (LLaVA: -2)")
    add_anyres_argument(start)


def _add_data_arguments(train: argparse.ArgumentParser) -> None:
    """The options of each data format."""
    llava = train.add_argument_group("conversations (--data-format llava)")
    llava.add_argument("--image-folder", type=Path, metavar="DIR",
                       help="where the records' image paths start (LLaVA's --image_folder)")
    llava.add_argument("--template", default="auto",
                       help="chat template: auto (the tokenizer's own, else vicuna_v1), "
                       "plain (LLaVA stage 1), vicuna_v1 or chatml")
    llava.add_argument("--max-length", type=int, default=None,
                       help="longest sequence, image tokens included (default: the LLM's "
                       "context); longer records are truncated, never through an image")
    llava.add_argument("--strict", action="store_true",
                       help="stop at the first bad record instead of skipping it (a "
                       "conversations file only)")
    llava.add_argument("--group-by-length", action="store_true",
                       help="batches of records of similar length (LLaVA's "
                       "group_by_modality_length): less padding (a conversations file only)")
    captions = train.add_argument_group("captions (--data-format captions)")
    captions.add_argument("--captions", type=Path, metavar="FILE.jsonl")
    captions.add_argument("--prompt", default="<image>\n",
                          help="what precedes each caption, for lines without their own")


def _add_lora_arguments(train: argparse.ArgumentParser) -> None:
    """Stage 2's LoRA: the flags `finetune` takes (`vlm_vit.commands.add_lora_arguments`),
    and LoRA on the encoder too."""
    add_lora_arguments(train, targets_help="LLM module names (default: q_proj k_proj v_proj "
                       "o_proj)", default_targets=None, switch=False)
    train.add_argument("--lora-encoder", default=None, metavar="PRESET",
                       help="also LoRA on the encoder: attn, attn_qv, mlp or all")


def build_model(args: argparse.Namespace, anyres: AnyRes | None = None):
    """The model to train: MODEL, or a new one from `--tower` and `--llm` (tiled as
    `anyres` asks, or as the tower was saved: `vlm_vit_llm.tiling_args`)."""
    from vlm_vit_llm.model import MultimodalLM

    if args.model is not None:
        if args.tower or args.llm:
            raise ValueError("give MODEL, or --tower with --llm, not both")
        return load_multimodal(args.model, "MODEL", trainable=True)
    if not (args.tower and args.llm):
        raise ValueError("give MODEL (a saved multimodal model), or both --tower and --llm")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vlm_vit import load_processor, load_tower
    from vlm_vit.commands import reading_checkpoint, refusing_pickles
    from vlm_vit_llm.tiling_args import saved_tiling, tiled_tower

    llm_dir = _model(args.llm, "--llm")
    with refusing_pickles(llm_dir, "--llm"):
        llm = AutoModelForCausalLM.from_pretrained(llm_dir)
    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    width = llm.get_input_embeddings().embedding_dim
    from vlm_vit.io import hub

    try:  # open_clip's MODEL/TAG as well: the Location keeps which weights to read
        tower_at = hub.locate(str(args.tower))
    except FileNotFoundError as error:
        raise _flagged(error, "--tower") from error
    with reading_checkpoint(args.tower):
        tower = load_tower(tower_at, args.projector, out_dim=width,
                           feature_layer=args.feature_layer)
    tower = tiled_tower(tower, anyres, saved_tiling(tower_at.directory), f"--tower {args.tower}")
    processor = tower.processor if tower.tiling is not None else \
        load_processor(tower_at, required=False)
    return MultimodalLM(tower, llm, tokenizer, processor=processor)


def run_train(args: argparse.Namespace) -> int:
    from transformers.utils import logging as transformers_logging

    if not args.quiet:
        return _train(args)
    # --quiet: no bar at all, transformers' "Loading weights" bars included
    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        return _train(args)
    finally:
        if shown:
            transformers_logging.enable_progress_bar()


def _train(args: argparse.Namespace) -> int:
    import torch

    from vlm_vit.train import TrainConfig, Trainer
    from vlm_vit_llm.model import DEFAULT_LLM_LORA_TARGETS
    from vlm_vit_llm.objective import MODEL_DIR
    from vlm_vit_llm.packing import explain_packed_attention
    from vlm_vit_llm.qwen_vl_writer import base_writer

    cache = _feature_cache(args)  # bad flags fail before the LLM loads
    shards = _check_data(args)
    packing = packing_from_args(args, shards=shards)
    anyres = anyres_from_args(args)
    if args.model is not None:
        args.model = _model(args.model, "MODEL")  # once: the records read its image token
        if args.stage == 2:
            _refuse_adapters(args.model)
    records = None if shards else _records(args)  # bad data fails before the LLM is loaded
    torch.manual_seed(args.seed)  # the same new projector on every process
    mm = build_model(args, anyres)
    base_writer(mm.llm)  # refuses what cannot be saved before any step: the run ends saving it
    dataset, collate, objective_class = _data(args, mm, records, shards, packing)
    if args.stage == 1:
        mm.train_projector_only()
        if cache is not None and getattr(mm, "deepstack", None) is not None:
            raise ValueError("--cache holds the tower's feature layer, not the DeepStack taps "
                             f"{args.model} also reads (Qwen3-VL): train without --cache")
        if cache is not None:
            from vlm_vit.io.feature_cache import cache_tower_features

            cache_tower_features(mm.tower, cache)  # the encoder is frozen and final now
    else:
        mm.add_lora(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                    llm_targets=args.lora_targets or DEFAULT_LLM_LORA_TARGETS,
                    encoder_targets=args.lora_encoder)
    # After the stage: it fingerprints the frozen base.
    objective = objective_class(mm, loss_reduction=packing.loss_reduction)
    if packing.packing:  # chosen from the LLM's config; checked at the first packed batch
        print("packing: attention {} ({})".format(*explain_packed_attention(mm.llm)))
    cuda = torch.cuda.is_available() and args.device in ("auto", "cuda")
    config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size,
        lr=args.lr or (1e-3 if args.stage == 1 else 2e-4), weight_decay=0.0,
        warmup_steps=args.steps // 30 if args.warmup_steps is None else args.warmup_steps,
        precision=args.precision or ("bf16" if cuda else "fp32"),
        grad_checkpointing=args.grad_checkpointing, group_by_length=args.group_by_length,
        checkpoint_every=args.checkpoint_every, seed=args.seed, num_workers=args.num_workers,
        device=args.device, strategy=args.strategy, cpu_offload=args.cpu_offload)
    command = shlex.join(["vlm-vit", *sys.argv[1:]]) if sys.argv[1:2] == ["llm"] else None
    result = Trainer(objective, dataset, config, args.out, collate=collate, command=command,
                     progress=not args.quiet).fit(resume=args.resume, overwrite=args.overwrite)
    if shards and result.undecodable_images:
        print(f"skipped {result.undecodable_images} bad sample(s) of the shards "
              f"({len(result.undecodable_paths)} distinct; first: "
              f"{result.undecodable_paths[0]}); each is named in the log", file=sys.stderr)
    if cache is not None:
        print(f"feature cache {args.cache}: {cache.hits} hit(s), {cache.misses} miss(es)")
    print(f"trained stage {args.stage} for {result.step} steps, final loss "
          f"{result.losses[-1]:.4f}; model in {args.out / MODEL_DIR}")
    return 0


def _feature_cache(args: argparse.Namespace):
    """`--cache` and `--cache-max-gb` checked: the `EncodeCache`, or None."""
    from vlm_vit.io.encode_cache import open_cache

    if args.cache is not None and args.stage != 1:
        raise ValueError("--cache is for stage 1, where the tower is frozen; stage 2 trains "
                         "through it (drop --cache)")
    return open_cache(args.cache, args.cache_max_gb)


def _refuse_adapters(model: Path) -> None:
    """Stage 2 puts new LoRA on a plain model; one that holds LoRA is refused, naming the
    command that merges it."""
    from vlm_vit.io.files import read_json
    from vlm_vit_llm.model import CONFIG_NAME

    if not (model / CONFIG_NAME).is_file():
        return  # from_pretrained names what is missing
    config = read_json(model / CONFIG_NAME)
    if config.get("llm_adapter") or config.get("vision_adapter"):
        raise ValueError(f"MODEL {model} holds LoRA adapters; merge them first (vlm-vit llm "
                         f"merge {model} --out DIR), then train --stage 2 from DIR")


def _check_data(args: argparse.Namespace) -> bool:
    """Checks `--data` and the flags that go with it; returns whether it names tar shards
    (else `args.data` becomes a checked `Path`)."""
    from vlm_vit.data.shards import expand_shards
    from vlm_vit.data.source import storage

    if storage(args.data, "--data", check_folder=False) != "shards":
        args.data = _existing(Path(args.data), "--data")
        if args.data_format == "captions" and args.captions is None:
            raise ValueError("--data-format captions needs --captions FILE.jsonl (or use "
                             "--data-format llava for conversations)")
        if args.data_format == "llava" and args.image_folder is None:
            raise ValueError("--data-format llava needs --image-folder DIR")
        return False
    try:
        expand_shards(args.data)  # a missing shard fails before the LLM is loaded
    except (FileNotFoundError, ValueError) as error:
        raise type(error)(f"--data: {error}") from error
    refused = {"--captions": (args.captions, "caption shards carry their captions"),
               "--image-folder": (args.image_folder, "LLaVA shards carry their images"),
               "--strict": (args.strict, "shards are checked as they stream: bad records are "
                            "named and skipped"),
               "--group-by-length": (args.group_by_length, "a shard stream cannot be sorted "
                                     "by length")}
    for flag, (value, reason) in refused.items():
        if value:
            raise ValueError(f"{flag} is for a folder or conversations file, not tar shards "
                             f"(--data {args.data}): {reason}")
    return True


def _records(args: argparse.Namespace):
    """`--data-format llava`'s records, indexed and checked (None for captions)."""
    if args.data_format == "captions":
        if args.group_by_length:
            raise ValueError("--group-by-length needs --data-format llava")
        return None
    from vlm_vit_llm.readers import RECORD_PLACEHOLDER, record_placeholder
    from vlm_vit_llm.records import ConversationRecords

    # a new model's "<image>"; a saved one says its own, and how its prompts hold an image
    image_token, image_text = RECORD_PLACEHOLDER, None
    if args.model is not None:
        image_token, image_text = record_placeholder(args.model)
    records = ConversationRecords(args.data, _existing(args.image_folder, "--image-folder"),
                                  image_token=image_token, strict=args.strict,
                                  image_text=image_text)
    if records.skipped.count:
        print(f"skipped {records.skipped.count} bad record(s) of "
              f"{len(records) + records.skipped.count} in {args.data} (first: "
              f"{records.skipped.named[0]}); --strict stops at the first", file=sys.stderr)
    return records


def _data(args: argparse.Namespace, mm, records, shards: bool, packing: PackingOptions):
    """(dataset, collate, objective class) for `--data-format`: a folder dataset, or with
    `shards` the shards' source (`open_source`) whose decode gives the same items, for the
    same collate; rows packed and batches token-budgeted as `packing` says."""
    from vlm_vit.data.source import open_source
    from vlm_vit_llm import train

    if args.data_format == "captions":
        if shards:
            dataset = open_source(args.data, train.CaptionShardDecode(mm.processor,
                                                                      mm.image_token),
                                  seed=args.seed, name="--data")
        else:
            dataset = train.CaptionFolder(args.data, _existing(args.captions, "--captions"),
                                          mm.processor)
        return dataset, train.CaptionCollate(mm, args.prompt, packing=packing.packing,
                                             max_length=args.max_length), \
            train.CaptionObjective
    from vlm_vit_llm.chat import adopt_chat_template

    # Saved with the model; a template that cannot render a probe conversation fails here.
    adopt_chat_template(mm.tokenizer, args.template, source=str(args.model or args.llm))
    collate = train.ConversationCollate(mm, max_length=args.max_length,
                                        packing=packing.packing)
    if shards:
        dataset = open_source(args.data, train.ConversationShardDecode(mm.processor,
                                                                       mm.image_token),
                              seed=args.seed, name="--data")
    else:
        before = records.skipped.count
        dataset = train.ConversationDataset(records, mm.processor,
                                            image_tokens=collate.image_tokens,
                                            max_length=collate.max_length,
                                            least_image_tokens=collate.least_image_tokens,
                                            video_processor=mm.video_processor)
        if records.skipped.count > before:
            named = records.skipped.named[before:]
            print(f"skipped {records.skipped.count - before} record(s) of {args.data} whose "
                  f"images alone take more than --max-length {collate.max_length}"
                  + (f" (first: {named[0]})" if named else "") + "; --strict stops at the "
                  "first", file=sys.stderr)
        _refuse_all_dropped(args, collate, records)
        dataset = packing.batches(dataset, collate.max_length)
        if packing.max_tokens_per_batch is not None and len(dataset) < args.batch_size:
            raise ValueError(f"--max-tokens-per-batch {packing.max_tokens_per_batch} packs the "
                             f"{len(records)} record(s) of {args.data} into {len(dataset)} "
                             f"batch(es), fewer than --batch-size {args.batch_size} (a step "
                             "takes --batch-size of them): lower either")
    return dataset, collate, train.ConversationObjective


def _refuse_all_dropped(args: argparse.Namespace, collate, records) -> None:
    """Refuses a conversations file of which the collate would drop every record (before
    any image is decoded), naming --max-length and how many records are too long for it;
    else the run would train nothing and blame undecodable images."""
    dropped = collate.drops_all(records)
    if dropped is None:
        return
    too_long = [(where, why) for where, why in dropped if "max_length" in why]
    where, why = (too_long or dropped)[0]
    if not too_long:
        raise ValueError(f"none of the {len(dropped)} record(s) of {args.data} can be trained "
                         f"on (first: {where}: {why})")
    raise ValueError(f"--max-length {collate.max_length} leaves nothing to train: "
                     f"{len(too_long)} of the {len(dropped)} record(s) of {args.data} are too "
                     f"long for it, keeping no assistant token (first: {where}: {why}); raise "
                     "--max-length")


def run_generate(args: argparse.Namespace) -> int:
    mm = load_multimodal(args.model, "MODEL")
    images = [_existing(path, "--image") for path in args.image]
    prompt = args.prompt if args.prompt is not None else mm.image_token * len(images) + "\n"
    placeholders = prompt.count(mm.image_token)
    if placeholders != len(images):  # named here: with --chat the model sees token ids
        raise ValueError(f"--prompt has {placeholders} {mm.image_token!r} placeholder(s) but "
                         f"{len(images)} --image(s): {prompt[:80]!r}")
    if args.chat:
        from vlm_vit_llm.chat import chat_prompt, chat_template, check_chat_template
        from vlm_vit_llm.records import Turn

        template = chat_template(mm.tokenizer)
        check_chat_template(mm.tokenizer, template, source=str(args.model))
        prompt = chat_prompt(mm.tokenizer, [Turn("user", prompt)], template)
    print(mm.eval().generate([prompt], [images], max_new_tokens=args.max_new_tokens,
                             do_sample=False)[0])
    return 0


def run_merge(args: argparse.Namespace) -> int:
    from vlm_vit.commands import check_output_apart
    from vlm_vit.io.files import read_json
    from vlm_vit_llm.merge import merge_adapters
    from vlm_vit_llm.model import CONFIG_NAME

    model = _model(args.model, "MODEL")
    check_output_apart(args.out, model, [], flag="--out", replaced=True)
    config = read_json(model / CONFIG_NAME) if (model / CONFIG_NAME).is_file() else {}
    if config.get("format") == "vlm_vit_llm" and not (config.get("llm_adapter")
                                                     or config.get("vision_adapter")):
        raise ValueError(f"MODEL {model} has no LoRA adapter: nothing to merge")
    merged = merge_adapters(load_multimodal(model, "MODEL"))
    print(f"wrote {merged.save_pretrained(args.out)} (LoRA merged: a plain model)")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from vlm_vit_llm.llava import export_llava
    from vlm_vit_llm.qwen_vl_writer import base_writer, export_qwen_vl

    mm = load_multimodal(args.model, "MODEL")
    # a Qwen-VL model goes back to its own class; every other one to LLaVA's
    written = (export_qwen_vl if base_writer(mm.llm) else export_llava)(mm, args.out)
    architectures = json.loads((written / "config.json").read_text())["architectures"]
    print(f"wrote {written} ({', '.join(architectures)})")
    return 0
