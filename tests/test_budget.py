"""Fixed-capacity packed encoding (`vlm_vit.budget.encode_budget`, issue 46): whatever the
image sizes and the budget, every buffer holds exactly the budget, every image is in one
buffer, and its tokens equal the unpadded packed call's up to float32 rounding (1e-5; not
bit for bit: see the module); what it cannot take is refused by name."""

import hypothesis
import hypothesis.strategies as st
import pytest
import torch

from vlm_vit import EncoderConfig, VisionEncoder
from vlm_vit.budget import encode_budget

ENCODERS = {
    "class token, learned positions": dict(class_token=True),
    "registers": dict(num_register_tokens=2),
    "2D RoPE": dict(class_token=False, pos_embed="none", rope_theta=100.0),
    "2D RoPE, windows": dict(class_token=False, pos_embed="none", rope_theta=100.0,
                             window_size=2, full_attention_blocks=(1,)),
}
# CPU kernels block matrices of another row count, and window attention batches the windows
# of one shape across a pass (the padding's too): a few float32 ulps apart (often 0; up to
# 1.0e-6 on outputs near 1 in a few hundred random mixes), as the unpadded packed call is
# from each image alone.
ATOL = 1e-5


def encoder(kind: str) -> VisionEncoder:
    torch.manual_seed(0)
    return VisionEncoder(EncoderConfig(image_size=32, patch_size=8, width=32, depth=2, heads=2,
                                       mlp_width=64, **ENCODERS[kind])).eval()


MODELS = {kind: encoder(kind) for kind in ENCODERS}


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(kind=st.sampled_from(sorted(ENCODERS)),
                  sides=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1,
                                 max_size=5),
                  slack=st.integers(0, 60), seed=st.integers(0, 2**16))
def test_every_image_equals_the_unpadded_packed_call(kind, sides, slack, seed):
    model = MODELS[kind]
    generator = torch.Generator().manual_seed(seed)
    images = [torch.randn(3, 8 * rows, 8 * cols, generator=generator) for rows, cols in sides]
    with torch.no_grad():
        expected = model.forward_packed(images).split()
        longest = max(len(one.tokens[0]) for one in expected)
        out = encode_budget(model, images, tokens=longest + slack)
    assert sorted(i for buffer in out.buffers for i in buffer) == list(range(len(images)))
    assert all(pad >= 0 for pad in out.padding())
    for buffer, pad in zip(out.buffers, out.padding(), strict=True):
        assert sum(out.lengths[i] for i in buffer) + pad == out.capacity  # exactly the budget
    for got, one in zip(out.tokens, expected, strict=True):
        torch.testing.assert_close(got, one.tokens[0], rtol=0, atol=ATOL)


def test_the_padding_changes_nothing_and_buffers_fill_first_fit_decreasing():
    model = MODELS["class token, learned positions"]
    images = [torch.randn(3, 16, 16), torch.randn(3, 32, 32), torch.randn(3, 16, 32)]
    with torch.no_grad():
        tight = encode_budget(model, images, tokens=17)  # 5, 17 and 9 tokens
        loose = encode_budget(model, images, tokens=100)
    assert tight.buffers == [[1], [2, 0]] and tight.padding() == [0, 3]
    assert loose.buffers == [[1, 2, 0]] and loose.padding() == [69]
    for a, b in zip(tight.tokens, loose.tokens, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


def test_rope_with_prefix_tokens_is_refused_by_name():
    torch.manual_seed(0)
    model = VisionEncoder(EncoderConfig(image_size=32, patch_size=8, width=32, depth=1,
                                        heads=2, mlp_width=64, pos_embed="none",
                                        rope_theta=100.0)).eval()  # with its class token
    with pytest.raises(ValueError, match="2D RoPE and prefix"):
        encode_budget(model, [torch.zeros(3, 16, 16)], tokens=64)


@pytest.mark.parametrize("tokens, images, message", [
    (0, [torch.zeros(3, 16, 16)], "tokens must be an integer from 1 to"),
    (True, [torch.zeros(3, 16, 16)], "tokens must be an integer"),
    (8, [torch.zeros(3, 16, 16), torch.zeros(3, 32, 32)],
     r"image 1 \(\(32, 32\)\) takes 17 tokens, more than the budget of 8"),
    (64, [torch.zeros(2, 3, 16, 16)], "encode_budget takes images"),
    (64, [torch.zeros(3, 15, 16)], "multiple"),
])
def test_what_it_cannot_take_is_refused_by_name(tokens, images, message):
    with pytest.raises(ValueError, match=message):
        encode_budget(MODELS["class token, learned positions"], images, tokens=tokens)
