"""Multi-file saves appear whole or not at all: a save killed at any point leaves the old
model or the new one (never B's config with A's weights), and the next load or save repairs
what a kill between the final renames left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlm_vit import VisionEncoder, load_encoder
from vlm_vit.io.files import MODEL_FILES, _exchange, atomic_directory, recover_directory
from vlm_vit.testing import flip_bytes

from .conftest import tiny_config

REPO = Path(__file__).resolve().parents[1]

# Saves encoder B (seed 1) over DIR, SIGKILLing itself at the moment KILL_AT names.
KILLED_SAVE = '''
import os, signal, sys, torch
import vlm_vit.io.files as files
import vlm_vit.io.weights as weights
from vlm_vit import VisionEncoder, EncoderConfig
from tests.conftest import tiny_config
where, directory = sys.argv[1], sys.argv[2]
real_weights, real_replace = weights.write_weights, os.replace
def write_weights(*args, **kwargs):  # config.json is written by now
    if where == "after-config":
        os.kill(os.getpid(), signal.SIGKILL)
    return real_weights(*args, **kwargs)
calls = []
def replace(src, dst):
    real_replace(src, dst)
    calls.append(str(dst))
    if where == "between-renames" and str(dst).endswith(".old"):
        os.kill(os.getpid(), signal.SIGKILL)  # the old folder moved aside, the new not in
weights.write_weights = write_weights
import vlm_vit.io.native as native
native.write_weights = write_weights
os.replace = replace
if where == "between-renames":
    files._exchange = lambda a, b: False  # the two-rename path some file systems need
torch.manual_seed(1)
VisionEncoder(tiny_config()).save_pretrained(directory)
'''


def save_killed(where: str, directory: Path) -> int:
    done = subprocess.run([sys.executable, "-c", KILLED_SAVE, where, str(directory)],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    return done.returncode


def encoder(seed: int) -> VisionEncoder:
    torch.manual_seed(seed)
    return VisionEncoder(tiny_config())


def same_weights(a: VisionEncoder, b: VisionEncoder) -> bool:
    return all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())


def test_a_save_killed_after_its_config_leaves_the_old_model_whole(tmp_path):
    directory = tmp_path / "model"
    old = encoder(0)
    old.save_pretrained(directory)
    assert save_killed("after-config", directory) == -9
    assert same_weights(load_encoder(directory), old)  # A's config and A's weights
    hidden = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert hidden and all(name.endswith(".tmp") for name in hidden)  # the dead writer's
    encoder(2).save_pretrained(directory)  # the next save removes what the kill left
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_save_killed_between_the_renames_is_finished_by_the_next_load(tmp_path):
    directory = tmp_path / "model"
    encoder(0).save_pretrained(directory)
    assert save_killed("between-renames", directory) == -9
    assert not directory.exists()  # only the hidden copies are left
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".new", ".old"]
    loaded = load_encoder(directory)  # puts the finished new folder in place
    assert same_weights(loaded, encoder(1))
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_with_only_the_old_copy_left_the_next_save_rolls_back_first(tmp_path):
    directory = tmp_path / "model"
    encoder(0).save_pretrained(directory)
    assert save_killed("between-renames", directory) == -9
    for new in tmp_path.glob(".*.new"):  # as if killed before the new folder was finished
        new.rename(new.with_suffix(".tmp"))
    recover_directory(directory)
    assert same_weights(load_encoder(directory), encoder(0))
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_save_over_a_folder_keeps_the_user_s_files_and_drops_the_old_model_s(tmp_path):
    directory = tmp_path / "model"
    encoder(0).save_pretrained(directory, max_shard_size=20_000)  # several shards
    assert len(list(directory.glob("model-*.safetensors"))) > 1
    (directory / "notes.txt").write_text("mine")
    (directory / "README.md").write_text("my own card")
    (directory / "runs").mkdir()
    (directory / "runs" / "log.txt").write_text("kept")
    encoder(1).save_pretrained(directory)  # one file now
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["README.md", "config.json", "manifest.json", "model.safetensors",
                     "notes.txt", "runs"]
    assert (directory / "README.md").read_text() == "my own card"
    assert (directory / "runs" / "log.txt").read_text() == "kept"
    assert same_weights(load_encoder(directory), encoder(1))


def test_nested_saves_fill_one_temporary_folder(tmp_path):
    from vlm_vit import VisionTower, build_pooler

    tower = VisionTower(encoder(0), build_pooler("mlp2x_gelu", in_dim=32, out_dim=16))
    with atomic_directory(tmp_path / "outer") as temp:
        tower.save_pretrained(temp / "tower")  # inside another save: straight into it
        assert sorted(p.name for p in temp.iterdir()) == ["tower"]
    assert (tmp_path / "outer" / "tower" / "pooler.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["outer"]


def test_the_swap_is_one_step_where_the_system_allows(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    if not _exchange(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")
    assert (b / "x").read_text() == "a" and not (a / "x").exists()


def test_a_tower_and_a_classifier_hash_their_own_weights_too(tmp_path):
    from vlm_vit import VisionTower, build_pooler
    from vlm_vit.adapt.finetune import ImageClassifier
    from vlm_vit.io.integrity import IntegrityError, read_manifest

    tower = VisionTower(encoder(0), build_pooler("mlp2x_gelu", in_dim=32, out_dim=16))
    tower.save_pretrained(tmp_path / "tower")
    assert "pooler.safetensors" in read_manifest(tmp_path / "tower")
    ImageClassifier(encoder(0), num_classes=3).save_pretrained(tmp_path / "classifier")
    assert "classifier_head.safetensors" in read_manifest(tmp_path / "classifier")
    for folder, name in (("tower", "pooler.safetensors"),
                         ("classifier", "classifier_head.safetensors")):
        flip_bytes(tmp_path / folder / name, -3)  # inside the last tensor's bytes
    with pytest.raises(IntegrityError, match="pooler.safetensors does not match"):
        VisionTower.from_pretrained(tmp_path / "tower")
    with pytest.raises(IntegrityError, match="classifier_head.safetensors does not match"):
        ImageClassifier.from_pretrained(tmp_path / "classifier")


def write_save(temp: Path, content: str) -> None:
    """A save with a sub-folder and a non-JSON file, as a multimodal model writes them."""
    (temp / "config.json").write_text(f'{{"version": "{content}"}}')
    (temp / "tower").mkdir()
    (temp / "tower" / "pooler.safetensors").write_text(content)
    (temp / "chat_template.jinja").write_text(content)
    (temp / "tokenizer.model").write_text(content)


def test_a_re_save_writes_new_sub_folders_and_non_json_files(tmp_path):
    directory = tmp_path / "model"
    with atomic_directory(directory) as temp:
        write_save(temp, "first")
    with atomic_directory(directory) as temp:
        write_save(temp, "second")
    for name in ("tower/pooler.safetensors", "chat_template.jinja", "tokenizer.model",
                 "config.json"):
        assert "second" in (directory / name).read_text(), name  # the new folder wins
    assert sorted(p.name for p in (directory / "tower").iterdir()) == ["pooler.safetensors"]


def test_a_re_save_keeps_what_it_did_not_write_and_drops_the_old_model_s_entries(tmp_path):
    directory = tmp_path / "model"
    with atomic_directory(directory) as temp:
        write_save(temp, "first")
        (temp / "llm_adapter").mkdir()  # this model had an adapter; the next one has none
        (temp / "llm_adapter" / "adapter.safetensors").write_text("first")
    (directory / "notes.txt").write_text("mine")
    (directory / "runs").mkdir()
    (directory / "runs" / "log.txt").write_text("kept")
    with atomic_directory(directory, replaces=(*MODEL_FILES, "llm_adapter")) as temp:
        write_save(temp, "second")
    assert not (directory / "llm_adapter").exists()  # named as the old model's: dropped
    assert (directory / "notes.txt").read_text() == "mine"  # the user's: carried over
    assert (directory / "runs" / "log.txt").read_text() == "kept"
    assert (directory / "tower" / "pooler.safetensors").read_text() == "second"


def test_a_tower_re_saved_inside_another_save_gets_its_new_pooler(tmp_path):
    from vlm_vit import VisionTower, build_pooler

    def save(seed: int) -> VisionTower:
        torch.manual_seed(seed)
        tower = VisionTower(encoder(seed), build_pooler("mlp2x_gelu", in_dim=32, out_dim=16))
        with atomic_directory(tmp_path / "outer") as temp:
            tower.save_pretrained(temp / "tower")  # a tower saving its encoder inside
            (temp / "chat_template.jinja").write_text(f"template {seed}")
            (temp / "config.json").write_text("{}")  # as every model's save (else refused)
        return tower

    save(0)
    new = save(1)
    loaded = VisionTower.from_pretrained(tmp_path / "outer" / "tower")
    assert same_weights(loaded.encoder, new.encoder)
    assert same_weights(loaded.pooler, new.pooler)
    assert (tmp_path / "outer" / "chat_template.jinja").read_text() == "template 1"
    assert [p.name for p in tmp_path.iterdir()] == ["outer"]


def test_a_save_refuses_a_folder_of_the_user_s_own_files_and_keeps_them(tmp_path):
    """Issue 40: a save into a non-empty folder that holds no model used to drop its .json
    and .safetensors files (labels.json, features.safetensors)."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "labels.json").write_text('{"a": 1}')
    (folder / "features.safetensors").write_bytes(b"not mine to delete")
    with pytest.raises(ValueError, match="holds files but no model"):
        encoder(0).save_pretrained(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["features.safetensors", "labels.json"]
    assert (folder / "features.safetensors").read_bytes() == b"not mine to delete"
    empty = tmp_path / "empty"
    empty.mkdir()
    encoder(0).save_pretrained(empty)  # an empty folder is written
    assert same_weights(load_encoder(empty), encoder(0))


def test_a_save_never_writes_through_a_link(tmp_path):
    """Issue 40: a symlinked output replaced the link's target (and dropped its files)."""
    target = tmp_path / "elsewhere"
    encoder(0).save_pretrained(target)
    (target / "notes.json").write_text("{}")
    link = tmp_path / "link"
    link.symlink_to(target)
    before = sorted(p.name for p in target.iterdir())
    with pytest.raises(ValueError, match="is a symbolic link"):
        encoder(1).save_pretrained(link)
    assert link.is_symlink() and sorted(p.name for p in target.iterdir()) == before
    assert same_weights(load_encoder(target), encoder(0))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        encoder(1).save_pretrained(tmp_path / "file")
