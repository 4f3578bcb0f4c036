"""DINOHead against lightly's DINOv2ProjectionHead: layout, initialisation and outputs."""

from __future__ import annotations

import pytest
import torch

from vlm_vit.convert.keymap import rename
from vlm_vit.pretrain.dino_head import DINOHead

heads = pytest.importorskip("lightly.models.modules.heads")

DIMS = dict(in_dim=48, out_dim=300, hidden_dim=64, bottleneck_dim=16)

# lightly's head (a ProjectionHead: Linear, GELU, Linear, GELU, Linear: depth 5) and the old
# `nn.utils.weight_norm` of its last layer, to ours (DINOv2's `mlp`) and the parametrization
KEY_MAP = {
    "layers.{}.weight": "mlp.{}.weight",
    "layers.{}.bias": "mlp.{}.bias",
    "last_layer.weight_g": "last_layer.parametrizations.weight.original0",
    "last_layer.weight_v": "last_layer.parametrizations.weight.original1",
}


def lightly_head(seed=0):
    torch.manual_seed(seed)
    return heads.DINOv2ProjectionHead(input_dim=DIMS["in_dim"], hidden_dim=DIMS["hidden_dim"],
                                      bottleneck_dim=DIMS["bottleneck_dim"],
                                      output_dim=DIMS["out_dim"])


def our_head(seed=0, **overrides):
    torch.manual_seed(seed)
    return DINOHead(**{**DIMS, **overrides})


def test_shapes_and_parameter_counts_match_lightly():
    ours, theirs = our_head(), lightly_head()
    assert ours(torch.randn(2, 5, 48)).shape == (2, 5, 300)
    assert ([p.shape for p in ours.parameters()] == [p.shape for p in theirs.parameters()])
    assert (sum(p.numel() for p in ours.parameters())
            == sum(p.numel() for p in theirs.parameters())
            == 48 * 64 + 64 + 64 * 64 + 64 + 64 * 16 + 16 + 300 + 300 * 16)
    # g trainable, as DINOv2's DINOHead and lightly's DINOv2ProjectionHead
    assert all(p.requires_grad for p in ours.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_outputs_match_lightly_with_its_weights(dtype):
    theirs = lightly_head(seed=1).to(dtype)
    with torch.no_grad():  # a g away from 1, so the magnitude's key is checked too
        theirs.last_layer.weight_g.uniform_(0.5, 2.0)
    ours = our_head(seed=2).to(dtype)
    ours.load_state_dict(rename(theirs.state_dict(), KEY_MAP, depth=5), strict=True)
    x = torch.randn(7, 48, dtype=dtype, generator=torch.Generator().manual_seed(0))
    # measured max |difference|: 0 in both precisions
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)


def test_same_seed_gives_lightlys_initial_weights():
    """Same construction order: Linear defaults, truncated normals, then the last layer."""
    theirs = rename(lightly_head(seed=3).state_dict(), KEY_MAP, depth=5)
    ours = our_head(seed=3).state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=key)


def test_initialisation_and_normalised_prototypes():
    head = our_head(in_dim=256, hidden_dim=512, out_dim=1000)
    for index in (0, 2, 4):  # trunc_normal(std 0.02) cut at +-2 (100 std), zero bias
        linear = head.mlp[index]
        assert abs(linear.weight.std().item() - 0.02) < 0.002
        assert linear.weight.abs().max() < 2 and not linear.bias.any()
    assert [type(m).__name__ for m in head.mlp] == ["Linear", "GELU", "Linear", "GELU",
                                                      "Linear"]
    g = head.last_layer.parametrizations.weight.original0
    assert g.shape == (1000, 1) and torch.equal(g, torch.ones_like(g))
    norms = head.last_layer.weight.norm(dim=1)  # g = 1: every prototype a unit vector
    torch.testing.assert_close(norms, torch.ones(1000))
    logits = head(torch.randn(4, 256))
    assert logits.abs().max() <= 1 + 1e-6  # cosines of unit vectors


def test_layer_counts_and_float16_eps():
    assert [type(m).__name__ for m in our_head(layers=1).mlp] == ["Linear"]
    assert len(our_head(layers=4).mlp) == 7
    with pytest.raises(ValueError, match="at least 1 MLP layer"):
        DINOHead(8, layers=0)
    head = our_head(layers=1)
    with torch.no_grad():
        head.mlp[0].weight.zero_()
    assert torch.isfinite(head.half()(torch.randn(2, 48).half())).all()  # eps 1e-6 in fp16
