"""`SafetensorsStream`: a safetensors file written tensor by tensor that the safetensors
library reads back bit for bit."""

from __future__ import annotations

import pytest
import torch

from vlm_vit.io.files import atomic_write
from vlm_vit.io.tensor_files import SafetensorsStream


def test_a_streamed_file_is_what_safetensors_reads(tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    tensors = {"w": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16),
               "step": torch.tensor(4), "mask": torch.rand(2, 3) > 0.5,
               "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3)[:, ::2],  # strided
               "half": torch.randn(1, 0, 2).half()}
    with atomic_write(tmp_path / "s.safetensors") as handle:
        stream = SafetensorsStream(handle, {name: (t.shape, t.dtype)
                                            for name, t in tensors.items()})
        for name, tensor in tensors.items():
            stream.write(name, tensor)
        stream.close()
    loaded = load_file(tmp_path / "s.safetensors")
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_a_stream_refuses_what_was_not_declared(tmp_path):
    with open(tmp_path / "s.safetensors", "wb") as handle:
        stream = SafetensorsStream(handle, {"a": (torch.Size([2]), torch.float32),
                                            "b": (torch.Size([3]), torch.float32)})
        with pytest.raises(ValueError, match="'b' written out of order: 'a' is next"):
            stream.write("b", torch.zeros(3))
        with pytest.raises(ValueError, match=r"'a' is \(3,\) torch.float32, declared \(2,\)"):
            stream.write("a", torch.zeros(3))
        with pytest.raises(ValueError, match="2 declared tensors were not written, 'a' first"):
            stream.close()
