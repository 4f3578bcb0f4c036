"""`vlm-vit encode`: images to a safetensors file of tokens, or tar shards to one file each.

Images and folders give one file, `-o out.safetensors`: `tokens` [N, T, D] (or one `layer_K`
per --layer) in file order, the file paths in the metadata `files`; a saved `TappedTower`'s
taps each as `tap_NAME` (its pooler's output, from the same encoder run).

Tar shards give one file per shard: see `vlm_vit.cli.encode_shards`.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from vlm_vit.cli.common import check_output_apart
from vlm_vit.commands import dtype_name
from vlm_vit.presets import ENCODE_DTYPES, NORMALIZATION

if TYPE_CHECKING:  # torch and the model load when the command runs, not for --help
    from vlm_vit.model import VisionEncoder
    from vlm_vit.processor import ImageProcessor

logger = logging.getLogger(__name__)

def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "encode", help="encode images to a safetensors file of tokens (tar shards: one file "
        "per shard)",
        description="Encode images (files or folders, searched recursively) and write their "
        "tokens to a safetensors file: `tokens` [images, tokens, width] after the final norm, "
        "or one `layer_K` tensor per --layer (raw block outputs, as hidden_states[K]), and "
        "for a saved TappedTower one `tap_NAME` per tap. "
        "WebDataset tar shards (a brace pattern such as dir/{00000..00007}.tar, a glob, a "
        "folder of tars, a pipe: URL, or several) are encoded one output per shard: -o is a "
        "folder and gets OUT/<shard name>.safetensors, whose row i is the sample keys[i] "
        "(the metadata lists the samples' __key__ in shard order, and the skipped ones with "
        "their reason). Files are written whole (a temporary file, renamed); rerun the same "
        "command after a kill and the complete ones are skipped. Under torchrun (RANK, "
        "WORLD_SIZE) each process encodes its share of the shards.")
    parser.add_argument("model", metavar="MODEL", help="a checkpoint, a model name (org/name, "
                        "hf-hub:org/name, open_clip's MODEL/TAG), or a variant name together "
                        "with --random-init")
    parser.add_argument("inputs", nargs="+", metavar="IMAGE_OR_DIR_OR_SHARDS")
    parser.add_argument("-o", "--out", required=True, type=Path,
                        help="output .safetensors; for tar shards, the output folder")
    parser.add_argument("--layer", "--feature-layer", type=int, action="extend", nargs="+",
                        dest="feature_layers", metavar="K",
                        help="hidden-state indices to write, each as `layer_K` (several, or "
                        "repeated; -2 for LLaVA, -4 for InternVL). A folder a TappedTower was "
                        "saved to also gets each tap through its pooler as `tap_NAME`")
    parser.add_argument("--keep-prefix", action=argparse.BooleanOptionalAction, default=True,
                        help="keep the class and register tokens before the patch tokens "
                        "(the default; --no-keep-prefix writes the patch tokens only)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, nargs="+", metavar="SIDE",
                        help="encode at SIDE or HEIGHT WIDTH (position table resized)")
    parser.add_argument("--normalize", choices=sorted(NORMALIZATION),
                        help="mean/std preset (default: the checkpoint's processor settings)")
    parser.add_argument("--dtype", choices=sorted(ENCODE_DTYPES), default="float32",
                        type=dtype_name,
                        help="also spelled fp32, bf16, fp16; bfloat16 / float16: weights in "
                        "that dtype; int8: the block "
                        "Linears quantized to int8 (PyTorch dynamic quantization, CPU only)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda, cuda:N or mps; under torchrun, cuda means "
                        "cuda:LOCAL_RANK")
    parser.add_argument("--random-init", action="store_true",
                        help="allow a variant name: encode with random weights (for testing)")
    parser.add_argument("--native-resolution", action="store_true",
                        help="keep each image's aspect ratio and size (sides rounded to the "
                        "patch size, at most --max-tokens patches), encode packs of images "
                        "in one packed pass, and write every token end to end with "
                        "`lengths` and `grids` (see the README); not for tar shards")
    parser.add_argument("--max-tokens", type=int, default=4096, metavar="N",
                        help="with --native-resolution: tokens per pack (first-fit "
                        "decreasing), and so at most N minus the prefix tokens per image")
    parser.add_argument("--cache", type=Path, metavar="DIR",
                        help="reuse and store each image's outputs in this folder, keyed by "
                        "the image's bytes and everything that changes them (weights, "
                        "processor, layers, prefix, dtype, device; vlm_vit.io.encode_cache): "
                        "never stale; not with --native-resolution or tar shards")
    parser.add_argument("--cache-max-gb", type=float, metavar="GB",
                        help="with --cache: evict the least recently used entries beyond GB")
    parser.add_argument("--strict", action="store_true",
                        help="stop at the first image that cannot be decoded (default: skip "
                        "it, name it, and list it in the output's `skipped` metadata)")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar (under torchrun, rank 0 shows its own)")
    parser.set_defaults(run=run)


def find_images(inputs: list[str]) -> list[Path]:
    """Files as given, and every image file under each folder, sorted; errors name the path."""
    from vlm_vit.data.listing import IMAGE_SUFFIXES, image_files

    found: list[Path] = []
    for item in map(Path, inputs):
        if item.is_dir():
            files = image_files(item)
            if not files:
                raise ValueError(f"folder {item} holds no image files "
                                 f"({', '.join(sorted(IMAGE_SUFFIXES))})")
            found.extend(files)
        elif item.is_file():
            found.append(item)
        else:
            raise FileNotFoundError(f"{item} does not exist")
    return found


def _is_shard_job(inputs: list[str]) -> bool:
    """Whether the inputs are tar shards (all of them) rather than images and folders.

    Raises:
        ValueError: when some are shards and some are not.
    """
    from vlm_vit.data.source import storage

    shards = [storage(item, check_folder=False) == "shards" for item in inputs]
    if all(shards):
        return True
    if any(shards):
        raise ValueError(f"{inputs[shards.index(True)]} names tar shards but "
                         f"{inputs[shards.index(False)]} does not; encode shards and images "
                         "in separate runs")
    return False


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from vlm_vit.cli.encode_model import encode_batch, prepare_encoder
    from vlm_vit.io.files import write_safetensors

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    if _is_shard_job(args.inputs):
        if args.cache is not None:
            raise ValueError("--cache is for a folder encode, not tar shards (each shard's "
                             "output file is already kept and skipped on a rerun)")
        from vlm_vit.cli.encode_shards import run_shards

        return run_shards(args)
    if args.out.suffix != ".safetensors":
        raise ValueError(f"--out must end in .safetensors, got {args.out}")
    check_output_apart(args.out, args.model, args.inputs)
    if args.native_resolution and args.image_size:
        raise ValueError("--native-resolution keeps each image's own size; drop --image-size")
    if args.cache is not None and args.native_resolution:
        raise ValueError("--cache is for a folder encode at one size, not --native-resolution")
    from vlm_vit.io.encode_cache import open_cache

    cache = open_cache(args.cache, args.cache_max_gb)
    files = find_images(args.inputs)
    encoder, processor, layers, names = prepare_encoder(args)
    if args.native_resolution:
        if args.taps is not None:
            raise ValueError(f"{args.model} is a tapped tower: its taps are written by an "
                             "encode at one size; drop --native-resolution, or write its "
                             "layers alone with --layer from the tower's encoder")
        return _run_native(args, files, encoder, processor, layers, names)
    cached = CachedEncode(args, cache, encoder, processor, layers, names)
    collected: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    grid = None
    skipped = Skipped(args.strict)
    encoded: list[Path] = []
    batches = range(0, len(files), args.batch_size)
    with torch.inference_mode():
        for start in tqdm(batches, desc="encoding", unit="batch", disable=args.quiet):
            chunk = files[start:start + args.batch_size]
            found = cached.lookup(chunk)
            decoded = [(path, skipped.call(processor.preprocess_one, path)) for path in chunk
                       if path not in found]
            kept = [(path, pixels) for path, pixels in decoded if pixels is not None]
            if kept:
                pixels = torch.stack([pixels for _, pixels in kept])
                tensors, grid = encode_batch(args, encoder, pixels, layers, names)
                found.update(cached.store(kept, tensors, grid))
            for path in chunk:  # in the files' order, from the cache or computed
                if path in found:
                    outputs, grid = found[path]
                    for name in names:
                        collected[name].append(outputs[name][None])
                    encoded.append(path)
    skipped.check_some_left(len(encoded))
    tensors = {name: torch.cat(parts) for name, parts in collected.items()}
    metadata = {
        "files": json.dumps([str(f) for f in encoded]), "grid": json.dumps(list(grid)),
        "num_prefix_tokens": str(encoder.num_prefix_tokens if args.keep_prefix else 0),
        "model": str(args.model), "skipped": json.dumps(skipped.entries),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, args.out, metadata=metadata)
    shapes = ", ".join(f"{n} {list(t.shape)}" for n, t in tensors.items())
    print(f"wrote {len(encoded)} images to {args.out}: {shapes}{skipped.summary()}"
          f"{cached.summary()}")
    return 0


class CachedEncode:
    """The folder encode's use of `--cache` (`vlm_vit.io.encode_cache`): each image's outputs
    by its file's bytes, stored with the patch grid; without `--cache`, nothing is found and
    nothing stored."""

    GRID = "__grid__"

    def __init__(self, args: argparse.Namespace, cache, encoder, processor, layers,
                 names) -> None:
        self.cache, self.context = cache, None
        self.read: dict[Path, bytes] = {}  # the batch's missed files, read once
        if cache is None:
            return
        from vlm_vit.io.encode_cache import weights_digest

        taps = {name: [layer, args.taps.taps[name].pooler_spec,
                       weights_digest(args.taps.taps[name])]
                for name, layer in args.taps.layers.items()} if args.taps is not None else None
        self.context = self.cache.context(encoder, processor, layers=layers, names=names,
                                          keep_prefix=args.keep_prefix, dtype=args.dtype,
                                          taps=taps)

    def lookup(self, paths: list[Path]) -> dict[Path, tuple[dict, tuple[int, int]]]:
        """The images of `paths` the cache holds: path -> (outputs by name, grid)."""
        found = {}
        self.read = {}
        for path in paths if self.cache is not None else []:
            try:
                data = path.read_bytes()
            except OSError:
                continue  # unreadable: decoding names it
            hit = self.cache.get(self.context, data)
            if hit is not None:
                found[path] = (hit, tuple(hit.pop(self.GRID).tolist()))
            else:
                self.read[path] = data
        return found

    def store(self, kept, tensors, grid) -> dict[Path, tuple[dict, tuple[int, int]]]:
        """Each computed image's outputs (row i of `tensors`), stored when caching."""
        import torch

        out = {}
        for index, (path, _) in enumerate(kept):
            outputs = {name: tensor[index] for name, tensor in tensors.items()}
            out[path] = (outputs, tuple(grid))
            if self.cache is not None and path in self.read:
                self.cache.put(self.context, self.read[path],
                               {**outputs, self.GRID: torch.tensor(list(grid))})
        return out

    def summary(self) -> str:
        if self.cache is None:
            return ""
        return f"; cache {self.cache.directory}: {self.cache.hits} hit(s), " \
               f"{self.cache.misses} miss(es)"


class Skipped:
    """The images a folder encode could not decode: each is named (WARNING) and listed as
    `{"file", "reason"}` in the output's `skipped` metadata, as the shard path lists its
    samples; with `strict`, the first one is raised instead."""

    # ImageLoadError, ImageTooLargeError and the native-size bounds are all ValueErrors.
    ERRORS = (ValueError,)

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.entries: list[dict[str, str]] = []

    def call(self, function, path: Path):
        """`function(path)`, or None (logged, listed) when the image is unusable."""
        try:
            return function(path)
        except self.ERRORS as error:
            if self.strict:
                raise
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            logger.warning("skipped %s: %s", path, reason)
            self.entries.append({"file": str(path), "reason": reason})
            return None

    def check_some_left(self, encoded: int) -> None:
        """Refuses to write an output with no image in it."""
        if not encoded:
            first = self.entries[0]
            raise ValueError(f"no image could be encoded: all {len(self.entries)} were skipped "
                             f"(the first, {first['file']}: {first['reason']})")

    def summary(self) -> str:
        if not self.entries:
            return ""
        return (f"; {len(self.entries)} skipped, named above and in the metadata `skipped` "
                f"(--strict stops at the first)")


def _native_processor(processor: ImageProcessor, encoder: VisionEncoder,
                      max_tokens: int) -> ImageProcessor:
    """The checkpoint's preprocessing in native mode: no crop, sides multiples of the patch
    size, each image at most the patches a pack of `max_tokens` can hold."""
    from vlm_vit.processor import MAX_OUTPUT_PIXELS, MAX_SIDE, ImageProcessor

    patch, prefix = encoder.config.patch_size, encoder.num_prefix_tokens
    if max_tokens <= prefix:
        raise ValueError(f"--max-tokens must be more than the {prefix} prefix tokens, got "
                         f"{max_tokens}")
    most = MAX_OUTPUT_PIXELS // (patch * patch)  # patches in the encoder's largest image
    if max_tokens - prefix > most:
        raise ValueError(f"--max-tokens {max_tokens} is more than one image can have: at "
                         f"most {most + prefix} ({most} patches of {patch}x{patch}, a "
                         f"{MAX_SIDE}x{MAX_SIDE} image, plus {prefix} prefix tokens)")
    return ImageProcessor.from_dict(processor.to_dict() | {
        "resize_mode": "native", "patch_multiple": patch,
        "max_output_pixels": (max_tokens - prefix) * patch * patch})


def _planned_size(processor: ImageProcessor, path: Path, max_tokens: int) -> tuple[int, int]:
    """The size `path` is encoded at, from its header; an image that has none (too thin,
    or over the budget however it is shrunk) is named with the bounds it misses."""
    from vlm_vit.processor import ImageLoadError, ImageTooLargeError

    try:
        return processor.output_size(path)
    except (ImageLoadError, ImageTooLargeError):
        raise
    except ValueError as error:
        raise ValueError(f"{error} (--max-tokens {max_tokens} allows at most "
                         f"{processor.max_output_pixels} pixels per image, and any image an "
                         f"aspect ratio of at most {processor.max_aspect_ratio:g})") from error


def _run_native(args: argparse.Namespace, files: list[Path], encoder: VisionEncoder,
                processor: ImageProcessor, layers: list[int] | None, names: list[str]) -> int:
    """Native resolution: packs of whole images by token budget, one packed pass each; the
    output holds every image's tokens end to end, in file order, with `lengths` and `grids`."""
    import torch
    from tqdm import tqdm

    from vlm_vit.cli.encode_model import DTYPES
    from vlm_vit.io.files import write_safetensors
    from vlm_vit.train.token_budget import first_fit_decreasing, tokens_for_size

    processor = _native_processor(processor, encoder, args.max_tokens)
    prefix, patch = encoder.num_prefix_tokens, encoder.config.patch_size
    skipped = Skipped(args.strict)
    planned = [(path, skipped.call(lambda p: _planned_size(processor, p, args.max_tokens), path))
               for path in files]  # from the headers, so no image is decoded twice
    files = [path for path, size in planned if size is not None]
    skipped.check_some_left(len(files))
    lengths = [tokens_for_size(size, patch, prefix) for _, size in planned if size is not None]
    packs = first_fit_decreasing(lengths, args.max_tokens)
    per_image: dict[str, list[torch.Tensor | None]] = {name: [None] * len(files)
                                                        for name in names}
    grids: list[tuple[int, int] | None] = [None] * len(files)
    dtype = DTYPES[args.dtype]
    with torch.inference_mode(), tqdm(total=len(files), desc="encoding", unit="image",
                                      disable=args.quiet) as progress:
        for pack in packs:
            decoded = [(i, skipped.call(processor.preprocess_one, files[i])) for i in pack]
            pack = [i for i, image in decoded if image is not None]  # noqa: PLW2901
            progress.update(len(decoded) - len(pack))
            if not pack:
                continue
            pixels = [image.to(device=args.device, dtype=dtype)
                      for _, image in decoded if image is not None]
            out = encoder(pixels, feature_layers=layers)
            for name, tensor in zip(names, out.features if layers else [out.tokens],
                                    strict=True):
                for index, part in zip(pack, tensor.split(list(out.lengths)), strict=True):
                    per_image[name][index] = (part if args.keep_prefix else part[prefix:]).cpu()
            for index, grid in zip(pack, out.grids, strict=True):
                grids[index] = grid
            progress.update(len(pack))
    done = [index for index, grid in enumerate(grids) if grid is not None]  # decoded ones
    skipped.check_some_left(len(done))
    tensors = {name: torch.cat([parts[i] for i in done]) for name, parts in per_image.items()}
    kept = prefix if args.keep_prefix else 0
    tensors["lengths"] = torch.tensor([kept + r * c for r, c in (grids[i] for i in done)],
                                      dtype=torch.int64)
    tensors["grids"] = torch.tensor([grids[i] for i in done], dtype=torch.int64)
    metadata = {"files": json.dumps([str(files[i]) for i in done]), "packed": "true",
                "num_prefix_tokens": str(kept), "model": str(args.model),
                "max_tokens": str(args.max_tokens), "skipped": json.dumps(skipped.entries)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, args.out, metadata=metadata)
    shapes = ", ".join(f"{n} {list(t.shape)}" for n, t in tensors.items())
    print(f"wrote {len(done)} images in {len(packs)} packs to {args.out}: {shapes}"
          f"{skipped.summary()}")
    return 0
