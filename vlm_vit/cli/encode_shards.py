"""`vlm-vit encode` over tar shards: one output file per input shard.

WebDataset tar shards (a brace pattern, a glob, a folder of tars, several of these, or a
`pipe:` URL; see `vlm_vit.data.shards.spec`) give one file per shard in the folder `-o OUT`:
`OUT/<shard name less .tar, .tar.gz or .tgz>.safetensors` (escaped, as below). Row i of its
`tokens` (or `layer_K`) is the i-th sample of the shard that was encoded, whose `__key__` is
`keys[i]`.
Its metadata (strings; JSON where structured):

- `keys`: the encoded samples' keys, in shard order; `samples`: how many (N).
- `skipped`: [{"key", "reason"}] for undecodable images and samples without an image.
- `shard`: the input URL; `read`: samples read from it; `truncated`: "true" when the shard
  ended early (its readable samples are encoded; a rerun reads it again).
- `source`: for a local shard, {"size", "mtime_ns", "dataset_json"}: the shard file's size
  and modification time and the sha256 of the `dataset.json` beside it (null without one)
  when it was encoded; null for a URL.
- `grid`, `num_prefix_tokens`, `model`, `settings` (the options that shape the tokens), and
  `complete`: "true".

Names (keys, the shard URL, the model) are written as `tar_shards.escape_name` writes them:
one line of UTF-8, `unescape_name` gives the name back (a name of printable UTF-8 without a
backslash is unchanged).

OUT is locked for the job (`RunLock`: rank 0 holds `OUT/.lock`, rank R > 0
`OUT/.rank_R/.lock`), so a second job on OUT is refused, naming the holder's pid. Each file
is written to a hidden temporary file in OUT and then renamed, so a killed job leaves only
whole files; rerunning the same command skips the shards whose file is complete and removes
the temporary files the killed run left; a shard whose size, modification time or
`dataset.json` differ from its output's `source` (rewritten since) is encoded again, with a
warning; an output of another shard, model or settings is never overwritten (the run stops,
naming it). Under torchrun (RANK and WORLD_SIZE set) each process encodes every
WORLD_SIZE-th shard; no process group is needed, and rank 0 prints its own summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

import vlm_vit.train.distributed as distributed
from vlm_vit.cli.common import check_output_apart
from vlm_vit.cli.encode_model import DTYPES, encode_batch, prepare_encoder
from vlm_vit.data.shards import (
    ShardProblems,
    escape_name,
    expand_shards,
    rank_shards,
    read_dataset_index,
    read_shard,
)
from vlm_vit.data.shards.spec import DATASET_INDEX, SHARD_SUFFIXES, URL_PREFIXES
from vlm_vit.io.files import write_safetensors
from vlm_vit.io.integrity import file_sha256
from vlm_vit.model import VisionEncoder
from vlm_vit.processor import ImageProcessor
from vlm_vit.train.run_lock import RunDirectoryInUse, RunLock
from vlm_vit.train.run_lock import _describe as describe_holder


def shard_output_name(url: str) -> str:
    """The output file name of a shard: its base name less the shard suffix, plus
    `.safetensors` (for a URL such as `pipe:...`, the last word that ends in a shard
    suffix), escaped by `escape_name` (a name that is not UTF-8, or holds a newline, is
    written as escapes).

    Raises:
        ValueError: when no word of `url` ends in a shard suffix.
    """
    if url.startswith(URL_PREFIXES):
        words = [word.strip("'\"").split("?")[0] for word in url.split()]
        named = [word for word in words if word.endswith(SHARD_SUFFIXES)]
        base = named[-1].rsplit("/", 1)[-1].rsplit(":", 1)[-1] if named else ""
    else:  # a local file: its whole name, spaces and newlines included
        base = Path(url).name
    stem = next((base[:-len(s)] for s in SHARD_SUFFIXES if base.endswith(s)), "")
    if not stem:
        raise ValueError(f"cannot name the output of shard {url!r}: no word of it is a file "
                         f"name ending in {', '.join(SHARD_SUFFIXES)}")
    return f"{escape_name(stem)}.safetensors"  # a name safetensors can open: UTF-8


def _output_paths(shards: list[str], out: Path) -> list[Path]:
    """OUT/<name>.safetensors per shard; two shards of one name are refused."""
    paths: list[Path] = []
    owner: dict[str, str] = {}
    for url in shards:
        name = shard_output_name(url)
        if name in owner:
            raise ValueError(f"shards {owner[name]} and {url} would both be written to "
                             f"{out / name}; encode them into separate -o folders")
        owner[name] = url
        paths.append(out / name)
    return paths


def _check_output_folder(args: argparse.Namespace, shards: list[str]) -> None:
    """Refuses an -o that is a .safetensors name or a file, lies in the model's folder, or
    is a folder of the input shards."""
    out = args.out
    if out.suffix == ".safetensors":
        raise ValueError(f"with tar shards, -o is a folder for one .safetensors file per shard; "
                         f"got the file name {out}")
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"-o {out} is a file; with tar shards, -o is a folder")
    local = [Path(url) for url in shards if not url.startswith(URL_PREFIXES)]
    check_output_apart(out, args.model, [*args.inputs, *(path.parent for path in local)],
                       inputs_are="the folder of the input shards")


def _settings(args: argparse.Namespace) -> str:
    """The options that shape the tokens, as the JSON recorded in each output."""
    return json.dumps({"layers": args.feature_layers or None, "keep_prefix": args.keep_prefix,
                       "dtype": args.dtype, "image_size": args.image_size,
                       "normalize": args.normalize})


def _lock_output(out: Path, rank: int) -> RunLock:
    """Takes this process's lock on OUT: `OUT/.lock` for rank 0, `OUT/.rank_R/.lock` for
    rank R > 0 (so the ranks of one job never refuse each other).

    Raises:
        RunDirectoryInUse: naming OUT and the holder's pid when another job holds it.
    """
    lock = RunLock(out if rank == 0 else out / f".rank_{rank}")
    try:
        lock.acquire()
    except RunDirectoryInUse:
        try:
            who = describe_holder(lock.path.read_text())
        except OSError:
            who = "a process that left no details"
        its_rank = f", its rank {rank}" if rank else ""
        raise RunDirectoryInUse(f"-o {out} is in use by another encode job ({who}{its_rank}); "
                                "wait for it to finish, stop it, or choose another -o") from None
    return lock


def _shard_source(url: str, digests: dict[Path, str | None]) -> dict | None:
    """What identifies a local shard's content: its size, its modification time and the
    sha256 of the `dataset.json` beside it (None without one); None for a URL. `digests`
    caches the digest per folder."""
    if url.startswith(URL_PREFIXES):
        return None
    path = Path(url)
    status = path.stat()
    index = path.parent / DATASET_INDEX
    if index.parent not in digests:
        digests[index.parent] = file_sha256(index) if index.is_file() else None
    return {"size": status.st_size, "mtime_ns": status.st_mtime_ns,
            "dataset_json": digests[index.parent]}


def _source_change(recorded: str | None, source: dict | None) -> str | None:
    """How a shard's `source` differs from the one its output recorded, or None when equal."""
    if recorded is None:  # written by an older vlm-vit
        return None if source is None else "its output records no size or time of it"
    try:
        before = json.loads(recorded)
    except ValueError:
        before = {}
    if before == source:
        return None
    if not isinstance(before, dict) or source is None:
        return f"its output records {recorded}, it is now {json.dumps(source)}"
    words = {"size": "size", "mtime_ns": "modification time", "dataset_json": "dataset.json"}
    changed = [word for name, word in words.items() if before.get(name) != source.get(name)]
    return f"its {', '.join(changed)} changed since it was encoded"


def _is_complete(path: Path, url: str, model: str, settings: str, source: dict | None,
                 changed: list[str]) -> bool:
    """Whether `path` is a whole output of shard `url` by this model and settings (a rerun
    skips it). A truncated shard's output is not: the rerun reads the shard again; nor is one
    whose recorded `source` differs from the shard's now (rewritten since), said in
    `changed`.

    Raises:
        ValueError: when `path` is not an encode output, or one of another shard, model or
            settings (a rerun never overwrites another job's output).
    """
    if not path.exists():
        return False
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path} exists and is not a readable safetensors file ({error}); "
                         "remove it or choose another -o") from None
    for name, value in (("shard", escape_name(url)), ("model", escape_name(model)),
                        ("settings", settings)):
        if metadata.get(name) != value:
            raise ValueError(f"{path} was encoded with {name} {metadata.get(name)}, this run "
                             f"has {value}; remove it or choose another -o")
    if metadata.get("complete") != "true" or metadata.get("truncated") == "true":
        return False
    change = _source_change(metadata.get("source"), source)
    if change is not None:
        changed.append(f"shard {escape_name(url)}: {change}")
        return False
    return True


def _remove_leftovers(out: Path, outputs: list[Path]) -> int:
    """Removes the temporary files (`.NAME.*.tmp`) a killed run left for these outputs; only
    this process's own outputs, so a rank never removes another's file being written."""
    names = {path.name for path in outputs}
    removed = 0
    for entry in out.iterdir():
        name = entry.name
        if (name.startswith(".") and name.endswith(".tmp")
                and name[1:-len(".tmp")].rsplit(".", 1)[0] in names):
            entry.unlink(missing_ok=True)
            removed += 1
    return removed


@dataclass
class _ShardRecord:
    """What encoding one shard kept and skipped."""

    keys: list[str] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    read: int = 0
    problems: ShardProblems = field(  # truncation reported by `run_shards`, once
        default_factory=lambda: ShardProblems(warn_truncated=False))


def _shard_batches(url: str, index: int, processor: ImageProcessor, batch_size: int,
                   record: _ShardRecord) -> Iterator[torch.Tensor]:
    """The shard's images, preprocessed, in batches `[B, 3, H, W]` of `batch_size`; the
    encoded samples' keys and the skipped ones go to `record`, escaped (`escape_name`)."""
    pixels: list[torch.Tensor] = []
    for sample in read_shard(url, index, problems=record.problems):
        record.read += 1
        key = escape_name(sample.key)
        data = sample.image()
        if data is None:
            fields = ", ".join(escape_name(name) for name in sorted(sample.fields))
            record.skipped.append({"key": key, "reason": f"no image (fields: {fields or 'none'})"})
            continue
        name = f"image {escape_name(sample.shard)}:{key}"
        try:  # decoded as `processor(path)` decodes a file, so the tokens match a folder's
            image = processor.preprocess_one(processor.load(data, name))
        except ValueError as error:  # ImageLoadError, ImageTooLargeError
            record.skipped.append({"key": key, "reason": str(error)})  # names escaped
            continue
        pixels.append(image)
        record.keys.append(key)
        if len(pixels) == batch_size:
            yield torch.stack(pixels)
            pixels = []
    if pixels:
        yield torch.stack(pixels)


def _empty_tokens(args: argparse.Namespace, encoder: VisionEncoder) -> torch.Tensor:
    """`[0, T, D]` for a shard without one decodable image, T and D as the others'."""
    config = encoder.config
    prefix = config.num_prefix_tokens if args.keep_prefix else 0
    tokens = prefix + config.grid[0] * config.grid[1]
    return torch.zeros(0, tokens, config.width, dtype=DTYPES[args.dtype])


def _encode_shard(args: argparse.Namespace, url: str, index: int, path: Path,
                  encoder: VisionEncoder, processor: ImageProcessor,
                  layers: list[int] | None, names: list[str],
                  source: dict | None) -> _ShardRecord:
    """Encodes one shard and writes its output atomically (`write_safetensors`); `source`
    is the shard's size and time taken before it is read (a change after that makes the
    next run encode it again)."""
    record = _ShardRecord()
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    with torch.inference_mode():
        for pixels in _shard_batches(url, index, processor, args.batch_size, record):
            tensors, _ = encode_batch(args, encoder, pixels, layers, names)
            for name, tensor in tensors.items():
                parts[name].append(tensor)
    tensors = {name: torch.cat(chunks) if chunks else _empty_tokens(args, encoder)
               for name, chunks in parts.items()}
    truncated = bool(record.problems.truncated)
    metadata = {
        "keys": json.dumps(record.keys), "shard": escape_name(url),
        "samples": str(len(record.keys)), "read": str(record.read),
        "skipped": json.dumps(record.skipped), "truncated": "true" if truncated else "false",
        "source": json.dumps(source), "grid": json.dumps(list(encoder.config.grid)),
        "num_prefix_tokens": str(encoder.num_prefix_tokens if args.keep_prefix else 0),
        "model": escape_name(str(args.model)), "settings": _settings(args), "complete": "true",
    }
    write_safetensors(tensors, path, metadata=metadata)
    return record


def _warn(message: str) -> None:
    tqdm.write(f"vlm-vit encode: warning: {message}", file=sys.stderr)


def _warn_about_shard_folders(shards: list[str]) -> None:
    """Reads the `dataset.json` of each folder of local shards, which warns (logging) of a
    folder a killed `vlm-vit shards` left, naming what is missing."""
    first: dict[Path, str] = {}
    for url in shards:
        if not url.startswith(URL_PREFIXES):
            first.setdefault(Path(url).parent, url)
    for url in first.values():
        read_dataset_index([url])


def run_shards(args: argparse.Namespace) -> int:
    """Tar shards: one output per shard in the folder -o, this process's share of them."""
    if args.native_resolution:
        raise ValueError("--native-resolution is for images and folders; tar shards are "
                         "encoded at the model's image size (drop --native-resolution)")
    shards = expand_shards(list(args.inputs))
    _check_output_folder(args, shards)
    outputs = _output_paths(shards, args.out)
    rank, world = distributed.launched_rank_and_world()
    local_rank = distributed.launched_local_rank()
    if world > 1 and args.device == "cuda" and local_rank is not None:
        args.device = f"cuda:{local_rank}"
    lock = _lock_output(args.out, rank)  # before anything in OUT is read or removed
    try:
        return _encode_shards(args, shards, outputs, rank, world)
    finally:
        lock.release()


def _encode_shards(args: argparse.Namespace, shards: list[str], outputs: list[Path],
                   rank: int, world: int) -> int:
    """This process's share of the shards, with OUT locked."""
    if rank == 0:
        _warn_about_shard_folders(shards)
    mine = rank_shards(shards, rank, world)
    settings = _settings(args)
    digests: dict[Path, str | None] = {}
    sources = {i: _shard_source(shards[i], digests) for i in mine}
    changed: list[str] = []
    todo = [i for i in mine if not _is_complete(outputs[i], shards[i], str(args.model),
                                                 settings, sources[i], changed)]
    for line in changed[:5]:
        _warn(f"{line}; encoding it again")
    if len(changed) > 5:
        _warn(f"and {len(changed) - 5} more shards changed since they were encoded; encoding "
              "them again")
    complete = len(mine) - len(todo)
    args.out.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(args.out, [outputs[i] for i in mine])
    written = images = skipped = 0
    if todo:
        encoder, processor, layers, names = prepare_encoder(args)
        label = "encoding shards" + (f" (rank {rank} of {world})" if world > 1 else "")
        with tqdm(total=len(mine), initial=complete, desc=label, unit="shard",
                  disable=args.quiet or rank != 0) as progress:
            progress.set_postfix(images=0)
            for index in todo:
                record = _encode_shard(args, shards[index], index, outputs[index], encoder,
                                       processor, layers, names, sources[index])
                written, images = written + 1, images + len(record.keys)
                skipped += len(record.skipped)
                for url, read, error in record.problems.truncated:
                    _warn(f"shard {escape_name(url)} is truncated after {read} samples "
                          f"({error}); encoded the {len(record.keys)} images read, in "
                          f"{outputs[index]}")
                if record.skipped:
                    shown = "; ".join(f"{s['key']}: {s['reason']}" for s in record.skipped[:3])
                    more = len(record.skipped) - 3
                    _warn(f"skipped {len(record.skipped)} samples of shard "
                          f"{escape_name(shards[index])} "
                          f"({shown}{f'; and {more} more' if more > 0 else ''})")
                progress.set_postfix(images=images, refresh=False)
                progress.update(1)
    if rank == 0:
        where = f"rank 0 of {world}: " if world > 1 else ""
        print(f"{where}wrote {written} shards ({images} images) to {args.out} ({complete} "
              f"already complete, {skipped} skipped samples)")
    return 0


