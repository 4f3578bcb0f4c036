"""Tar shards as a data source: specs, disjoint and complete coverage over ranks and workers,
exact resume, and bad samples and shards skipped by name."""

from __future__ import annotations

import io
import logging
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.train.toy import Interrupted, config, toy_objective, write_shards
from vlm_vit.data import ShardSource
from vlm_vit.data.folders import Augmentation
from vlm_vit.data.samples import collate_images
from vlm_vit.data.shards import ImageDecode, ShardStream, expand_shards, is_shard_spec, iter_samples
from vlm_vit.processor import NORMALIZATION
from vlm_vit.train import Trainer
from vlm_vit.train.metrics import read_sample_log

MEAN, STD = NORMALIZATION["imagenet"]


def decode(seed: int = 0) -> ImageDecode:
    return ImageDecode(Augmentation(32, mean=MEAN, std=STD), seed=seed)


@pytest.fixture(scope="module")
def eight(tmp_path_factory) -> tuple[Path, dict[str, list[str]]]:
    folder = tmp_path_factory.mktemp("eight")
    return folder, write_shards(folder, 8, 5)


def keys_of(written: dict[str, list[str]]) -> list[str]:
    return [key for keys in written.values() for key in keys]


def test_a_spec_is_a_pattern_a_glob_a_list_or_a_folder_of_tars(eight, tmp_path):
    folder, written = eight
    shards = sorted(written)
    assert expand_shards(f"{folder}/shard-{{00..07}}.tar") == shards
    assert expand_shards(f"{folder}/*.tar") == shards
    assert expand_shards(folder) == shards
    assert expand_shards(shards[:2] + [f"{folder}/shard-{{05..06}}.tar"]) == \
        shards[:2] + shards[5:7]
    assert expand_shards("pipe:cat a.tar") == ["pipe:cat a.tar"]
    assert is_shard_spec(folder) and is_shard_spec(f"{folder}/shard-{{00..07}}.tar")
    assert is_shard_spec("pipe:cat a.tar") and not is_shard_spec(tmp_path)
    (tmp_path / "a.png").write_bytes(b"")
    assert not is_shard_spec(tmp_path)  # a folder of images stays a folder
    with pytest.raises(FileNotFoundError, match=r"shard .*shard-08.tar does not exist \(2 of "
                                                r"the 10"):
        expand_shards(f"{folder}/shard-{{00..09}}.tar")
    with pytest.raises(FileNotFoundError, match="no tar shards match"):
        expand_shards(f"{tmp_path}/*.tar")


def draw(stream: ShardStream, batches: int, *, rank: int = 0, world_size: int = 1,
         workers: int = 0, state: dict | None = None):
    """`batches` StreamBatches of 2 from a real DataLoader (worker processes when asked),
    and the state after them."""
    current = stream.configure(2, collate_images, rank=rank, world_size=world_size,
                               workers=workers, state=state)
    drawn = []
    for batch in stream.loader():
        current.advance(batch)
        drawn.append(batch)
        if len(drawn) == batches:
            break
    return drawn, current


@pytest.mark.parametrize(("world_size", "workers"), [(1, 0), (2, 2), (3, 2)])
def test_ranks_and_workers_read_disjoint_shards_and_every_sample_once_per_epoch(
        eight, world_size, workers):
    _, written = eight
    stream = ShardStream(sorted(written), decode(), seed=1)
    epochs: dict[int, Counter] = {}
    slots_shards: dict[tuple[int, int], set[str]] = {}
    for rank in range(world_size):
        # 40 samples, batches of 2: 3 epochs' worth over the ranks, whatever the split.
        drawn, _ = draw(stream, 60 // world_size, rank=rank, world_size=world_size,
                        workers=workers)
        for batch in drawn:
            assert len(batch.batch.pixel_values) == 2
            for epoch, shard, key in batch.samples:
                epochs.setdefault(epoch, Counter())[key] += 1
                slots_shards.setdefault((epoch, shard), set()).add((rank, batch.role))
    everything = Counter(keys_of(written))
    for epoch in (0, 1):  # complete on every rank and worker by now
        assert epochs[epoch] == everything, epoch
    assert max(epochs[2].values()) == 1  # the epoch under way repeats nothing either
    # A shard is read by one worker of one rank per epoch.
    assert all(len(readers) == 1 for readers in slots_shards.values())
    if workers:
        assert len({r for readers in slots_shards.values() for r in readers}) == \
            world_size * workers
    # The shard order differs between epochs (seeded by seed and epoch).
    assert stream.shard_order(0) != stream.shard_order(1)
    assert sorted(stream.shard_order(0)) == list(range(8))


def test_a_resumed_stream_continues_with_no_sample_repeated_or_skipped(eight):
    _, written = eight
    stream = ShardStream(sorted(written), decode(), seed=2, shuffle_block=3)
    whole, _ = draw(stream, 14, workers=2)
    first, state = draw(stream, 5, workers=2)
    rest, _ = draw(stream, 9, workers=2, state=state.to_dict())
    assert [b.samples for b in first + rest] == [b.samples for b in whole]
    for a, b in zip(first + rest, whole, strict=True):
        assert torch.equal(a.batch.pixel_values, b.batch.pixel_values)
    with pytest.raises(ValueError, match="read with workers 2; this run has workers 3"):
        stream.configure(2, collate_images, workers=3, state=state.to_dict())


def test_shards_train_and_resume_bit_exactly_with_workers(eight, tmp_path):
    """The trainer's resume test on shards: killed after a checkpoint, resumed, equal."""
    _, written = eight
    # A checkpoint at step 3: an odd number of batches, so the resumed loader must rotate
    # its two workers to continue in order.
    steps = dict(steps=7, num_workers=2, log_samples=True, checkpoint_every=3)
    whole = toy_objective(dropout=0.1)
    stream = ShardStream(sorted(written), decode(), seed=0)
    Trainer(whole, stream, config(**steps), tmp_path / "whole", progress=False).fit()

    crashed = toy_objective(dropout=0.1, crash_at_call=6)
    with pytest.raises(Interrupted):
        Trainer(crashed, ShardStream(sorted(written), decode(), seed=0), config(**steps),
                tmp_path / "run", progress=False).fit()
    resumed = toy_objective(dropout=0.1)
    result = Trainer(resumed, ShardStream(sorted(written), decode(), seed=0),
                     config(**steps), tmp_path / "run", progress=False).fit(resume=True)
    assert result.step == 7
    for name, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
    assert read_sample_log(tmp_path / "run") == read_sample_log(tmp_path / "whole")
    assert len(read_sample_log(tmp_path / "whole")) == 7 * 4


def write_broken_shards(folder: Path) -> list[str]:
    """A good shard, one with a corrupt image and a sample without an image, and a
    truncated last shard."""
    import webdataset as wds

    shards = write_shards(folder, 3, 4)
    good, bad, cut = sorted(shards)
    with wds.TarWriter(bad) as writer:
        writer.write({"__key__": "fine", "png": _png()})
        writer.write({"__key__": "garbage", "png": b"this is not a PNG"})
        writer.write({"__key__": "caption-only", "txt": b"a sample with no image"})
        writer.write({"__key__": "also-fine", "png": _png()})
    data = Path(cut).read_bytes()
    Path(cut).write_bytes(data[: len(data) * 3 // 5])  # cut inside the third sample or so
    return [good, bad, cut]


def _png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (40, 48), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_bad_images_samples_without_one_and_a_truncated_shard_are_named_and_counted(
        tmp_path, caplog):
    shards = write_broken_shards(tmp_path)
    read = list(iter_samples(shards))
    truncated_read = sum(1 for s in read if s.shard == shards[2])
    assert 0 < truncated_read < 4
    assert "truncated or unreadable after" in caplog.text and shards[2] in caplog.text

    caplog.clear()
    objective = toy_objective()
    stream = ShardStream(shards, decode(), shuffle=False)
    with caplog.at_level(logging.WARNING):
        result = Trainer(objective, stream, config(steps=4, checkpoint_every=0),
                         tmp_path / "run", progress=False).fit()
    assert result.step == 4 and result.skipped_steps == 0
    assert result.undecodable_paths == [f"{shards[1]}:garbage"]
    assert result.without_image >= 1
    assert [(url, n) for url, n, _ in result.truncated_shards] == [(shards[2], truncated_read)]
    assert f"skipping {shards[1]}:garbage" in caplog.text
    assert "without an image" in caplog.text


def write_paired_shards(folder: Path, shards: int = 5, pairs: int = 3) -> list[str]:
    """Shards of (a sample without an image, then one with) pairs, in tar order: read
    unshuffled, each image drawn accounts for exactly one skipped sample, counted in the
    image's own batch, whatever the ranks, workers and resumes."""
    import webdataset as wds

    paths = []
    for shard in range(shards):
        path = folder / f"paired-{shard:02d}.tar"
        with wds.TarWriter(str(path)) as writer:
            for pair in range(pairs):
                writer.write({"__key__": f"p{shard}-{pair}-text", "txt": b"no image here"})
                writer.write({"__key__": f"p{shard}-{pair}", "png": _png()})
        paths.append(str(path))
    return paths


def draw_ranks(shards: list[str], world_size: int, workers: int, batches: int,
               states: list[dict] | None = None) -> tuple[list[dict], int]:
    """Each of `world_size` ranks (one after another, in this process) loads `states` if
    given and draws `batches` batches of 2; returns every rank's state and the skipped
    samples summed over the ranks, as the trainer sums them."""
    saved, skipped = [], 0
    for rank in range(world_size):
        source = ShardSource(ShardStream(shards, decode(), shuffle=False, shuffle_block=1))
        source.configure(2, collate_images, rank=rank, world_size=world_size, workers=workers)
        if states is not None:
            source.load_state_dict(states)
        loader = source.loader()
        for _ in range(batches):
            next(loader)
        loader.close()
        saved.append(source.state_dict())
        skipped += source.skipped()["no_image"]
    return saved, skipped


@pytest.mark.parametrize(("old", "new"), [((2, 0), (3, 0)), ((3, 0), (1, 0)),
                                          ((1, 0), (2, 2))])
def test_the_skipped_count_survives_a_resume_on_other_ranks(tmp_path, old, new):
    """Every image drawn, before and after a resume remapped onto other ranks and workers,
    accounts for one sample without an image: the count over the ranks is exact."""
    shards = write_paired_shards(tmp_path)
    states, skipped = draw_ranks(shards, *old, batches=2)
    assert skipped == old[0] * 2 * 2
    _, skipped = draw_ranks(shards, *new, batches=3, states=states)
    assert skipped == old[0] * 2 * 2 + new[0] * 3 * 2


def test_the_trainer_counts_every_skipped_sample_across_a_remapped_resume(tmp_path):
    """Through the trainer: killed after its step-3 checkpoint, resumed on two DataLoader
    workers instead of none (the stream's state remapped), `without_image` equals the
    images the run drew, one per sample without an image."""
    shards = write_paired_shards(tmp_path)
    steps = dict(steps=5, log_samples=True, checkpoint_every=3)

    def stream() -> ShardStream:
        return ShardStream(shards, decode(), shuffle=False, shuffle_block=1)

    with pytest.raises(Interrupted):
        Trainer(toy_objective(crash_at_call=5), stream(), config(**steps), tmp_path / "run",
                progress=False).fit()
    result = Trainer(toy_objective(), stream(), config(**steps, num_workers=2),
                     tmp_path / "run", progress=False).fit(resume=True)
    assert len(read_sample_log(tmp_path / "run")) == 5 * 4
    assert result.without_image == 5 * 4


@pytest.mark.slow  # test_ranks_and_workers_read_disjoint_shards... checks it in one process
@pytest.mark.parametrize(("shards", "steps"), [(8, 25), (3, 12)], ids=["8-shards", "3-uneven"])
def test_two_gloo_processes_with_two_workers_each_see_every_key_once_per_epoch(
        tmp_path, shards, steps):
    """8 shards over 2 ranks x 2 workers, and 3 (fewer shards than readers): the ranks'
    logs hold every key of each finished epoch exactly once, and nothing twice in the one
    under way. Each step draws 4 samples; the steps cover a little over two epochs."""
    import os
    import subprocess
    import sys

    from tests.train.test_distributed import REPO, free_port

    written = write_shards(tmp_path / "shards", shards, 5)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               str(REPO / "tests" / "train" / "ddp_shards_worker.py"),
               f"{tmp_path}/shards/shard-{{00..{shards - 1:02d}}}.tar", str(tmp_path / "run"),
               str(steps)]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = [read_sample_log(tmp_path / "run", rank) for rank in range(2)]
    assert [len(log) for log in logs] == [2 * steps, 2 * steps]  # 2 samples per rank-step
    epochs: dict[int, Counter] = {}
    for log in logs:
        for _, epoch, _, key in log:
            epochs.setdefault(epoch, Counter())[key] += 1
    everything = Counter(keys_of(written))
    assert epochs[0] == everything and epochs[1] == everything
    assert all(max(counts.values()) == 1 for counts in epochs.values())
    # The ranks read disjoint shards within an epoch.
    readers = {}
    for rank, log in enumerate(logs):
        for _, epoch, shard, _ in log:
            readers.setdefault((epoch, shard), set()).add(rank)
    assert all(len(ranks) == 1 for ranks in readers.values())


def test_labels_come_from_cls_or_a_json_field_and_bad_ones_are_named(tmp_path):
    from vlm_vit.data.samples import UndecodableImage
    from vlm_vit.data.shards import KeySplit, LabelledDecode, Sample, held_out
    from vlm_vit.processor import ImageProcessor

    image = _png()
    processor = ImageProcessor(size=32, mean=MEAN, std=STD)

    def sample(key, **fields):
        return Sample(key, "x.tar", 0, 0, 0, {"png": image, **fields})

    pixels, label = LabelledDecode(processor)(sample("a", cls=b"2"))
    assert label == 2 and torch.equal(pixels, processor.preprocess_one(processor.load(image)))
    assert LabelledDecode(processor, "y")(sample("b", json=b'{"y": 4}'))[1] == 4
    for fields, reason in [({}, "no class label in its cls field"),
                           ({"cls": b"two"}, "no class label"),
                           ({"cls": b"-1"}, "no class label"),
                           ({"cls": b"7"}, "class 7 is out of range for 3 classes")]:
        bad = LabelledDecode(processor, num_classes=3)(sample("c", **fields))
        assert isinstance(bad, UndecodableImage) and bad.path == "x.tar:c", fields
        assert reason in bad.reason
    assert LabelledDecode(processor)(Sample("d", "x.tar", 0, 0, 0, {"cls": b"1"})) is None
    # The held-out split: about the fraction asked, disjoint, fixed by the seed.
    keys = [f"{i:09d}" for i in range(2000)]
    test = {k for k in keys if held_out(k, 0.2, seed=0)}
    assert 0.17 < len(test) / 2000 < 0.23
    assert test != {k for k in keys if held_out(k, 0.2, seed=1)}
    train, kept = KeySplit(0.2, 0, test=False), KeySplit(0.2, 0, test=True)
    assert all(train(sample(k)) != kept(sample(k)) for k in keys[:100])
