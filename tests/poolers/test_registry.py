"""Names, duplicates, close matches and third-party plugins through entry points."""

import subprocess
import sys
from importlib import metadata

import pytest
from torch import nn

from vlm_vit import available_poolers, build_pooler, register_pooler
from vlm_vit.registry import Registry, UnknownNameError


def test_builtins_are_listed():
    assert {"all", "cls", "mean", "linear", "mlp2x_gelu", "attention_pool", "pixel_shuffle",
            "perceiver"} <= set(available_poolers())


def test_unknown_name_lists_close_matches():
    with pytest.raises(UnknownNameError, match="unknown pooler 'mlp2x_gleu'; did you mean "
                                               "mlp2x_gelu"):
        build_pooler("mlp2x_gleu", in_dim=8)


def test_duplicate_name_names_both_sources():
    with pytest.raises(ValueError) as error:
        @register_pooler("mean")
        class AnotherMean(nn.Module):
            pass
    message = str(error.value)
    assert "registered twice" in message and "vlm_vit.poolers.simple.MeanPatch" in message
    assert "AnotherMean" in message


def test_plugin_is_found_by_name_and_loaded_lazily():
    pytest.importorskip("vlm_vit_cabstractor", reason="the adapters/ plugin is not installed")
    code = (
        "import sys, vlm_vit\n"
        "assert 'vlm_vit_cabstractor' not in sys.modules, 'imported at import time'\n"
        "pooler = vlm_vit.build_pooler('c_abstractor', in_dim=32, out_dim=16)\n"
        "print(type(pooler).__module__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "vlm_vit_cabstractor"


def fake_entry_points(*entries):
    def entry_points(group):
        return [metadata.EntryPoint(name, value, group) for name, value in entries]
    return entry_points


def test_broken_plugin_warns_and_the_rest_keep_working(monkeypatch):
    monkeypatch.setattr(metadata, "entry_points", fake_entry_points(
        ("broken", "no_such_module_abc:Thing"), ("fine", "collections:OrderedDict")))
    registry = Registry("pooler", entry_point_group="vlm_vit.test")
    registry.add("builtin", dict)
    with pytest.warns(RuntimeWarning, match="pooler plugin 'broken'.*no_such_module_abc"):
        names = registry.names()
    assert names == ["builtin", "fine"]
    with pytest.raises(UnknownNameError):
        registry.get("broken")


def test_plugin_with_a_taken_name_warns_naming_both(monkeypatch):
    monkeypatch.setattr(metadata, "entry_points", fake_entry_points(
        ("builtin", "collections:OrderedDict")))
    registry = Registry("pooler", entry_point_group="vlm_vit.test")
    registry.add("builtin", dict, source="the core")
    with pytest.warns(RuntimeWarning, match="registered twice: by the core and by "
                                            "collections:OrderedDict"):
        assert registry.names() == ["builtin"]
    assert registry.get("builtin") is dict


def test_entry_points_are_not_read_before_the_first_lookup(monkeypatch):
    calls = []
    monkeypatch.setattr(metadata, "entry_points", lambda group: calls.append(group) or [])
    registry = Registry("pooler", entry_point_group="vlm_vit.test")
    registry.add("a", dict)
    assert calls == []
    registry.get("a")  # a known name needs no plugin scan
    assert calls == []
    registry.names()
    assert calls == ["vlm_vit.test"]
