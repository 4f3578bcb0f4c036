"""2D RoPE against transformers' Qwen2-VL and Pixtral vision rotary functions on the same
grid, its shift property for both frequency layouts, and its refusals."""

import pytest
import torch

from vlm_vit.layers.rope_2d import Rope2D, apply_rope, grid_positions, merge_window_order

HEADS, HEAD_DIM = 3, 16


def _qwen2_vl_rotary():
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLVisionRotaryEmbedding

    vision = Qwen2VLConfig().vision_config
    vision.embed_dim, vision.num_heads = HEADS * HEAD_DIM, HEADS
    return Qwen2VLVisionRotaryEmbedding(vision)


@pytest.mark.parametrize(("grid", "merge_size"), [((4, 6), 2), ((3, 5), 1), ((6, 4), 2)])
def test_positions_and_rotation_match_qwen2_vl(grid, merge_size):
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision
    from transformers.vision_utils import get_vision_position_ids

    their_positions = get_vision_position_ids(torch.tensor([[1, *grid]]), merge_size)
    positions = grid_positions(grid, merge_size)
    assert torch.equal(positions, their_positions)  # the merge-window token order

    rope = Rope2D(HEAD_DIM, theta=10000.0)
    cos, sin = rope(positions)
    their_cos, their_sin = _qwen2_vl_rotary()(torch.empty(0), their_positions)
    # measured 0: the same float32 products of positions and frequencies
    torch.testing.assert_close(cos, their_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, their_sin, rtol=0, atol=1e-6)

    torch.manual_seed(0)
    tokens = grid[0] * grid[1]
    q, k = torch.randn(2, tokens, HEADS, HEAD_DIM).unbind(0)  # packed (T, heads, head_dim)
    their_q, their_k = apply_rotary_pos_emb_vision(q, k, their_cos, their_sin)
    torch.testing.assert_close(apply_rope(q, cos[:, None], sin[:, None]), their_q,
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(apply_rope(k, cos[:, None], sin[:, None]), their_k,
                               rtol=0, atol=1e-6)


def test_merge_window_order_is_the_row_major_grid_regrouped():
    # a 4x4 grid, 2x2 windows: the first window holds patches 0, 1, 4, 5
    order = merge_window_order((4, 4), 2)
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    assert merge_window_order((2, 3), 1).tolist() == list(range(6))


def _logit(rope, q, k, position_q, position_k):
    cos, sin = rope(torch.stack([position_q, position_k]))
    rotated_q = apply_rope(q, cos[0], sin[0])
    rotated_k = apply_rope(k, cos[1], sin[1])
    return (rotated_q.double() * rotated_k.double()).sum(-1)  # one logit per head


def test_pixtral_frequencies_are_the_alternating_layout():
    from transformers import PixtralVisionConfig
    from transformers.models.pixtral.modeling_pixtral import PixtralVisionRotaryEmbedding

    config = PixtralVisionConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS)
    theirs = PixtralVisionRotaryEmbedding(config)
    positions = grid_positions((3, 5))
    their_cos, their_sin = theirs(torch.empty(0), positions)
    cos, sin = Rope2D(HEAD_DIM, theta=config.rope_parameters["rope_theta"],
                      frequencies="alternating")(positions)
    # measured 0: the same float32 products
    torch.testing.assert_close(cos, their_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, their_sin, rtol=0, atol=1e-6)
    # ... and not Qwen2-VL's, whose columns turn at the rows' frequencies
    shared, _ = Rope2D(HEAD_DIM, theta=config.rope_parameters["rope_theta"])(positions)
    assert (shared - their_cos).abs().max() > 1e-2


@pytest.mark.parametrize("frequencies", ["shared", "alternating"])
def test_attention_logits_depend_only_on_the_relative_offset(frequencies):
    torch.manual_seed(0)
    rope = Rope2D(HEAD_DIM, frequencies=frequencies)
    q, k = torch.randn(2, HEADS, HEAD_DIM).unbind(0)
    for _ in range(20):
        position_q, position_k = torch.randint(0, 24, (2, 2)).unbind(0)
        shift = torch.randint(-20, 20, (2,))
        # float32 angles up to ~45 rad: measured up to 1.6e-6 apart (200 pairs)
        torch.testing.assert_close(
            _logit(rope, q, k, position_q + shift, position_k + shift),
            _logit(rope, q, k, position_q, position_k), rtol=0, atol=1e-5)
    # ... and they do depend on it, along each axis
    origin = torch.tensor([0, 0])
    same = _logit(rope, q, k, origin, origin)
    for offset in ([0, 3], [3, 0]):
        assert (_logit(rope, q, k, origin, torch.tensor(offset)) - same).abs().max() > 1e-2


def test_prefix_tokens_are_not_rotated():
    rope = Rope2D(HEAD_DIM)
    cos, sin = rope(grid_positions((2, 2)), num_prefix_tokens=1)
    assert cos.shape == sin.shape == (5, HEAD_DIM)
    x = torch.randn(5, HEAD_DIM)
    rotated = apply_rope(x, cos, sin)
    assert torch.equal(rotated[0], x[0])
    assert not torch.allclose(rotated[2:], x[2:])


def test_rope_keeps_the_input_dtype():
    rope = Rope2D(HEAD_DIM)
    cos, sin = rope(grid_positions((2, 3)))
    assert apply_rope(torch.randn(6, HEAD_DIM, dtype=torch.bfloat16), cos, sin).dtype == \
        torch.bfloat16


@pytest.mark.parametrize("head_dim", [18, 6, 0])
def test_a_head_dim_not_divisible_by_4_is_refused(head_dim):
    with pytest.raises(ValueError, match=rf"divisible by 4.*head_dim {head_dim}\b"):
        Rope2D(head_dim)
    with pytest.raises(ValueError, match=r"frequencies 'interleaved' are not shared or alt"):
        Rope2D(HEAD_DIM, frequencies="interleaved")


def test_a_merger_on_an_odd_grid_is_refused():
    with pytest.raises(ValueError, match=r"patch grid 5x6 is not divisible into 2x2 merge"):
        grid_positions((5, 6), merge_size=2)


@pytest.mark.parametrize(("grid", "reference"), [((6, 6), (4, 4)), ((8, 5), (4, 6))])
def test_reference_grid_positions_are_timms_ref_feat_shape_scaling(grid, reference):
    from timm.layers.pos_embed_sincos import _build_grid

    theirs = _build_grid(grid, grid_type="index", ref_feat_shape=reference).reshape(-1, 2)
    rope = Rope2D(HEAD_DIM, reference_grid=reference)
    assert torch.equal(rope.positions(grid), theirs)  # the same float32 divide, then multiply
    assert torch.equal(Rope2D(HEAD_DIM).positions(grid), grid_positions(grid))  # no reference


def test_packed_grids_are_each_scaled_from_their_own_grid():
    rope = Rope2D(HEAD_DIM, reference_grid=(4, 4))
    cos, sin = rope.for_grids([(6, 6), (2, 8)], num_prefix_tokens=1)
    for part, grid in zip((slice(0, 37), slice(37, 54)), [(6, 6), (2, 8)], strict=True):
        alone = rope(rope.positions(grid), num_prefix_tokens=1)
        assert torch.equal(cos[part], alone[0]) and torch.equal(sin[part], alone[1])
    # patch i of R rows sits at i / R * 4: the last at 4 - 4 / R, whatever R
    assert rope.positions((6, 6))[-1].tolist() == pytest.approx([10 / 3, 10 / 3])
    assert rope.positions((2, 8))[-1].tolist() == pytest.approx([2.0, 3.5])
