"""Known values and structure of the built-in poolers."""

import pytest
import torch
from torch import nn

from vlm_vit import build_pooler


def tokens(prefix=1, grid=(3, 3), width=8, batch=2):
    return torch.randn(batch, prefix + grid[0] * grid[1], width,
                       generator=torch.Generator().manual_seed(0))


def test_cls_and_mean_are_exact_slices():
    x = tokens()
    cls = build_pooler("cls", in_dim=8)(x, num_prefix_tokens=1, grid=(3, 3))
    mean = build_pooler("mean", in_dim=8)(x, num_prefix_tokens=1, grid=(3, 3))
    assert torch.equal(cls, x[:, 0])
    assert torch.equal(mean, x[:, 1:].mean(dim=1))


def test_all_keeps_or_drops_the_prefix():
    x = tokens(prefix=2)
    assert torch.equal(build_pooler("all", in_dim=8)(x, num_prefix_tokens=2, grid=(3, 3)),
                       x[:, 2:])
    keep = build_pooler("all", in_dim=8, keep_prefix=True)
    assert torch.equal(keep(x, num_prefix_tokens=2, grid=(3, 3)), x)
    assert keep.num_output_tokens((3, 3), num_prefix_tokens=2) == 11


def test_cls_without_a_class_token_is_an_error_not_a_patch():
    with pytest.raises(ValueError, match="needs the class token"):
        build_pooler("cls", in_dim=8)(tokens(prefix=0), num_prefix_tokens=0, grid=(3, 3))


def test_mlp2x_gelu_has_the_llava_structure():
    projector = build_pooler("mlp2x_gelu", in_dim=8, out_dim=16)
    layers = list(projector.children())
    assert [type(m) for m in layers] == [nn.Linear, nn.GELU, nn.Linear]
    assert sorted(projector.state_dict()) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert (layers[0].in_features, layers[0].out_features, layers[2].out_features) == (8, 16, 16)
    x = tokens(prefix=0)
    expected = layers[2](torch.nn.functional.gelu(layers[0](x)))
    torch.testing.assert_close(projector(x, num_prefix_tokens=0, grid=(3, 3)), expected)


def test_mlp_depth_from_the_name():
    projector = build_pooler("mlp3x_gelu", in_dim=8, out_dim=16)
    assert [type(m).__name__ for m in projector] == ["Linear", "GELU", "Linear", "GELU", "Linear"]
    assert sorted(build_pooler("linear", in_dim=8, out_dim=4).state_dict()) == ["bias", "weight"]


def test_pixel_shuffle_counts_and_merges_neighbours():
    shuffle = build_pooler("pixel_shuffle", in_dim=8, scale=2)
    x = tokens(prefix=1, grid=(3, 3))
    assert shuffle.num_output_tokens((3, 3)) == 4
    assert shuffle(x, num_prefix_tokens=1, grid=(3, 3)).shape == (2, 4, 8)
    seen = []
    shuffle.mlp.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
    shuffle(x, num_prefix_tokens=1, grid=(3, 3))
    merged = seen[0]  # [B, 4, 4 * 8]
    patches = x[:, 1:].reshape(2, 3, 3, 8)
    # token 0 holds patches (0,0), (0,1), (1,0), (1,1); token 1 holds (0,2) and zero padding
    expected0 = torch.cat([patches[:, 0, 0], patches[:, 0, 1], patches[:, 1, 0], patches[:, 1, 1]],
                          dim=-1)
    torch.testing.assert_close(merged[:, 0], expected0)
    torch.testing.assert_close(merged[:, 1, :8], patches[:, 0, 2])
    assert merged[:, 1, 8:16].abs().sum() == 0 and merged[:, 3, 8:].abs().sum() == 0


def test_attention_pool_queries():
    assert build_pooler("attention_pool", in_dim=8).num_output_tokens((3, 3)) is None
    pool = build_pooler("attention_pool", in_dim=8, out_dim=4, num_queries=5)
    assert pool(tokens(), num_prefix_tokens=1, grid=(3, 3)).shape == (2, 5, 4)


@pytest.mark.parametrize("name", ["all", "cls", "mean"])
def test_poolers_without_weights_refuse_another_width(name):
    with pytest.raises(ValueError, match=f"pooler '{name}' has no weights .* out_dim=16"):
        build_pooler(name, in_dim=8, out_dim=16)


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match="cannot build pooler 'mean' with options {'scale': 2}"):
        build_pooler("mean", in_dim=8, scale=2)
