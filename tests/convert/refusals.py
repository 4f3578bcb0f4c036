"""A check the converters' tests share: a hostile config is one error naming the file and
the field, before any encoder is built."""

import pytest

from vlm_vit import load_encoder


def assert_refused_before_building(folder, monkeypatch, named: str) -> None:
    """`load_encoder(folder)` raises a ValueError naming `config.json` and `named`, and never
    reaches `VisionEncoder.__init__` (so no size from the config is ever allocated)."""

    def built(*args, **kwargs):
        raise AssertionError("a model was built from a hostile config")

    monkeypatch.setattr("vlm_vit.model.VisionEncoder.__init__", built)
    with pytest.raises(ValueError, match="config.json") as error:
        load_encoder(folder)
    assert named in str(error.value)
