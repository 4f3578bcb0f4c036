"""Tests of the C-Abstractor plugin; independent of vlm_vit (they import only the plugin)."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vlm_vit_cabstractor
from vlm_vit_cabstractor import CAbstractor

IN_DIM, OUT_DIM = 16, 24


def make(**options) -> CAbstractor:
    """A small C-Abstractor with fixed weights, in eval mode."""
    torch.manual_seed(0)
    return CAbstractor(in_dim=IN_DIM, out_dim=options.pop("out_dim", OUT_DIM), **options).eval()


def tokens_for(grid, num_prefix_tokens=0, batch=2, dim=IN_DIM, requires_grad=False):
    """Random tokens [batch, num_prefix_tokens + rows*cols, dim]."""
    generator = torch.Generator().manual_seed(1)
    shape = (batch, num_prefix_tokens + grid[0] * grid[1], dim)
    return torch.randn(shape, generator=generator).requires_grad_(requires_grad)


@pytest.mark.parametrize(
    ("grid", "output_grid", "expected"),
    [
        ((8, 8), 4, 16),  # square, larger than the output grid
        ((6, 10), (2, 3), 6),  # non-square both ways
        ((3, 5), 4, 16),  # odd, non-square, partly smaller than the output grid
        ((2, 2), 4, 16),  # smaller than the output grid along both axes
        ((1, 1), (2, 5), 10),  # a single patch
    ],
)
@pytest.mark.parametrize("num_prefix_tokens", [0, 1, 2])
def test_output_shape_matches_num_output_tokens(grid, output_grid, expected, num_prefix_tokens):
    model = make(output_grid=output_grid)
    out = model(tokens_for(grid, num_prefix_tokens), num_prefix_tokens=num_prefix_tokens, grid=grid)
    assert out.shape == (2, expected, OUT_DIM)
    assert model.num_output_tokens(grid, num_prefix_tokens=num_prefix_tokens) == expected
    assert torch.isfinite(out).all()


def test_defaults():
    model = CAbstractor(in_dim=IN_DIM)
    assert (model.in_dim, model.out_dim, model.hidden_dim) == (IN_DIM, IN_DIM, IN_DIM)
    assert (model.output_grid, model.depth) == ((4, 4), 2)
    assert model.num_output_tokens((14, 14)) == 16
    assert model(tokens_for((5, 7)), num_prefix_tokens=0, grid=(5, 7)).shape == (2, 16, IN_DIM)


def test_output_grid_accepts_a_list():
    # Saved options may come back from JSON with (rows, cols) as a list.
    model = make(output_grid=[2, 3])
    assert model.output_grid == (2, 3)
    assert model(tokens_for((4, 4)), num_prefix_tokens=0, grid=(4, 4)).shape == (2, 6, OUT_DIM)


def test_hidden_dim_and_depth_zero():
    model = make(hidden_dim=40, depth=0, output_grid=(3, 2))
    assert model.out_dim == OUT_DIM and model.hidden_dim == 40
    out = model(tokens_for((4, 4), 1), num_prefix_tokens=1, grid=(4, 4))
    assert out.shape == (2, 6, OUT_DIM)


def test_prefix_tokens_are_ignored():
    model = make()
    tokens = tokens_for((4, 6), num_prefix_tokens=2)
    other = tokens.clone()
    other[:, :2] = torch.randn(2, 2, IN_DIM)
    kwargs = dict(num_prefix_tokens=2, grid=(4, 6))
    torch.testing.assert_close(model(tokens, **kwargs), model(other, **kwargs))
    torch.testing.assert_close(
        model(tokens, **kwargs), model(tokens[:, 2:], num_prefix_tokens=0, grid=(4, 6))
    )


def test_output_is_row_major_over_output_grid():
    # With depth 0 and an output grid equal to the input grid the pooling is the identity, so
    # output token i is the readout of patch token i (row-major on both sides).
    model = make(depth=0, output_grid=(3, 5))
    tokens = tokens_for((3, 5), num_prefix_tokens=1)
    out = model(tokens, num_prefix_tokens=1, grid=(3, 5))
    torch.testing.assert_close(out, model.readout(model.proj(tokens[:, 1:])))


def test_grid_smaller_than_output_grid_repeats_positions():
    # A 2x2 grid pooled to 4x4 repeats each position as a 2x2 block (before stage 2).
    model = make(depth=0, output_grid=4)
    out = model(tokens_for((2, 2)), num_prefix_tokens=0, grid=(2, 2))  # [2, 16, OUT_DIM]
    out = out.reshape(2, 4, 4, OUT_DIM)
    expected = out[:, ::2, ::2].repeat_interleave(2, dim=1).repeat_interleave(2, dim=2)
    torch.testing.assert_close(out, expected)


def test_each_sample_is_independent_of_the_batch():
    model = make()
    tokens = tokens_for((5, 7), num_prefix_tokens=1, batch=3)
    kwargs = dict(num_prefix_tokens=1, grid=(5, 7))
    batched = model(tokens, **kwargs)
    alone = model(tokens[:1], **kwargs)
    torch.testing.assert_close(batched[:1], alone, atol=1e-5, rtol=0)
    # Still true in training mode: no BatchNorm-style statistics over the batch.
    model.train()
    torch.testing.assert_close(
        model(tokens, **kwargs)[:1], model(tokens[:1], **kwargs), atol=1e-5, rtol=0
    )


def test_gradients_reach_all_parameters_and_the_input():
    model = make(hidden_dim=20).train()
    tokens = tokens_for((3, 5), num_prefix_tokens=1, requires_grad=True)
    model(tokens, num_prefix_tokens=1, grid=(3, 5)).square().mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert param.grad.abs().sum() > 0, name
    assert tokens.grad is not None
    assert tokens.grad[:, 1:].abs().sum() > 0  # patch tokens get gradient
    assert tokens.grad[:, :1].abs().sum() == 0  # the dropped prefix token does not


def test_runs_under_cpu_bfloat16_autocast():
    model = make()
    tokens = tokens_for((5, 7), num_prefix_tokens=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens, num_prefix_tokens=1, grid=(5, 7))
    assert out.shape == (2, 16, OUT_DIM)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    reference = model(tokens, num_prefix_tokens=1, grid=(5, 7))
    # bfloat16 rounding: measured max 3.6e-3 on outputs of mean |x| 0.12 (max 0.46); the
    # bound is about 3x that, so an output off by 5% (0.02 here) fails.
    torch.testing.assert_close(out.float(), reference, atol=1e-2, rtol=0)


@pytest.mark.parametrize(
    ("tokens", "num_prefix_tokens", "grid", "match"),
    [
        (torch.zeros(16, IN_DIM), 0, (4, 4), r"\[B, N, in_dim\].*2-D shape \(16, 16\)"),
        (torch.zeros(2, 17, IN_DIM), 0, (4, 4), r"\(2, 17, 16\) has 17 tokens.*0 \+ 4 \* 4 = 16"),
        (torch.zeros(2, 16, IN_DIM), 1, (4, 4), r"has 16 tokens.*1 \+ 4 \* 4 = 17"),
        (torch.zeros(2, 16, IN_DIM + 1), 0, (4, 4), r"\(2, 16, 17\) has last dim 17.*in_dim = 16"),
        (torch.zeros(2, 16, IN_DIM), 0, (0, 16), r"grid must be .*\(0, 16\)"),
        (torch.zeros(2, 16, IN_DIM), -1, (4, 4), r"num_prefix_tokens must be >= 0, got -1"),
    ],
)
def test_bad_inputs_raise_clear_errors(tokens, num_prefix_tokens, grid, match):
    with pytest.raises(ValueError, match=match):
        make()(tokens, num_prefix_tokens=num_prefix_tokens, grid=grid)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(output_grid=0), r"output_grid sizes must be positive ints, got 0"),
        (dict(output_grid=-2), r"got -2"),
        (dict(output_grid=(3, 0)), r"got \(3, 0\)"),
        (dict(output_grid=(1, 2, 3)), r"output_grid must be an int or \(rows, cols\)"),
        (dict(output_grid=True), r"output_grid must be an int or \(rows, cols\), got True"),
        (dict(depth=-1), r"depth must be an int >= 0, got -1"),
        (dict(hidden_dim=0), r"hidden_dim must be a positive int, got 0"),
        (dict(out_dim=-3), r"out_dim must be a positive int, got -3"),
    ],
)
def test_bad_options_raise_clear_errors(options, match):
    with pytest.raises(ValueError, match=match):
        make(**options)


def test_unknown_option_is_rejected():
    with pytest.raises(TypeError):
        CAbstractor(in_dim=IN_DIM, output_tokens=16)


def test_import_does_not_import_vlm_vit():
    package_root = str(Path(vlm_vit_cabstractor.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    code = "import sys, vlm_vit_cabstractor; assert 'vlm_vit' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_entry_point_is_declared():
    try:
        dist = importlib.metadata.distribution("vlm-vit-cabstractor")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(
            "vlm-vit-cabstractor is not installed (pip install -e it to check the entry point)"
        )
    declared = [ep for ep in dist.entry_points if ep.group == "vlm_vit.poolers"]
    assert [(ep.name, ep.value) for ep in declared] == [
        ("c_abstractor", "vlm_vit_cabstractor:CAbstractor")
    ]
    found = [
        ep
        for ep in importlib.metadata.entry_points(group="vlm_vit.poolers")
        if ep.name == "c_abstractor"
    ]
    assert len(found) == 1
    assert found[0].load() is CAbstractor
