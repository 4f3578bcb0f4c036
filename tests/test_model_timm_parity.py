"""Numeric parity with timm's VisionTransformer on the same perturbed weights (every
parameter, biases, norms and tokens included, nudged by seeded noise, as in every other
family's parity test).

The parameter names follow timm's, so the state dict copies across unchanged.
"""

import pytest
import torch

from vlm_vit import VisionEncoder
from vlm_vit.convert.timm import build_timm_model
from vlm_vit.testing import perturbed

from .conftest import tiny_config

pytest.importorskip("timm")

CASES = {
    "class-token": dict(),
    "no-class-token": dict(class_token=False),
    "clip-shaped": dict(pre_norm=True, act="quick_gelu", norm_eps=1e-5, patch_bias=False),
    "gelu-tanh": dict(act="gelu_tanh"),
    "no-final-norm": dict(final_norm=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("size", [(32, 32), (48, 24)])  # native grid, and a resized one
def test_matches_timm(case, size):
    torch.manual_seed(0)
    ours = perturbed(VisionEncoder(tiny_config(**CASES[case])))
    theirs = build_timm_model(ours.config, dynamic_img_size=True).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(3, 3, *size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = theirs.forward_features(x)
        out = ours(x, output_hidden_states=True)
        expected_blocks = theirs.forward_intermediates(x, norm=False, intermediates_only=True,
                                                       output_fmt="NLC")
    torch.testing.assert_close(out.tokens, expected, atol=1e-5, rtol=1e-5)
    # timm returns each block's patch tokens (prefix dropped) for its intermediates
    assert len(out.hidden_states) - 1 == len(expected_blocks) == ours.config.depth
    for ours_hidden, timm_hidden in zip(out.hidden_states[1:], expected_blocks, strict=True):
        torch.testing.assert_close(ours_hidden[:, out.num_prefix_tokens:], timm_hidden,
                                   atol=1e-5, rtol=1e-5)
