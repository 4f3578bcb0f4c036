"""Window attention as varlen segments against transformers' Qwen2.5-VL: its window index
and its eager windowed attention (with 2D RoPE) on small grids."""

import pytest
import torch

from vlm_vit.layers.attention import Attention
from vlm_vit.layers.rope_2d import Rope2D, apply_rope, grid_positions, merge_window_order
from vlm_vit.layers.varlen import Segments, varlen_attention
from vlm_vit.layers.window_segments import (
    _tile_indices,
    build_windows,
    window_attention,
    window_partition,
)

PATCH = 14
CASES = [((8, 12), 4, 2), ((10, 6), 4, 2), ((12, 8), 8, 2), ((5, 7), 3, 1)]


def _qwen_window(grid, window, merge_size):
    from transformers.vision_utils import get_vision_window_index

    window_index, cu_window_seqlens = get_vision_window_index(
        torch.tensor([[1, *grid]]), spatial_merge_size=merge_size,
        window_size=window * PATCH, patch_size=PATCH)
    # Qwen's tokens arrive in merge-window order and window_index permutes whole merge units
    merge_order = merge_window_order(grid, merge_size).reshape(-1, merge_size**2)
    return merge_order[window_index].flatten(), cu_window_seqlens


@pytest.mark.parametrize(("grid", "window", "merge_size"), CASES)
def test_order_and_lengths_equal_qwen2_5_vl_window_index(grid, window, merge_size):
    partition = window_partition(grid, window, merge_size)
    their_order, cu_window_seqlens = _qwen_window(grid, window, merge_size)
    assert torch.equal(partition.order, their_order)
    assert partition.lengths == tuple(cu_window_seqlens.diff().tolist())
    assert partition.segments().offsets == tuple(cu_window_seqlens.tolist())
    assert torch.equal(partition.order[partition.inverse()], torch.arange(grid[0] * grid[1]))


@pytest.mark.parametrize(("grid", "window", "merge_size"), CASES)
def test_windowed_attention_equals_qwen2_5_vl_eager(grid, window, merge_size):
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionAttention

    heads, head_dim = 2, 8
    vision = Qwen2_5_VLConfig().vision_config
    vision.hidden_size, vision.num_heads = heads * head_dim, heads
    vision._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = Qwen2_5_VLVisionAttention(vision).eval()
    ours = Attention(heads * head_dim, heads)
    ours.load_state_dict(theirs.state_dict())  # the same names: qkv, proj

    tokens = grid[0] * grid[1]
    x = torch.randn(tokens, heads * head_dim)  # row-major over the grid
    rope = Rope2D(head_dim)
    partition = window_partition(grid, window, merge_size)
    cos, sin = rope(grid_positions(grid)[partition.order])  # angles follow their tokens

    their_order, cu_window_seqlens = _qwen_window(grid, window, merge_size)
    expected = theirs(x[their_order], cu_seqlens=cu_window_seqlens,
                      position_embeddings=(cos, sin))

    packed = x[partition.order]
    q, k, v = ours.qkv(packed).reshape(tokens, 3, heads, head_dim).unbind(1)
    q, k = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])
    out, _ = varlen_attention(q, k, v, partition.segments(backend="segments"))
    out = ours.proj(out.reshape(tokens, -1))
    # SDPA against eager softmax(QK^T)V: measured up to 1.2e-7 (5 seeds x 4 grids)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    # windows really confine attention: one segment for the whole image differs
    whole, _ = varlen_attention(q, k, v, Segments((tokens,), "segments"))
    assert (ours.proj(whole.reshape(tokens, -1)) - expected).abs().max() > 1e-3


def test_a_window_larger_than_the_grid_is_one_window_as_in_qwen2_5_vl():
    # Qwen2.5-VL's processor takes images down to 4x4 patches under its 8-patch windows
    for grid in [(4, 6), (4, 4), (2, 2)]:
        partition = window_partition(grid, 8, merge_size=2)
        their_order, cu_window_seqlens = _qwen_window(grid, 8, 2)
        assert partition.lengths == (grid[0] * grid[1],) == tuple(cu_window_seqlens.diff())
        assert torch.equal(partition.order, their_order)
    assert window_partition((4, 12), 8, merge_size=2).lengths == (32, 16)  # strips


def test_a_window_off_the_merge_size_and_an_odd_grid_are_refused():
    with pytest.raises(ValueError, match=r"window 3 must be a positive multiple of the merge"):
        window_partition((8, 8), 3, merge_size=2)
    with pytest.raises(ValueError, match=r"patch grid 7x8 is not divisible into 2x2"):
        window_partition((7, 8), 4, merge_size=2)


@pytest.mark.parametrize(("grid", "window"), [((8, 12), 4), ((10, 6), 4), ((12, 8), 8)])
def test_the_merge_order_changes_only_the_order_inside_each_window(grid, window):
    # so an encoder may keep row-major tokens (merge size 1) and attend in the same windows
    # as Qwen2.5-VL: attention is indifferent to the order inside a segment
    merged, plain = window_partition(grid, window, 2), window_partition(grid, window, 1)
    assert merged.lengths == plain.lengths
    for a, b in zip(merged.order.split(merged.lengths), plain.order.split(plain.lengths),
                    strict=True):
        assert sorted(a.tolist()) == sorted(b.tolist())
    assert not torch.equal(merged.order, plain.order)


@pytest.mark.parametrize(("grid", "window", "merge_size"), CASES[:3])
def test_the_attention_module_with_windows_equals_qwen2_5_vl_eager(grid, window, merge_size):
    # what the encoder runs: row-major tokens in, row-major out, windows gathered inside
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionAttention

    heads, head_dim = 2, 8
    vision = Qwen2_5_VLConfig().vision_config
    vision.hidden_size, vision.num_heads = heads * head_dim, heads
    vision._attn_implementation = "eager"
    torch.manual_seed(1)
    theirs = Qwen2_5_VLVisionAttention(vision).eval()
    ours = Attention(heads * head_dim, heads)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(1, grid[0] * grid[1], heads * head_dim)
    rope = Rope2D(head_dim)
    their_order, cu_window_seqlens = _qwen_window(grid, window, merge_size)
    cos, sin = rope(grid_positions(grid))
    with torch.no_grad():
        expected = theirs(x[0, their_order], cu_seqlens=cu_window_seqlens,
                          position_embeddings=(cos[their_order], sin[their_order]))
        windows = build_windows(window, [grid], x.shape[1])
        fast, _ = ours(x, rope=(cos, sin), windows=windows)
        explicit, maps = ours(x, rope=(cos, sin), windows=windows, need_weights=True)
    torch.testing.assert_close(fast[0, their_order], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(explicit, fast, rtol=0, atol=1e-6)
    assert maps.shape == (1, heads, x.shape[1], x.shape[1])


def test_windows_of_a_pack_group_by_length_and_equal_one_call_per_window():
    grids = [(5, 5), (2, 3), (4, 4)]  # 2x2 windows, and edge ones of 2 and 1 tokens
    total = sum(r * c for r, c in grids)
    windows = build_windows(2, grids, total, backend="segments")
    assert list(windows.lengths) == sorted(windows.lengths, reverse=True)
    assert [length for _, _, length in windows.runs] == [4, 2, 1]
    assert sorted(windows.order.tolist()) == list(range(total))
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, 2, 8, generator=generator) for _ in range(3))
    out, _ = window_attention(q, k, v, windows)
    # the same windows one SDPA call each, in the partition's own order
    expected = torch.empty_like(q)
    for index in windows.order.split(windows.lengths):
        part, _ = varlen_attention(q[index], k[index], v[index], Segments((len(index),)))
        expected[index] = part
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    explicit, maps = window_attention(q, k, v, windows, need_weights=True)
    torch.testing.assert_close(explicit, out, rtol=0, atol=1e-6)
    assert [m.shape[-1] for m in maps] == [25, 6, 16]


def test_windows_refuse_a_missing_grid_and_a_partial_sequence():
    with pytest.raises(ValueError, match="needs each image's patch grid"):
        build_windows(2, None, 16)
    with pytest.raises(ValueError, match="got 12 tokens"):
        build_windows(2, [(4, 4)], 12)
    assert build_windows(None, [(4, 4)], 16) is None


def test_the_export_tiles_gather_every_real_token_once_and_pad_past_the_grid():
    """GridWindows' index arithmetic (what torch.export and ONNX trace at symbolic sizes), on
    every grid up to 9 x 9 and window up to 4: tiles row-major over the grid padded to whole
    windows, `gather[scatter]` the identity on the real tokens, and the padding index
    (rows * cols) exactly where a tile's place falls at `row >= rows` or `col >= cols`."""
    for rows in range(1, 10):
        for cols in range(1, 10):
            for window in range(1, 5):
                gather, scatter = _tile_indices((rows, cols), window, "cpu")
                tile_rows, tile_cols = -(-rows // window), -(-cols // window)
                expected = [row * cols + col if row < rows and col < cols else rows * cols
                            for tile_row in range(tile_rows) for tile_col in range(tile_cols)
                            for row in range(tile_row * window, (tile_row + 1) * window)
                            for col in range(tile_col * window, (tile_col + 1) * window)]
                case = f"grid {rows} x {cols}, window {window}"
                assert gather.tolist() == expected, case
                assert torch.equal(gather[scatter], torch.arange(rows * cols)), case
