"""Label efficiency: how well an encoder fine-tunes from k labelled examples per class.

The protocol of the paper's section 4.6 and of MAE (He et al. 2022): a pretrained encoder
and the same architecture from the same random initialisation are each fine-tuned whole,
with a zero-initialised linear head (`ImageClassifier`), by one recipe on the same labelled
examples in the same batch order, and compared on held-out images. Self-supervised ViTs are
judged this way because their frozen features (linear probes) understate them.

    recipe = FinetuneRecipe(steps=300, batch_size=50, lr=1e-3)
    accuracy = finetune_accuracy(encoder, images, labels, train_rows, test_rows, recipe,
                                 seed=0, run_dir="runs/ft")
"""

from __future__ import annotations

import copy
import hashlib
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from vlm_vit.adapt.finetune import ImageClassifier
from vlm_vit.data.samples import mixed_seed
from vlm_vit.model import VisionEncoder


@dataclass(frozen=True)
class FinetuneRecipe:
    """One fine-tuning recipe, used for every arm alike.

    Attributes:
        steps: optimizer steps.
        batch_size: images per step (small labelled sets are repeated to fill a batch).
        lr: peak learning rate (AdamW, linear warmup, cosine decay to lr / 100).
        warmup_steps: steps of linear warmup (None: a tenth of `steps`).
        weight_decay: AdamW's, on matrices only.
        layer_decay: the learning rate of block i of L is lr * layer_decay ** (L - i), the
            embeddings' lr * layer_decay ** (L + 1) (BEiT, MAE fine-tuning); 1.0 turns it off.
        shift: random translations of up to this many pixels, filled with the background
            (the smallest value of each image), a new one every epoch.
        pooling: "mean" (patch tokens) or "cls".
    """

    steps: int = 300
    batch_size: int = 50
    lr: float = 1e-3
    warmup_steps: int | None = None
    weight_decay: float = 0.05
    layer_decay: float = 1.0
    shift: int = 2
    pooling: str = "mean"

    def to_dict(self) -> dict:
        return asdict(self)


class ShiftedImages(torch.utils.data.Dataset):
    """In-memory labelled images with random shifts, repeated to at least `min_length` items.

    The shift of item i in epoch e depends on (seed, e, i) only, so two runs with the same
    seed see the same augmented batches.

    Args:
        images: `[N, C, H, W]` normalised pixels.
        labels: `[N]` class indices.
        shift: the largest translation in pixels, each axis.
        min_length: repeat the N items until there are at least this many.
        seed: the augmentation seed.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, shift: int,
                 min_length: int, seed: int) -> None:
        if len(images) != len(labels) or len(images) == 0:
            raise ValueError(f"need as many labels as images (at least one), got "
                             f"{len(images)} images and {len(labels)} labels")
        self.images, self.labels = images, labels.long()
        self.shift, self.seed, self.epoch = shift, seed, 0
        self.repeats = -(-min_length // len(images))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.images) * self.repeats

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        row = index % len(self.images)
        image = self.images[row]
        if self.shift:
            generator = torch.Generator().manual_seed(mixed_seed(self.seed, self.epoch, index))
            dy, dx = (torch.randint(-self.shift, self.shift + 1, (2,), generator=generator)
                      .tolist())
            image = translate(image, dy, dx)
        return image, int(self.labels[row])


def translate(image: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """`image` `[C, H, W]` moved by (dy, dx) pixels, the uncovered border filled with the
    image's smallest value (the background of a digit)."""
    out = torch.full_like(image, float(image.min()))
    height, width = image.shape[1:]
    source = image[:, max(0, -dy):height - max(0, dy), max(0, -dx):width - max(0, dx)]
    out[:, max(0, dy):max(0, dy) + source.shape[1],
        max(0, dx):max(0, dx) + source.shape[2]] = source
    return out


def shot_rows(labels: np.ndarray, pool: np.ndarray, shots: int | None, seed: int) -> np.ndarray:
    """`shots` rows of every class drawn from `pool` (a seeded permutation per class, as
    big_vision's few-shot sampling); None: every row of the pool."""
    if shots is None:
        return np.sort(pool)
    from vlm_vit.eval import sample_shots

    return np.sort(pool[sample_shots(labels[pool], shots, seed=seed)])


def fingerprint(module: torch.nn.Module) -> str:
    """A SHA-256 of a module's state (names, dtypes, shapes and bytes, in name order): equal
    fingerprints mean equal weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def finetune_accuracy(
    encoder: VisionEncoder,
    images: torch.Tensor,
    labels: np.ndarray,
    train_rows: np.ndarray,
    eval_rows: np.ndarray,
    recipe: FinetuneRecipe,
    *,
    seed: int,
    run_dir: str | Path | None = None,
) -> float:
    """Fine-tunes a copy of `encoder` with a zero-initialised head on `train_rows`, on the
    trainer, and returns its accuracy on `eval_rows`. `encoder` itself is not changed.

    Args:
        encoder: the starting weights.
        images: `[N, C, H, W]` normalised pixels of every row.
        labels: `[N]` class indices.
        train_rows, eval_rows: disjoint row indices.
        recipe: the recipe.
        seed: data order and augmentation.
        run_dir: where the trainer writes its run (default: a temporary folder, removed).

    Raises:
        ValueError: when the rows overlap.
    """
    from vlm_vit.train import TrainConfig, Trainer, collate_labelled

    if np.intersect1d(train_rows, eval_rows).size:
        raise ValueError("fine-tuning rows and evaluation rows overlap")
    labels = np.asarray(labels)
    num_classes = int(labels.max()) + 1
    classifier = ImageClassifier(copy.deepcopy(encoder).train(), num_classes,
                                 pooling=recipe.pooling, layer_decay=recipe.layer_decay)
    train = torch.as_tensor(train_rows)
    dataset = ShiftedImages(images[train], torch.as_tensor(labels)[train], shift=recipe.shift,
                            min_length=recipe.batch_size, seed=seed)
    config = TrainConfig(steps=recipe.steps, batch_size=recipe.batch_size, lr=recipe.lr,
                         min_lr=recipe.lr / 100,
                         warmup_steps=recipe.steps // 10 if recipe.warmup_steps is None
                         else recipe.warmup_steps,
                         weight_decay=recipe.weight_decay, betas=(0.9, 0.999),
                         checkpoint_every=0, keep_checkpoints=1, log_every=recipe.steps,
                         seed=seed, num_workers=0, device="cpu")
    temporary = run_dir is None
    folder = Path(tempfile.mkdtemp(prefix="vlm-vit-finetune-")) if temporary else Path(run_dir)
    try:
        Trainer(classifier, dataset, config, folder, collate=collate_labelled,
                progress=False).fit()
    finally:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)
    classifier.eval()
    correct = 0
    with torch.inference_mode():
        for part in torch.as_tensor(eval_rows).split(256):
            predicted = classifier(images[part]).argmax(-1)
            correct += int((predicted == torch.as_tensor(labels)[part]).sum())
    return correct / len(eval_rows)


@dataclass(frozen=True)
class FinetuneJob:
    """One fine-tuning run of `finetune_many`: a starting encoder, its labelled rows, a seed,
    and its own recipe (None: `finetune_many`'s)."""

    encoder: VisionEncoder
    train_rows: np.ndarray
    seed: int
    recipe: FinetuneRecipe | None = None


_SHARED: dict = {}  # a worker's images, labels, evaluation rows and recipe


def _start_worker(images, labels, eval_rows, recipe) -> None:
    torch.set_num_threads(1)
    _SHARED.update(images=images, labels=labels, eval_rows=eval_rows, recipe=recipe)


def _run_job(job: FinetuneJob) -> float:
    return finetune_accuracy(job.encoder, _SHARED["images"], _SHARED["labels"], job.train_rows,
                             _SHARED["eval_rows"], job.recipe or _SHARED["recipe"], seed=job.seed)


def finetune_many(jobs: list[FinetuneJob], images: torch.Tensor, labels: np.ndarray,
                  eval_rows: np.ndarray, recipe: FinetuneRecipe | None, *, workers: int = 1,
                  progress: bool = False,
                  done: Callable[[int, float], Any] | None = None) -> list[float]:
    """`finetune_accuracy` for each job, in `workers` processes of one thread each.

    Small models train no faster on two threads than on one (their matrix products are too
    small to split), so separate single-threaded runs use the cores. Every run is
    single-threaded whatever `workers` is, so results do not depend on it.

    Args:
        jobs: the runs.
        images, labels, eval_rows: as in `finetune_accuracy`, shared by the runs.
        recipe: the recipe of each job that names none.
        workers: processes (1: in this process).
        progress: show a progress bar of the finished runs.
        done: called with (the job's index, its accuracy) as each run finishes, in order:
            how a caller records results that a stopped job must not lose.

    Returns:
        The accuracies, in the order of `jobs`.
    """
    with tqdm(total=len(jobs), desc="fine-tuning", unit="run", disable=not progress) as bar:
        def tick(index: int, accuracy: float) -> None:
            bar.update()
            if done is not None:
                done(index, accuracy)

        return _run_jobs(jobs, images, labels, eval_rows, recipe, workers, tick)


def _run_jobs(jobs: list[FinetuneJob], images: torch.Tensor, labels: np.ndarray,
              eval_rows: np.ndarray, recipe: FinetuneRecipe | None, workers: int,
              tick: Callable[[int, float], Any]) -> list[float]:
    """`finetune_many`'s runs, calling `tick(index, accuracy)` after each, in order."""
    if workers <= 1:
        threads = torch.get_num_threads()
        _start_worker(images, labels, eval_rows, recipe)
        try:
            results = []
            for index, job in enumerate(jobs):
                results.append(_run_job(job))
                tick(index, results[-1])
            return results
        finally:
            torch.set_num_threads(threads)
            _SHARED.clear()
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: a forked child of a process whose thread pools are running can hang.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_start_worker,
                             initargs=(images, labels, eval_rows, recipe)) as pool:
        futures = [pool.submit(_run_job, job) for job in jobs]
        for index, future in enumerate(futures):
            tick(index, future.result())
        return [future.result() for future in futures]
