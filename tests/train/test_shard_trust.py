"""Hostile and broken tar shards (issue 26): members over the size bound, duplicated
members, huge brace patterns, odd names, a bad dataset.json, an unfinished folder, and the
sample log recording only what was trained on."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tarfile
import time
from pathlib import Path

import pytest

from tests.train.test_tar_shards import _png, decode, write_broken_shards
from tests.train.toy import Interrupted, config, toy_objective, write_shards
from vlm_vit.data.shards import reader, spec
from vlm_vit.data.shards.reader import ShardProblems, escape_name, iter_samples, unescape_name
from vlm_vit.data.shards.spec import expand_shards, read_dataset_index
from vlm_vit.data.shards.stream import ShardStream
from vlm_vit.train import Trainer
from vlm_vit.train.metrics import read_sample_log

pytest.importorskip("webdataset")


def write_tar(path: Path, members: list[tuple[str, bytes]], mode: str = "w") -> Path:
    """A tar (GNU format, so names are stored as their bytes) of (name, data) members."""
    with tarfile.open(path, mode, format=tarfile.GNU_FORMAT) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("mode", ["w", "w:gz"], ids=["tar", "tar.gz"])
def test_a_member_declaring_more_than_the_bound_is_skipped_unread_by_name(
        tmp_path, monkeypatch, caplog, mode):
    monkeypatch.setattr(reader, "MAX_MEMBER_BYTES", 5000)
    image = _png()
    assert len(image) < 5000
    name = "s.tar" if mode == "w" else "s.tar.gz"
    shard = write_tar(tmp_path / name, [("a.png", image), ("b.png", bytes(6000)),
                                        ("b.cls", b"1"), ("c.png", image)], mode)
    problems = ShardProblems()
    read = {s.key: sorted(s.fields) for s in iter_samples([str(shard)], problems)}
    assert read == {"a": ["png"], "b": ["cls"], "c": ["png"]}
    assert problems.truncated == []
    assert [(url, member) for url, member, _ in problems.members] == [(str(shard), "b.png")]
    assert "6,000 bytes" in problems.members[0][2]
    assert f"{shard}: skipping member b.png" in caplog.text


def test_a_duplicated_member_is_skipped_by_name_and_the_shard_read_on(tmp_path, caplog):
    image = _png()
    shard = write_tar(tmp_path / "d.tar", [("a.png", image), ("a.cls", b"1"),
                                           ("a.png", b"second"), ("b.png", image),
                                           ("c.png", image)])
    problems = ShardProblems()
    read = {s.key: s.fields for s in iter_samples([str(shard)], problems)}
    assert list(read) == ["a", "b", "c"]
    assert read["a"]["png"] == image  # the first copy is kept
    assert [(member, reason) for _, member, reason in problems.members] == \
        [("a.png", "a duplicate of an earlier member of the same sample")]
    assert "a.png" in caplog.text and problems.truncated == []


def test_a_brace_pattern_beyond_the_bound_is_refused_before_expanding(tmp_path, monkeypatch):
    monkeypatch.setattr(spec, "MAX_SHARDS", 10)
    with pytest.raises(ValueError, match=r"shard spec .*\{00\.\.19\}.* up to 20 shards, more "
                                         r"than the 10"):
        expand_shards(f"{tmp_path}/{{00..19}}.tar")
    with pytest.raises(ValueError, match=r"up to 12 shards"):  # nested: a bound, not a count
        expand_shards(f"{tmp_path}/{{a,b{{0..5}}}}.tar")
    monkeypatch.undo()
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"1,000,000,000 shards"):
        expand_shards(f"{tmp_path}/{{000000000..999999999}}.tar")
    with pytest.raises(ValueError, match="more than"):
        expand_shards(f"pipe:cat {tmp_path}/{{0..999}}{{0..999}}{{0..999}}.tar")
    assert time.perf_counter() - start < 1


@pytest.mark.parametrize(("field", "value"), [("classes", 5), ("classes", [1, 2]),
                                              ("shards", {"name": "x"}), ("shards", [3])])
def test_a_malformed_dataset_json_is_one_error_naming_the_file_and_field(
        tmp_path, field, value):
    shards = write_shards(tmp_path, 1, 2)
    index = {"format": "vlm-vit-shards", "version": 1, "kind": "classes",
             "classes": ["a", "b"], "shards": [{"name": "shard-00.tar", "samples": 2}]}
    (tmp_path / "dataset.json").write_text(json.dumps({**index, field: value}))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'dataset.json'}: '{field}' must be"):
        read_dataset_index(sorted(shards))


def test_an_unfinished_shard_folder_is_named_with_what_is_missing(tmp_path, caplog):
    source = write_shards(tmp_path / "source", 2, 2)
    folder = tmp_path / "unfinished"
    folder.mkdir()
    for number, path in enumerate(sorted(source)):
        shutil.copy(path, folder / f"{number:05d}.tar")
    (folder / ".00002.tar.tmp").write_bytes(b"half a shard")
    with caplog.at_level(logging.WARNING):
        assert read_dataset_index(expand_shards(folder)) is None
    assert f"{folder} holds .00002.tar.tmp" in caplog.text
    assert "no dataset.json" in caplog.text

    caplog.clear()
    (folder / ".00002.tar.tmp").unlink()
    (folder / "dataset.json").write_text(json.dumps({
        "format": "vlm-vit-shards", "version": 1, "kind": "images", "classes": None,
        "shards": [{"name": f"{n:05d}.tar", "samples": 2} for n in range(3)]}))
    with caplog.at_level(logging.WARNING):
        read_dataset_index(expand_shards(folder))
    assert "00002.tar" in caplog.text and "missing" in caplog.text
    caplog.clear()
    shutil.copy(folder / "00000.tar", folder / "00002.tar")
    with caplog.at_level(logging.WARNING):
        read_dataset_index(expand_shards(folder))  # whole: nothing to say
    assert caplog.text == ""


def test_names_are_escaped_reversibly_onto_one_printable_line():
    for name in ["plain/key", "a\nb", "tab\there", "back\\slash", "\udcff\udcfe", "é ü",
                 "\x85next\u2028line", "cr\r"]:
        escaped = escape_name(name)
        assert "\n" not in escaped and "\t" not in escaped and "\r" not in escaped
        escaped.encode("utf-8")  # writable as UTF-8
        assert unescape_name(escaped) == name
    assert escape_name("é ü") == "é ü"


def test_odd_member_and_shard_names_survive_the_sample_log_and_its_resume(tmp_path):
    image = _png()
    folder = tmp_path / "odd"
    folder.mkdir()
    shard = folder / os.fsdecode(b"\xff-shard.tar")
    names = ["new\nline", os.fsdecode(b"bad-\xfe"), "tab\tkey", "plain"]
    write_tar(shard, [(f"{name}.png", image) for name in names])
    assert [s.key for s in iter_samples([str(shard)])] == names

    steps = dict(steps=3, batch_size=2, checkpoint_every=1, log_samples=True)
    Trainer(toy_objective(), ShardStream([str(shard)], decode(), seed=0), config(**steps),
            tmp_path / "whole", progress=False).fit()
    with pytest.raises(Interrupted):
        Trainer(toy_objective(crash_at_call=3), ShardStream([str(shard)], decode(), seed=0),
                config(**steps), tmp_path / "run", progress=False).fit()
    Trainer(toy_objective(), ShardStream([str(shard)], decode(), seed=0), config(**steps),
            tmp_path / "run", progress=False).fit(resume=True)
    log = read_sample_log(tmp_path / "run")
    assert log == read_sample_log(tmp_path / "whole") and len(log) == 6
    assert {key for _, _, _, key in log} == set(names)
    assert {shard_name for _, _, shard_name, _ in log} == {str(shard)}


def test_the_sample_log_holds_only_the_samples_trained_on(tmp_path):
    good, bad, _ = write_broken_shards(tmp_path)
    stream = ShardStream([good, bad], decode(), shuffle=False)
    result = Trainer(toy_objective(), stream, config(steps=2, checkpoint_every=0,
                                                     log_samples=True),
                     tmp_path / "run", progress=False).fit()
    assert result.undecodable_paths == [f"{bad}:garbage"]
    keys = [key for _, _, _, key in read_sample_log(tmp_path / "run")]
    assert "garbage" not in keys and "caption-only" not in keys
    assert {"fine", "also-fine"} <= set(keys)
    assert len(keys) == 2 * 4 - 1  # two batches of 4 drawn, one sample undecodable
