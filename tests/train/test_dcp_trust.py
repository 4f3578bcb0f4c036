"""Distributed checkpoints read from hostile or damaged files (issue 40): DCP's `.metadata`
pickle holds only DCP's metadata classes, every file it names is a plain file of the step
directory with a verified sidecar, and DCP's own read failures are one line.

The run is the 4-step toy "fsdp" run of `test_consolidate` (one rank: one `__0_0.distcp` per
checkpoint); each test damages a copy. A hostile pickle's payload would create `marker`,
so its absence shows nothing ran.
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch

from tests.train.test_consolidate import assert_bit_equal, encoder_state, live_encoder, train
from tests.train.toy import toy_objective
from vlm_vit.cli import main
from vlm_vit.io.integrity import IntegrityError, verify_sidecar, write_sidecar
from vlm_vit.train import checkpoint as ckpt
from vlm_vit.train import sharded_checkpoint
from vlm_vit.train.consolidate import consolidate

METADATA_MODULE = "torch.distributed.checkpoint.metadata"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return train(tmp_path_factory.mktemp("dcp_trust"), "fsdp")


@pytest.fixture
def run(trained, tmp_path) -> Path:
    return shutil.copytree(trained, tmp_path / "run", symlinks=True)


def step_dir(run: Path) -> Path:
    return ckpt.sharded_checkpoint_path(run, 4)


# -- hand-crafted pickles (protocol 4 opcodes) --------------------------------------------


def _text(value: str) -> bytes:
    """SHORT_BINUNICODE, or BINUNICODE for a long string."""
    data = value.encode()
    if len(data) < 256:
        return b"\x8c" + bytes([len(data)]) + data
    return b"X" + struct.pack("<I", len(data)) + data


def call_pickle(module: str, name: str, *arguments: str) -> bytes:
    """A protocol-4 pickle that calls `module`'s `name` (STACK_GLOBAL, so `name` may be
    dotted) with string `arguments`: PROTO 4, the two names, STACK_GLOBAL, MARK, the
    arguments, TUPLE, REDUCE, STOP."""
    return (b"\x80\x04" + _text(module) + _text(name) + b"\x93" + b"("
            + b"".join(_text(argument) for argument in arguments) + b"tR.")


def write_metadata(step: Path, data: bytes) -> None:
    """Replaces the checkpoint's `.metadata`, with a sidecar that matches: a sidecar proves a
    file whole, not who wrote it."""
    (step / ".metadata").write_bytes(data)
    write_sidecar(step / ".metadata")


def _hostile_cases(marker: Path) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """(module, name, arguments) of each attack; those that run create `marker`."""
    python = f"open({str(marker)!r}, 'w').close()"
    return {
        "a dotted name through the allowed module": (METADATA_MODULE, "os.system",
                                                     (f"touch {marker}",)),
        "a torch function": ("torch", "save", ("pwned", str(marker))),
        "a builtin that is not allowed": ("builtins", "exec", (python,)),
        "a class from another module": ("logging", "FileHandler", (str(marker),)),
        "another module's class through the allowed module": (METADATA_MODULE, "Enum",
                                                              ("Pwned", "a b")),
        "a function the allowed module imports": (METADATA_MODULE, "field", ()),
        "a module": (METADATA_MODULE, "os", ()),
    }


@pytest.mark.parametrize("case", list(_hostile_cases(Path("m"))))
def test_metadata_naming_anything_but_dcps_classes_is_refused_and_runs_nothing(run, tmp_path,
                                                                              case):
    marker = tmp_path / "marker"
    module, name, arguments = _hostile_cases(marker)[case]
    step = step_dir(run)
    write_metadata(step, call_pickle(module, name, *arguments))
    objective = toy_objective(seed=5)
    for read in (lambda: sharded_checkpoint.tensor_shapes(step),
                 lambda: sharded_checkpoint.load_weights(step, objective),
                 lambda: consolidate(run, tmp_path / "encoder", step=4)):
        with pytest.raises(ValueError) as error:
            read()
        message = str(error.value)
        assert "\n" not in message and len(message) < 400, message
        assert str(step / ".metadata") in message and f"{module}.{name}" in message, message
        assert not marker.exists(), case
    assert not (tmp_path / "encoder").exists()


def test_a_real_checkpoint_still_loads_through_the_allowlist(run, tmp_path):
    step = step_dir(run)
    shapes = sharded_checkpoint.tensor_shapes(step)
    assert shapes["encoder.cls_token"] == (torch.Size([1, 1, 32]), torch.float32)
    objective = toy_objective(seed=5)
    sharded_checkpoint.load_weights(step, objective)
    assert_bit_equal({name.removeprefix("encoder."): value for name, value
                      in objective.state_dict().items() if name.startswith("encoder.")},
                     live_encoder(run))
    assert_bit_equal(encoder_state(consolidate(run, tmp_path / "encoder", step=4)),
                     live_encoder(run))


def test_the_allowlist_is_what_dcp_writes():
    """Every global a real DCP save pickles (dtypes, sizes, layouts, paths, DCP's classes) is
    accepted; the names listed from torch 2.14.1's saves, FSDP2 at two ranks included."""
    from vlm_vit.train.sharded_checkpoint import _metadata_global

    written = [("torch", "Size"), ("torch", "bfloat16"), ("torch", "float32"),
               ("torch", "int64"), ("torch", "bool"), ("torch.serialization", "_get_layout"),
               ("pathlib", "PosixPath"), ("torch.distributed.checkpoint.filesystem",
                                          "_StorageInfo")]
    written += [(METADATA_MODULE, name) for name in (
        "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex",
        "StorageMeta", "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING")]
    for module, name in written:
        assert _metadata_global(module, name) is not None, (module, name)


# -- the files the metadata names ---------------------------------------------------------


def rewrite_storage(step: Path, relative_path: str) -> None:
    """Points every storage entry of the checkpoint's metadata at `relative_path`."""
    with open(step / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)
    metadata.storage_data = {index: dataclasses.replace(info, relative_path=relative_path)
                             for index, info in metadata.storage_data.items()}
    write_metadata(step, pickle.dumps(metadata, protocol=4))


@pytest.mark.parametrize("where", ["../../../x.bin", "absolute", "sub/x.bin", ".."])
def test_a_storage_file_outside_the_step_directory_is_refused(run, tmp_path, where):
    step = step_dir(run)
    outside = tmp_path / "x.bin"
    shutil.copy(step / "__0_0.distcp", outside)
    relative = str(outside) if where == "absolute" else where
    rewrite_storage(step, relative)
    for verify in (True, False):
        with pytest.raises(ValueError) as error:
            consolidate(run, tmp_path / "encoder", step=4, verify=verify)
        message = str(error.value)
        assert "\n" not in message, message
        assert str(step / ".metadata") in message and repr(relative) in message, message
    assert not (tmp_path / "encoder").exists()


def test_a_shard_that_is_a_link_out_of_the_run_is_refused(run, tmp_path):
    step = step_dir(run)
    shutil.move(step / "__0_0.distcp", tmp_path / "elsewhere.distcp")
    (step / "__0_0.distcp").symlink_to(tmp_path / "elsewhere.distcp")
    with pytest.raises(ValueError, match=r"__0_0\.distcp is a symbolic link"):
        ckpt.load_checkpoint(step)
    for verify in (True, False):
        with pytest.raises(ValueError, match=r"__0_0\.distcp is a symbolic link"):
            consolidate(run, tmp_path / "encoder", step=4, verify=verify)
    with pytest.raises(ValueError, match=r"__0_0\.distcp is a symbolic link"):
        sharded_checkpoint.load_weights(step, toy_objective(seed=5))


def test_every_file_the_metadata_names_is_hashed_whatever_its_name(run, tmp_path):
    """A storage file renamed away from `__*.distcp` was never hashed; now it needs its
    sidecar, and a sidecar renamed with it records the old name."""
    step = step_dir(run)
    (step / "__0_0.distcp").rename(step / "weights.bin")
    (step / "__0_0.distcp.sha256").unlink()
    rewrite_storage(step, "weights.bin")
    with pytest.raises(IntegrityError, match=r"weights\.bin has no weights\.bin\.sha256"):
        consolidate(run, tmp_path / "encoder", step=4)
    write_sidecar(step / "weights.bin")
    data = (step / "weights.bin.sha256").read_text()
    (step / "weights.bin.sha256").write_text(data.replace("weights.bin", "__0_0.distcp"))
    with pytest.raises(IntegrityError, match=r"records the hash of '__0_0\.distcp'"):
        consolidate(run, tmp_path / "encoder", step=4)
    assert not (tmp_path / "encoder").exists()


def test_a_file_in_the_step_directory_without_a_sidecar_is_refused(run):
    step = step_dir(run)
    (step / "notes.txt").write_text("mine")
    with pytest.raises(IntegrityError, match=r"notes\.txt has no notes\.txt\.sha256"):
        ckpt.load_checkpoint(step)


def test_two_files_swapped_with_their_sidecars_are_refused(tmp_path):
    first, second = tmp_path / "__0_0.distcp", tmp_path / "__1_0.distcp"
    first.write_bytes(b"rank 0's shards")
    second.write_bytes(b"rank 1's shards")
    write_sidecar(first)
    write_sidecar(second)
    assert verify_sidecar(first) and verify_sidecar(second)
    for name in ("{}", "{}.sha256"):  # each file, then each sidecar
        swap = tmp_path / name.format("swap")
        Path(name.format(first)).rename(swap)
        Path(name.format(second)).rename(name.format(first))
        swap.rename(name.format(second))
    assert first.read_bytes() == b"rank 1's shards"
    with pytest.raises(IntegrityError, match=r"records the hash of '__1_0\.distcp', not of "
                                             r"__0_0\.distcp"):
        verify_sidecar(first)


# -- DCP's own read failures --------------------------------------------------------------


def truncate(file: Path) -> None:
    """Keeps the first 64 bytes: every tensor in the file is cut off."""
    file.write_bytes(file.read_bytes()[:64])


def test_a_truncated_shard_read_unverified_is_one_line_naming_it(run, tmp_path):
    step = step_dir(run)
    truncate(step / "__0_0.distcp")
    for read in (lambda: consolidate(run, tmp_path / "encoder", step=4, verify=False),
                 lambda: sharded_checkpoint.load_weights(step, toy_objective(seed=5))):
        with pytest.raises(ValueError) as error:
            read()
        message = str(error.value)
        assert "\n" not in message and len(message) < 600, message
        assert f"checkpoint {step}" in message and "__0_0.distcp" in message, message


def test_swapped_shards_read_unverified_are_one_line_naming_the_first_failing_file(tmp_path):
    """One file per tensor (DCP's `single_file_per_rank=False`), two of them swapped: DCP
    reads a tensor of the wrong size from the first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    state = {"model": {"a": torch.zeros(2), "b": torch.ones(3, 4)}}
    with pytest.warns(UserWarning):  # DCP's warning that it runs in one process
        dcp.save(state, storage_writer=FileSystemWriter(tmp_path, single_file_per_rank=False),
                 no_dist=True)
    files = sorted(tmp_path.glob("__*.distcp"))
    assert len(files) == 2
    files[0].rename(tmp_path / "swap")
    files[1].rename(files[0])
    (tmp_path / "swap").rename(files[1])
    shapes = sharded_checkpoint.tensor_shapes(tmp_path)
    with pytest.raises(ValueError) as error:
        sharded_checkpoint.load_tensors(tmp_path, shapes)
    message = str(error.value)
    assert "\n" not in message and len(message) < 600, message
    assert f"checkpoint {tmp_path}: reading __0_" in message and "failed" in message, message


# -- through the command line -------------------------------------------------------------


@pytest.fixture
def traceback_files(tmp_path, monkeypatch):
    """Tracebacks of unexpected errors go to the system temp dir: here, the test's own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.mark.parametrize("case", ["code in the metadata", "a path out of the run",
                                  "a truncated shard, unverified"])
def test_consolidate_of_a_hostile_checkpoint_is_one_line_and_status_1(
        run, tmp_path, capsys, monkeypatch, traceback_files, case):
    step = step_dir(run)
    marker = tmp_path / "marker"
    if case == "code in the metadata":
        write_metadata(step, call_pickle(METADATA_MODULE, "os.system", f"touch {marker}"))
        expected = f"{step / '.metadata'} names {METADATA_MODULE}.os.system"
    elif case == "a path out of the run":
        shutil.copy(step / "__0_0.distcp", tmp_path / "x.bin")
        rewrite_storage(step, "../../../x.bin")
        expected = "'../../../x.bin'"
    else:
        truncate(step / "__0_0.distcp")
        monkeypatch.setenv("VLM_VIT_VERIFY", "0")
        expected = "__0_0.distcp"
    assert main(["consolidate", str(run), "--out", str(tmp_path / "encoder")]) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("vlm-vit consolidate: error: ") and "unexpected" not in err, err
    assert expected in lines[0], err
    assert not marker.exists() and not (tmp_path / "encoder").exists()
