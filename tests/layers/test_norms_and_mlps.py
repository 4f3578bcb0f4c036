"""LayerScale, RMSNorm and SwiGLU against the modules they reproduce (timm's LayerScale,
transformers' Dinov2LayerScale, Qwen2RMSNorm and Qwen2.5-VL's vision MLP) on the same
random weights."""

import pytest
import torch

from vlm_vit.layers.layer_scale import LayerScale
from vlm_vit.layers.rms_norm import RMSNorm
from vlm_vit.layers.swiglu import SwiGLU


def test_layer_scale_matches_timm_and_dinov2_on_the_same_gamma():
    from timm.layers import LayerScale as TimmLayerScale
    from transformers import Dinov2Config
    from transformers.models.dinov2.modeling_dinov2 import Dinov2LayerScale

    torch.manual_seed(0)
    ours, theirs = LayerScale(24, init_value=0.1), TimmLayerScale(24, init_values=0.1)
    assert torch.equal(ours.gamma, theirs.gamma)  # the same initial value
    gamma = torch.randn(24)
    ours.gamma.data.copy_(gamma)
    theirs.load_state_dict(ours.state_dict())  # the same key: gamma
    dinov2 = Dinov2LayerScale(Dinov2Config(hidden_size=24))
    dinov2.lambda1.data.copy_(gamma)
    x = torch.randn(2, 5, 24)
    # one multiplication each: the same float32 rounding, bit for bit
    assert torch.equal(ours(x), theirs(x))
    assert torch.equal(ours(x), dinov2(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_qwen2_rms_norm(dtype):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    torch.manual_seed(0)
    ours, theirs = RMSNorm(64, eps=1e-6), Qwen2RMSNorm(64, eps=1e-6)
    ours.weight.data.normal_()
    theirs.load_state_dict(ours.state_dict())
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (torch.randn(3, 7, 64) * 3 + 1).to(dtype)
    out = ours(x)
    assert out.dtype == dtype
    # measured 0 in both dtypes (the same float32 statistics, the same cast)
    torch.testing.assert_close(out, theirs(x), rtol=0, atol=1e-6)


def test_rms_norm_has_no_mean_subtraction():
    norm = RMSNorm(4)
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(norm(x), x, atol=1e-5, rtol=0)  # LayerNorm would give zeros


def test_swiglu_matches_qwen2_5_vl_vision_mlp_on_the_same_weights():
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

    torch.manual_seed(0)
    vision = Qwen2_5_VLConfig().vision_config
    vision.hidden_size, vision.intermediate_size = 32, 48
    theirs = Qwen2_5_VLMLP(vision, bias=True)  # as Qwen2_5_VLVisionBlock builds it
    ours = SwiGLU(32, 48, bias=True)
    key_map = {"fc1_g": "gate_proj", "fc1_x": "up_proj", "fc2": "down_proj"}
    ours.load_state_dict({
        name: theirs.state_dict()[key_map[name.split(".")[0]] + "." + name.split(".")[1]]
        for name in ours.state_dict()
    })
    x = torch.randn(2, 9, 32)
    # measured 0: the same three Linears and SiLU in the same order
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-6)


def test_swiglu_linear_names_and_injected_activation():
    linears = sorted(name for name, module in SwiGLU(8, 16).named_children()
                     if isinstance(module, torch.nn.Linear))
    assert linears == ["fc1_g", "fc1_x", "fc2"]
    assert SwiGLU(8, 16, bias=False).fc1_g.bias is None
    torch.manual_seed(0)
    geglu = SwiGLU(8, 16, act=torch.nn.GELU())
    x = torch.randn(3, 8)
    expected = geglu.fc2(torch.nn.functional.gelu(geglu.fc1_g(x)) * geglu.fc1_x(x))
    assert torch.equal(geglu(x), expected)


def test_swiglu_inner_norm_matches_timm_swiglu_with_norm_layer():
    from timm.layers import LayerNorm as TimmLayerNorm
    from timm.layers import SwiGLU as TimmSwiGLU

    from vlm_vit.layers.mlp import build_mlp

    torch.manual_seed(0)
    # EVA-02 base's `scale_mlp`: the block's LayerNorm (eps 1e-6) on the hidden activation
    theirs = TimmSwiGLU(32, 48, norm_layer=TimmLayerNorm)
    for parameter in theirs.parameters():
        parameter.data.normal_()
    ours = build_mlp("swiglu", 32, 48, act="silu", inner_norm="layernorm", norm_eps=1e-6)
    ours.load_state_dict(theirs.state_dict())  # strict: timm's names, norm included
    x = torch.randn(2, 9, 32)
    # measured 0: the same Linears, SiLU and LayerNorm in the same order
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-6)
    assert "norm" not in dict(SwiGLU(32, 48).named_children())  # no module without a norm
    with pytest.raises(ValueError, match=r"inner MLP norm \('layernorm'\) needs the swiglu"):
        build_mlp("mlp", 32, 48, inner_norm="layernorm")
