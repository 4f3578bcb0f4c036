"""Hostile and corrupt files (issue 19): shard names that leave the checkpoint, headers that
declare more than the file holds, JSON that nests without end, and weights changed after they
were written (the manifest)."""

from __future__ import annotations

import hashlib
import io
import json
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from vlm_vit import VisionEncoder, load_encoder
from vlm_vit.io.files import read_json, read_npz, read_safetensors, write_safetensors
from vlm_vit.io.integrity import MANIFEST_NAME, VERIFY_ENV
from vlm_vit.io.loading import read_tensors
from vlm_vit.io.weights import SHARD_INDEX, read_sharded
from vlm_vit.testing import flip_bytes, put_in_hub_cache

from .conftest import tiny_config


@pytest.fixture
def encoder() -> VisionEncoder:
    torch.manual_seed(0)
    return VisionEncoder(tiny_config(depth=2)).eval()


def same_weights(a: VisionEncoder, b: VisionEncoder) -> bool:
    return all(torch.equal(t, b.state_dict()[k]) for k, t in a.state_dict().items())


# -- 1. nothing is read from outside the checkpoint directory ---------------------------------


def sharded(encoder: VisionEncoder, directory: Path) -> tuple[Path, dict]:
    encoder.save_pretrained(directory, max_shard_size="20KB", model_card=False)
    index = directory / SHARD_INDEX
    return index, json.loads(index.read_text())


@pytest.mark.parametrize("entry", ["../../outside/x.safetensors", "ABSOLUTE",
                                   "../../../../etc/passwd", "config.json", "model.bin"])
def test_an_index_entry_outside_the_directory_or_not_safetensors_is_refused(tmp_path, encoder,
                                                                            entry):
    outside = tmp_path / "outside" / "x.safetensors"
    outside.parent.mkdir()
    write_safetensors(encoder.state_dict(), outside)
    checkpoint = tmp_path / "a" / "b" / "ckpt"
    index_path, index = sharded(encoder, checkpoint)
    if entry == "ABSOLUTE":
        entry = str(outside)
    if entry == "model.bin":
        (checkpoint / entry).write_bytes(outside.read_bytes())
    tensor = sorted(index["weight_map"])[0]
    index["weight_map"][tensor] = entry
    index_path.write_text(json.dumps(index))
    for read in (read_sharded, load_encoder, VisionEncoder.from_pretrained):
        with pytest.raises(ValueError) as error:
            read(checkpoint)
        message = str(error.value)
        assert str(index_path) in message and tensor in message and entry in message, message


@pytest.mark.parametrize("weight_map", [["model-00001-of-00002.safetensors"], {"a": 3}, {},
                                        "model.safetensors", None])
def test_an_index_of_the_wrong_shape_is_one_error_naming_it(tmp_path, encoder, weight_map):
    index_path, index = sharded(encoder, tmp_path / "ckpt")
    index["weight_map"] = weight_map
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="weight_map") as error:
        read_sharded(tmp_path / "ckpt")
    assert str(index_path) in str(error.value)


def test_a_shard_that_is_a_symlink_out_of_the_directory_is_refused(tmp_path, encoder):
    index_path, index = sharded(encoder, tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / sorted(set(index["weight_map"].values()))[0]
    elsewhere = tmp_path / "elsewhere.safetensors"
    shard.rename(elsewhere)
    shard.symlink_to(elsewhere)
    with pytest.raises(ValueError, match="outside") as error:
        read_sharded(tmp_path / "ckpt")
    assert shard.name in str(error.value) and str(index_path) in str(error.value)


def test_shards_linked_into_the_hub_cache_blobs_still_load(tmp_path, encoder):
    sharded(encoder, tmp_path / "ckpt")
    snapshot = put_in_hub_cache(tmp_path / "cache", "org/tiny", tmp_path / "ckpt")
    assert any(p.is_symlink() for p in snapshot.iterdir())
    assert same_weights(load_encoder(snapshot), encoder)


# -- 2. a small file cannot exhaust memory or hang -------------------------------------------


def npy_header(descr: str, shape: tuple[int, ...], fortran: bool = False) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": descr, "fortran_order": fortran, "shape": shape})
    return buffer.getvalue()


def test_an_npz_declaring_a_37_gib_array_is_refused_before_allocating(tmp_path):
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("params/embedding/kernel.npy", npy_header("<f4", (100_000, 100_000)))
    assert path.stat().st_size < 400
    for read in (read_npz, read_tensors, load_encoder):
        with pytest.raises(ValueError, match="declares") as error:
            read(path)
        assert str(path) in str(error.value) and "params/embedding/kernel" in str(error.value)


def test_an_npz_member_whose_zip_entry_lies_about_its_size_is_refused(tmp_path):
    path = tmp_path / "liar.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("w.npy", npy_header("<f4", (1_000_000_000,)))
    data = bytearray(path.read_bytes())
    central = data.index(b"PK\x01\x02")
    struct.pack_into("<I", data, central + 24, 4_000_000_000)  # uncompressed size
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="w") as error:
        read_npz(path)
    assert str(path) in str(error.value)


def lying_npz(path: Path, compression: int, count: int, *, file_size: int,
              compress_size: int | None = None) -> Path:
    """An .npz whose one member, the .npy header of `count` float32s and no data, has a zip
    entry claiming `file_size` bytes (and `compress_size` compressed ones, if given)."""
    with zipfile.ZipFile(path, "w", compression=compression) as archive:
        archive.writestr("w.npy", npy_header("<f4", (count,)))
    data = bytearray(path.read_bytes())
    central = data.index(b"PK\x01\x02")
    struct.pack_into("<I", data, central + 24, file_size)
    if compress_size is not None:
        struct.pack_into("<I", data, central + 20, compress_size)
    path.write_bytes(bytes(data))
    return path


COUNT = 250_000_000  # 1 GB of float32: what the zip entry would have allocated
HEADER = len(npy_header("<f4", (COUNT,)))


@pytest.mark.parametrize("compression, sizes", [
    (zipfile.ZIP_STORED, {"file_size": HEADER + 4 * COUNT}),  # stored, yet grows
    (zipfile.ZIP_DEFLATED, {"file_size": HEADER + 4 * COUNT}),  # a 10^7-fold inflation
    (zipfile.ZIP_STORED, {"file_size": HEADER + 4 * COUNT,
                          "compress_size": HEADER + 4 * COUNT}),  # more than the file holds
], ids=["stored", "inflation", "compressed-size"])
def test_a_zip_entry_that_claims_the_header_s_bytes_is_refused_before_allocating(
        tmp_path, compression, sizes):
    # The array's header and its zip entry agree, so only the entry's own check (against
    # its compressed size and the archive's) stands between the file and the allocation.
    import tracemalloc

    path = lying_npz(tmp_path / "liar.npz", compression, COUNT, **sizes)
    assert path.stat().st_size < 400
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as error:
            read_npz(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10_000_000, error.value  # numpy reports its buffers to tracemalloc
    assert "its zip entry claims" in str(error.value)
    assert str(path) in str(error.value) and "'w'" in str(error.value)


def test_an_npz_object_array_is_refused_naming_it(tmp_path):
    path = tmp_path / "objects.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("evil.npy", npy_header("|O", (1,)) + b"\x80\x04N.")
    with pytest.raises(ValueError, match="object") as error:
        read_npz(path)
    assert str(path) in str(error.value) and "evil" in str(error.value)


def test_a_well_formed_npz_reads_exactly(tmp_path):
    arrays = {"a/b": np.arange(12, dtype=np.float32).reshape(3, 4),
              "fortran": np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
              "big_endian": np.arange(5, dtype=">i4"), "empty": np.zeros((0, 3), np.float16),
              "scalar": np.array(3.5, np.float32)}
    for save in (np.savez, np.savez_compressed):
        save(path := tmp_path / f"{save.__name__}.npz", **arrays)
        read = read_npz(path)
        assert read.keys() == arrays.keys()
        for name, array in arrays.items():
            assert read[name].shape == array.shape, name
            assert np.array_equal(read[name].numpy(), array), name


def safetensors_file(path: Path, header: dict, data: bytes, declared: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if declared is None else declared) + raw + data)
    return path


@pytest.mark.parametrize(("declared", "message"), [(10**6, "header of 1000000 bytes"),
                                                   (2**62, "header of"), (0, "header of 0 bytes")])
def test_a_safetensors_header_longer_than_the_file_is_refused(tmp_path, declared, message):
    path = safetensors_file(tmp_path / "w.safetensors",
                            {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                            bytes(8), declared)
    for read in (read_safetensors, read_tensors):
        with pytest.raises(ValueError, match=message) as error:
            read(path)
        assert str(path) in str(error.value)


@pytest.mark.parametrize(("entry", "message"), [
    ({"dtype": "F32", "shape": [1000, 1000], "data_offsets": [0, 4_000_000]}, "outside"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}, r"shape \[4\] x F32 needs 16"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "data_offsets"),
    ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "shape"),
    ({"dtype": "X99", "shape": [2], "data_offsets": [0, 8]}, "dtype"),
    ({"dtype": "F32", "shape": [2]}, "data_offsets"),
])
def test_a_safetensors_tensor_outside_the_file_or_of_the_wrong_size_is_refused(
        tmp_path, entry, message):
    path = safetensors_file(tmp_path / "w.safetensors", {"w": entry}, bytes(8))
    with pytest.raises(ValueError, match=message) as error:
        read_safetensors(path)
    assert str(path) in str(error.value) and "'w'" in str(error.value)


def test_a_well_formed_safetensors_file_still_reads(tmp_path):
    tensors = {"a": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
               "b": torch.zeros(0, 4), "c": torch.tensor(True)}
    write_safetensors(tensors, tmp_path / "w.safetensors", metadata={"k": "v"})
    read = read_safetensors(tmp_path / "w.safetensors")
    assert all(torch.equal(read[k], t) for k, t in tensors.items())


def test_json_nested_200000_deep_is_a_value_error_naming_the_file(tmp_path, encoder):
    encoder.save_pretrained(tmp_path / "tiny", model_card=False)
    config = tmp_path / "tiny" / "config.json"
    config.write_text("[" * 200_000 + "]" * 200_000)
    for read in (read_json, lambda p: load_encoder(p.parent)):
        with pytest.raises(ValueError, match="nested") as error:
            read(config)
        assert str(config) in str(error.value)


def test_json_nested_past_the_bound_is_refused_and_within_it_reads(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"a": ' + "[" * 300 + "]" * 300 + "}")
    with pytest.raises(ValueError, match="nested more than 200"):
        read_json(deep)
    fine = tmp_path / "fine.json"
    fine.write_text('{"a": ' + "[" * 150 + "]" * 150 + ', "b": "[[[[["}')
    assert read_json(fine)["b"] == "[[[[["


def test_an_oversized_json_file_is_refused_before_reading(tmp_path):
    path = tmp_path / "config.json"
    with path.open("wb") as handle:
        handle.truncate(65 * 2**20)  # sparse: no disk used
    with pytest.raises(ValueError, match="MB") as error:
        read_json(path)
    assert str(path) in str(error.value)


# -- 4. corruption is detected, never used silently ------------------------------------------


def tensor_data_start(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def test_save_pretrained_writes_a_manifest_of_the_weight_hashes(tmp_path, encoder):
    encoder.save_pretrained(tmp_path / "tiny")
    manifest = json.loads((tmp_path / "tiny" / MANIFEST_NAME).read_text())
    assert manifest["format"] == "vlm-vit-manifest" and manifest["version"] == 1
    weights = tmp_path / "tiny" / "model.safetensors"
    assert manifest["files"] == {"model.safetensors": {
        "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        "size": weights.stat().st_size}}
    sharded(encoder, tmp_path / "sharded")
    listed = json.loads((tmp_path / "sharded" / MANIFEST_NAME).read_text())["files"]
    on_disk = {p.name for p in (tmp_path / "sharded").glob("model*.safetensors*")}
    assert set(listed) == on_disk - {SHARD_INDEX}  # the shards: a wrong index is refused anyway


def test_flipped_bytes_in_the_weights_are_refused_naming_the_file(tmp_path, encoder,
                                                                  monkeypatch):
    encoder.save_pretrained(tmp_path / "tiny")
    weights = tmp_path / "tiny" / "model.safetensors"
    flip_bytes(weights, tensor_data_start(weights) + 100, 10)
    for load in (load_encoder, VisionEncoder.from_pretrained):
        with pytest.raises(ValueError, match="does not match its manifest hash") as error:
            load(tmp_path / "tiny")
        assert str(weights) in str(error.value) and "verify=False" in str(error.value)
    for load in (load_encoder, VisionEncoder.from_pretrained):
        assert not same_weights(load(tmp_path / "tiny", verify=False), encoder)
    monkeypatch.setenv(VERIFY_ENV, "0")
    assert not same_weights(load_encoder(tmp_path / "tiny"), encoder)
    with pytest.raises(ValueError, match="manifest hash"):  # an explicit True wins
        load_encoder(tmp_path / "tiny", verify=True)


def test_a_flipped_shard_is_refused_naming_it(tmp_path, encoder):
    _, index = sharded(encoder, tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / sorted(set(index["weight_map"].values()))[-1]
    flip_bytes(shard, tensor_data_start(shard) + 4, 10)
    with pytest.raises(ValueError, match="does not match its manifest hash") as error:
        load_encoder(tmp_path / "ckpt")
    assert shard.name in str(error.value)
    assert not same_weights(load_encoder(tmp_path / "ckpt", verify=False), encoder)


def test_a_directory_without_a_manifest_loads_as_before(tmp_path, encoder):
    encoder.save_pretrained(tmp_path / "tiny")
    (tmp_path / "tiny" / MANIFEST_NAME).unlink()
    assert same_weights(load_encoder(tmp_path / "tiny"), encoder)
    assert same_weights(VisionEncoder.from_pretrained(tmp_path / "tiny"), encoder)


@pytest.mark.parametrize("manifest", ['{"format": "other", "version": 1, "files": {}}',
                                      '{"format": "vlm-vit-manifest", "version": 1, '
                                      '"files": {"model.safetensors": {"sha256": 5}}}',
                                      '[1, 2]'])
def test_a_malformed_manifest_is_an_error_naming_it(tmp_path, encoder, manifest):
    encoder.save_pretrained(tmp_path / "tiny")
    (tmp_path / "tiny" / MANIFEST_NAME).write_text(manifest)
    with pytest.raises(ValueError, match=MANIFEST_NAME):
        load_encoder(tmp_path / "tiny")
    assert same_weights(load_encoder(tmp_path / "tiny", verify=False), encoder)
