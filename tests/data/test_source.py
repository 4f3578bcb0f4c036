"""Data sources: the protocol's two implementations, their state in checkpoints, and the
resume of checkpoints written before the sources owned their state."""

from __future__ import annotations

import pytest
import torch

from tests.train.test_trainer import assert_same_weights, weights
from tests.train.toy import Interrupted, config, image_folder, toy_objective, write_noise_images
from vlm_vit.data import DataSource, MapSource, ShardSource, as_source
from vlm_vit.train import Trainer, collate_images, load_checkpoint
from vlm_vit.train.checkpoint import checkpoint_path, save_checkpoint


@pytest.fixture
def data(tmp_path):
    """20 noise images: 5 batches of 4 per epoch."""
    write_noise_images(tmp_path / "data", 20)
    return tmp_path / "data"


def test_as_source_wraps_a_map_style_dataset_and_keeps_a_source(data):
    folder = image_folder(data)
    source = as_source(folder)
    assert isinstance(source, MapSource) and isinstance(source, DataSource)
    assert as_source(source) is source
    assert source.describe()["type"] == "ImageFolder"


def test_a_map_source_moves_through_epochs_and_resumes_at_any_batch(data):
    def drawn(source, count):
        batches = source.loader()
        pixels = [next(batches).batch.pixel_values for _ in range(count)]
        batches.close()
        return pixels

    whole = MapSource(image_folder(data))
    whole.configure(4, collate_images, seed=3)
    every = drawn(whole, 8)  # 5 batches per epoch: crosses into epoch 1
    assert whole.position() == (1, 3) and whole.state_dict() == {"epoch": 1, "batch_index": 3}

    first = MapSource(image_folder(data))
    first.configure(4, collate_images, seed=3)
    drawn(first, 6)
    resumed = MapSource(image_folder(data))
    resumed.configure(4, collate_images, seed=3)
    resumed.load_state_dict([first.state_dict()])
    for expected, got in zip(every[6:], drawn(resumed, 2), strict=True):
        assert torch.equal(expected, got)


def test_the_checkpoint_holds_every_rank_s_source_state(data, tmp_path):
    Trainer(toy_objective(), image_folder(data), config(steps=6), tmp_path / "run",
            progress=False).fit()
    state = load_checkpoint(checkpoint_path(tmp_path / "run", 6))
    assert state["data"] == [{"epoch": 1, "batch_index": 1}]
    assert (state["progress"]["epoch"], state["progress"]["batch_index"]) == (1, 1)


def test_a_folder_checkpoint_written_before_sources_owned_their_state_resumes_exactly(
        data, tmp_path):
    whole = toy_objective(dropout=0.3)
    uninterrupted = Trainer(whole, image_folder(data), config(steps=8), tmp_path / "whole",
                            progress=False).fit()
    run_dir = tmp_path / "interrupted"
    with pytest.raises(Interrupted):
        Trainer(toy_objective(dropout=0.3, crash_at_call=7), image_folder(data),
                config(steps=8), run_dir, progress=False).fit()
    # Rewrite the step-6 checkpoint (epoch 1, batch 1) as the trainer wrote it before: the
    # position only in "progress", no "data" entry.
    path = checkpoint_path(run_dir, 6)
    old = {k: v for k, v in load_checkpoint(path).items() if k not in ("data", "format_version")}
    save_checkpoint(old, path)
    assert "data" not in load_checkpoint(path)

    resumed_objective = toy_objective(seed=5, dropout=0.3)
    resumed = Trainer(resumed_objective, image_folder(data), config(steps=8), run_dir,
                      progress=False).fit(resume=True)
    assert resumed.losses == uninterrupted.losses
    assert_same_weights(weights(resumed_objective), weights(whole))


def test_a_shard_stream_becomes_a_shard_source(tmp_path):
    from tests.train.test_tar_shards import decode
    from tests.train.toy import write_shards
    from vlm_vit.data.shards import ShardStream

    write_shards(tmp_path, 2, 3)
    stream = ShardStream(tmp_path, decode())
    source = as_source(stream)
    assert isinstance(source, ShardSource) and source.names_samples
    with pytest.raises(ValueError, match="a shard stream has none"):
        source.configure(2, collate_images, group_by_length=True)
    source.configure(2, collate_images, world_size=1)
    with pytest.raises(ValueError, match=r"of ranks \[0, 0\]"):  # not one state per rank
        source.load_state_dict([source.state_dict()] * 2)


def test_open_source_decides_between_a_folder_and_shards_in_one_place(data, tmp_path):
    from tests.train.test_tar_shards import decode
    from tests.train.toy import write_shards
    from vlm_vit.data import open_source, storage
    from vlm_vit.data.folders import ImageFolder

    write_shards(tmp_path / "shards", 2, 3)
    assert storage(tmp_path / "shards") == "shards" and storage(data) == "folder"
    shards = open_source(tmp_path / "shards", decode(seed=4), seed=4)
    assert isinstance(shards, ShardSource) and shards.stream.seed == 4
    folder = open_source(data, decode(seed=4))
    assert isinstance(folder, MapSource) and isinstance(folder.dataset, ImageFolder)
    # The folder augments as the shard decoder does: the ImageFolder the CLI built before.
    assert folder.describe() == image_folder_like(data, seed=4).describe()
    with pytest.raises(FileNotFoundError, match="--data nowhere is neither a folder nor tar"):
        open_source("nowhere", decode(), name="--data")
    # A command that names a missing path in its own words asks without the folder check.
    assert storage("nowhere", check_folder=False) == "folder"
    assert storage(tmp_path / "shards", check_folder=False) == "shards"


def image_folder_like(root, seed):
    from vlm_vit.data.folders import ImageFolder
    from vlm_vit.processor import NORMALIZATION

    mean, std = NORMALIZATION["imagenet"]
    return MapSource(ImageFolder(root, 32, mean=mean, std=std, seed=seed))


def test_one_reader_of_rank_and_world_size(monkeypatch):
    from vlm_vit.train.distributed import launched_local_rank, launched_rank_and_world

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert launched_rank_and_world() == (0, 1) and launched_local_rank() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launched_rank_and_world() == (1, 2) and launched_local_rank() == 1
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"RANK=2 must lie in 0..WORLD_SIZE-1"):
        launched_rank_and_world()
