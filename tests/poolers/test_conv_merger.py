"""The `conv_merger` pooler (GLM-4V's downsample and merger): equal to transformers' Conv2d
over merge-window-ordered windows followed by its `Glm4vVisionPatchMerger`, with weights
perturbed; a grid the window does not divide and sizes out of bounds are refused."""

import pytest
import torch

from vlm_vit import build_pooler
from vlm_vit.config import ConfigError
from vlm_vit.layers.rope_2d import merge_window_order
from vlm_vit.testing import perturbed

IN_DIM, OUT_DIM, HIDDEN, MERGE = 16, 24, 40, 2


def merger():
    torch.manual_seed(0)
    return perturbed(build_pooler("conv_merger", in_dim=IN_DIM, out_dim=OUT_DIM,
                                  merge_size=MERGE, hidden_dim=HIDDEN), scale=0.3)


@pytest.mark.parametrize("grid", [(4, 4), (2, 6), (6, 2)])
def test_equals_transformers_downsample_and_merger(grid):
    glm4v = pytest.importorskip("transformers.models.glm4v.modeling_glm4v")
    ours = merger()
    downsample = torch.nn.Conv2d(IN_DIM, OUT_DIM, MERGE, stride=MERGE)
    theirs = glm4v.Glm4vVisionPatchMerger(OUT_DIM, HIDDEN, "silu")
    weights = ours.state_dict()
    downsample.load_state_dict({k.removeprefix("downsample."): v for k, v in weights.items()
                                if k.startswith("downsample.")})
    theirs.load_state_dict({k: v for k, v in weights.items() if not k.startswith("downsample.")})
    tokens = torch.randn(1, 1 + grid[0] * grid[1], IN_DIM,
                         generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        pooled = ours(tokens, num_prefix_tokens=1, grid=grid)
        # transformers' forward: tokens in merge-window order, one (D, m, m) image a window
        windows = tokens[0, 1:][merge_window_order(grid, MERGE)]
        windows = windows.view(-1, MERGE, MERGE, IN_DIM).permute(0, 3, 1, 2)
        expected = theirs(downsample(windows).view(-1, OUT_DIM))
    assert pooled.shape == (1, ours.num_output_tokens(grid), OUT_DIM)
    assert expected.abs().max() > 0.1  # not a trivial output
    torch.testing.assert_close(pooled[0], expected, atol=1e-5, rtol=1e-5)


def test_a_grid_the_window_does_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"a 3x4 grid is not a whole number of 2x2 windows"):
        merger()(torch.zeros(1, 12, IN_DIM), num_prefix_tokens=0, grid=(3, 4))


@pytest.mark.parametrize(("options", "named"), [
    (dict(in_dim=16_384, merge_size=8), "more than"),
    (dict(in_dim=16, hidden_dim=10**9), "hidden_dim"),
    (dict(in_dim=16, merge_size=0), "merge_size"),
])
def test_sizes_out_of_bounds_are_refused_before_allocation(options, named):
    with pytest.raises((ValueError, ConfigError), match=named):
        build_pooler("conv_merger", **options)
