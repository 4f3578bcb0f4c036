"""A token and memory plan: for each image size, the tokens an image becomes and the peak
activation memory of encoding it, padded (`encoder(batch)`) or in fixed-capacity buffers
(`vlm_vit.budget.encode_budget`), predicted from the config alone.

    rows = encode_plan(encoder, [(224, 224), (448, 672)], budgets=[1024, 4096], batch=8)
    rows[0].tokens, rows[0].padded_peak_bytes, rows[0].budgets[0].buffers

What is counted: the float32 pixels given (the caller holds them while the encode runs) and
every tensor the encode allocates, each storage once, while it is alive (inference, no
autograd; the position table already resized and cached for that grid, as after the first
call of a size). Not counted: weights, the allocator's caching and rounding, and the scratch
space a kernel keeps to itself (SDPA's, a GEMM's): the plan is a lower bound on what a CUDA
allocator reserves. The prediction walks the block in the order the code runs it (which
tensors are alive at each step, e.g. `[B, T, D]` for the block's input, its attention output
and the normed input, `[B, T, M]` for the MLP's hidden layer) and takes the largest total; it
is checked against a live-storage count on CPU (`tests/test_plan.py`, within 15%).

Not predicted (`PlanRow.unpredicted` says why, and the peaks are None): window attention,
whose windows are gathered and batched by shape, the hybrid's ResNet stem and the Conv3d
patch embedding of video towers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlm_vit.config import EncoderConfig

# Activations that overwrite the MLP's hidden layer when autograd is off (`layers.mlp`), and
# how many hidden-sized temporaries each still makes (QuickGELU's 1.702 * x).
INPLACE_TEMPORARIES = {"gelu": 0, "gelu_tanh": 0, "quick_gelu": 1}
FLOAT32 = 4  # RoPE rotates in float32, and the processor's pixels are float32


@dataclass(frozen=True)
class BudgetRow:
    """`encode_budget` of a row's images in buffers of `capacity` tokens.

    Attributes:
        capacity: N, the tokens of every buffer.
        buffers: how many buffers the images fill (first-fit decreasing, as `encode_budget`).
        peak_bytes: the predicted peak (see the module); None when not predicted.
        refused: why `encode_budget` refuses this encoder, or None.
    """

    capacity: int
    buffers: int
    peak_bytes: int | None
    refused: str | None = None


@dataclass(frozen=True)
class PlanRow:
    """One image size of `encode_plan`.

    Attributes:
        image_size: (height, width) as asked.
        encoded_size: (height, width) the encoder sees (the processor's output, when given).
        grid: the patch grid (rows, cols).
        tokens: the tokens one image becomes (patches plus class and register tokens).
        batch: B, the images of this size encoded together.
        padded_peak_bytes: predicted peak of `encoder(pixels [B, C, H, W])`; None when not
            predicted.
        budgets: one `BudgetRow` per budget asked, for the B images of this size.
        unpredicted: the mechanism the peaks are not predicted for, or None.
    """

    image_size: tuple[int, int]
    encoded_size: tuple[int, int]
    grid: tuple[int, int]
    tokens: int
    batch: int
    padded_peak_bytes: int | None
    budgets: tuple[BudgetRow, ...]
    unpredicted: str | None = None


def unpredicted_mechanism(config: EncoderConfig) -> str | None:
    """The mechanism of `config` whose memory the plan does not predict, in words, or None."""
    if config.window_size is not None:
        return "window attention"
    if config.hybrid_layers is not None:
        return "the hybrid's ResNet stem"
    if config.temporal_patch_size is not None:
        return "the Conv3d patch embedding"
    return None


def budget_refusal(config: EncoderConfig) -> str | None:
    """Why `encode_budget` refuses an encoder of `config` (its own check), or None."""
    if config.rope_theta is not None and config.num_prefix_tokens:
        return "2D RoPE with prefix tokens"
    return None


def _rope_rotation(rows: int, width: int, element: int) -> tuple[int, int]:
    """`apply_rope` on q or k of `rows` tokens: (its peak while it runs, what it leaves)."""
    rotated = rows * width * FLOAT32
    cast = 0 if element == FLOAT32 else rotated  # x.float() copies a 16-bit q
    # rotate_half's concatenation, x * cos, rotated * sin and their sum, then the cast back
    peak = max(cast + 4 * rotated, cast + rotated + rows * width * element)
    return peak, rows * width * element


def _block_peak(config: EncoderConfig, rows: int, held: int, element: int,
                attention_core, outputs: int) -> int:
    """The peak bytes of one block on `rows` tokens, `held` bytes alive around it (the block's
    input among them); `attention_core(base)` gives the peak of the attention kernels' step
    with `base` bytes alive (q, k, v included), after which `outputs` `[rows, D]` tensors
    (the kernels' output, a copy of it) reach the output projection."""
    D, M = config.width, config.mlp_width
    token = rows * D * element  # one [rows, D] tensor
    hidden = rows * M * element  # one [rows, M] tensor
    peaks = []
    # attention: the normed input (the call's argument) and qkv live until it returns
    base = held + token + 3 * token
    if config.rope_theta is not None:
        peak, left = _rope_rotation(rows, D, element)
        peaks += [base + peak, base + left + peak]  # k rotates while rotated q waits
        base += 2 * left
    peaks.append(attention_core(base))
    peaks.append(base + (outputs + 1) * token)  # and the output projection
    layer_scale = token if config.layer_scale_init is not None else 0
    peaks.append(held + 2 * token + layer_scale)  # the residual sum
    # MLP: the block keeps its input, the attention output, the sum and the normed sum
    base = held + 3 * token
    if config.mlp == "swiglu":
        inner = hidden if config.mlp_norm else 0
        peaks += [base + 3 * hidden, base + hidden + inner + token]
    elif config.act in INPLACE_TEMPORARIES:
        temporaries = INPLACE_TEMPORARIES[config.act]
        peaks += [base + (1 + temporaries) * hidden, base + hidden + token]
    else:  # the activation writes a second hidden tensor
        peaks.append(base + 2 * hidden + token)
    peaks.append(held + 4 * token + layer_scale)  # the MLP's output, its sum
    return max(peaks)


def _rope_tables(config: EncoderConfig, tokens: int) -> int:
    """RoPE's cos and sin `[tokens, head_dim]` (float32), alive through the blocks."""
    if config.rope_theta is None:
        return 0
    return 2 * tokens * (config.width // config.heads) * FLOAT32


def _patch_phase(config: EncoderConfig, images: int, patches: int, tokens: int,
                 pixels: int, element: int) -> int:
    """Pixels to tokens for `images` of `patches` patches each: the pixels cast to the
    model's dtype (a copy unless float32), the patch embeddings, the positions added, the
    prefix prepended."""
    cast = 0 if element == FLOAT32 else pixels // FLOAT32 * element
    embedded = images * patches * config.width * element
    norm = embedded if config.patch_norm else 0
    return max(cast + embedded + norm, 2 * embedded + images * tokens * config.width * element)


def padded_peak_bytes(config: EncoderConfig, size: tuple[int, int], tokens: int,
                      batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
    """The predicted peak bytes of `encoder(pixels)` for `batch` images of `size` (encoded
    size), each `tokens` tokens (see the module)."""
    element = torch.empty((), dtype=dtype).element_size()
    rows = batch * tokens
    token = rows * config.width * element
    pixels = batch * config.in_channels * size[0] * size[1] * FLOAT32
    patches = tokens - config.num_prefix_tokens
    # `forward` keeps the prepared tokens while `run_blocks` works on its own copy (the
    # pre-norm's output, or the first block's output from block 2 on)
    held = (2 if config.depth > 1 or config.pre_norm else 1) * token + _rope_tables(config,
                                                                                   tokens)
    # SDPA's output is laid out [B, T, heads, head_dim]: merging the heads is a view
    blocks = _block_peak(config, rows, held, element, lambda base: base + token, outputs=1)
    final = held + token
    return pixels + max(_patch_phase(config, batch, patches, tokens, pixels, element),
                        blocks, final)


def budget_peak_bytes(config: EncoderConfig, lengths: Sequence[int],
                      sizes: Sequence[tuple[int, int]], capacity: int,
                      dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """The buffers and predicted peak bytes of `encode_budget(encoder, images,
    tokens=capacity)` for images of `lengths` tokens and `sizes` pixels (see the module).

    Raises:
        ValueError: for an image of more tokens than `capacity`.
    """
    from vlm_vit.train.token_budget import first_fit_decreasing

    for index, length in enumerate(lengths):
        if length > capacity:
            raise ValueError(f"image {index} ({sizes[index][0]}x{sizes[index][1]}) takes "
                             f"{length} tokens, more than the budget of {capacity}")
    element = torch.empty((), dtype=dtype).element_size()
    per_token = config.width * element
    pixels = sum(config.in_channels * h * w * FLOAT32 for h, w in sizes)
    prefix = config.num_prefix_tokens
    # every image's prepared tokens stay alive until the last buffer is done
    prepared, phases = 0, []
    for length, (height, width) in zip(lengths, sizes, strict=True):
        own = config.in_channels * height * width * FLOAT32
        phases.append(prepared + _patch_phase(config, 1, length - prefix, length, own, element))
        prepared += length * per_token
    buffers = first_fit_decreasing(list(lengths), capacity)
    for done, buffer in enumerate(buffers):
        segments = [lengths[i] for i in buffer]
        pad = capacity - sum(segments)
        if pad:
            segments.append(pad)
        # earlier buffers' outputs, the prepared tokens, the padding and the block's input
        held = (done * capacity + pad + capacity) * per_token + prepared \
            + _rope_tables(config, capacity)
        phases.append(_block_peak(config, capacity, held, element,
                                  lambda base, s=segments: _segment_attention(s, base,
                                                                              per_token),
                                  outputs=2))  # the concatenated output, merged by a copy
        phases.append(held + capacity * per_token)  # the final norm
    return len(buffers), pixels + max(phases)


def _segment_attention(segments: list[int], base: int, per_token: int) -> int:
    """The peak of `varlen_attention`'s "segments" backend: one SDPA per length, the images of
    one length concatenated into a batch (q, k and v copied), the outputs concatenated."""
    by_length: dict[int, int] = {}
    for length in segments:
        by_length[length] = by_length.get(length, 0) + 1
    done, peak = 0, 0
    for length, count in by_length.items():
        rows = length * count
        batched = 3 * rows if count > 1 else 0  # torch.cat of q, k and v
        peak = max(peak, base + (done + batched + rows) * per_token)
        done += rows
    return max(peak, base + 2 * done * per_token)  # the outputs and their concatenation


def processed_size(processor, size: tuple[int, int]) -> tuple[int, int]:
    """The (height, width) `processor` makes of an image of `size`, as its `output_size` says
    of a file: `size` of the processor, or the native resize of `size`.

    Raises:
        ValueError: for a tiling processor (an image becomes several views) or a size the
            processor refuses.
    """
    if processor.tiling is not None:
        raise ValueError("the plan does not take a tiling processor: an image becomes a base "
                         "view and tiles")
    resized = processor._resized_size(size[0], size[1], f"image {size[0]}x{size[1]}")
    return resized if processor.resize_mode == "native" else processor.size


def encode_plan(encoder_or_config, image_sizes: Sequence[tuple[int, int]], *,
                processor=None, budgets: Sequence[int] = (), batch: int = 1,
                dtype: torch.dtype = torch.float32) -> list[PlanRow]:
    """Tokens and predicted peak activation memory per image size (see the module).

    Args:
        encoder_or_config: a `VisionEncoder` or its `EncoderConfig`.
        image_sizes: (height, width) of the images; with `processor`, before it resizes them.
        processor: an `ImageProcessor` whose output the encoder sees, or None (the sizes are
            the encoder's input).
        budgets: token capacities N of `encode_budget` buffers to plan the B images in.
        batch: B, images of each size encoded together.
        dtype: the encoder's dtype.

    Returns:
        One `PlanRow` per size, in the order given.

    Raises:
        ValueError: for a batch or budget below 1, a size that is not positive or not a
            multiple of the patch size, or an image of more tokens than a budget (naming
            them).
    """
    from vlm_vit.budget import MAX_BUDGET
    from vlm_vit.model import VisionEncoder

    if isinstance(encoder_or_config, EncoderConfig):
        config = encoder_or_config
        with torch.device("meta"):  # the patch embedding's grid, without the weights
            encoder = VisionEncoder(config)
    else:
        encoder, config = encoder_or_config, encoder_or_config.config
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    for capacity in budgets:
        if isinstance(capacity, bool) or not isinstance(capacity, int) \
                or not 1 <= capacity <= MAX_BUDGET:
            raise ValueError(f"a budget must be an integer from 1 to {MAX_BUDGET}, got "
                             f"{capacity!r}")
    unpredicted = unpredicted_mechanism(config)
    refused = budget_refusal(config)
    rows = []
    for size in image_sizes:
        height, width = size
        if height <= 0 or width <= 0:
            raise ValueError(f"image size {height}x{width} is not positive")
        encoded = (height, width) if processor is None else processed_size(processor, size)
        grid = encoder.patch_embed.grid(*encoded)  # as the tower counts its tokens
        tokens = math.prod(grid) + config.num_prefix_tokens
        padded = None if unpredicted else padded_peak_bytes(config, encoded, tokens, batch,
                                                            dtype)
        plans = []
        for capacity in budgets:
            if tokens > capacity:
                raise ValueError(f"an image of {height}x{width} takes {tokens} tokens, more "
                                 f"than the budget of {capacity}")
            count, peak = budget_peak_bytes(config, [tokens] * batch, [encoded] * batch,
                                            capacity, dtype)
            plans.append(BudgetRow(capacity, count, None if unpredicted or refused else peak,
                                    refused))
        rows.append(PlanRow((height, width), encoded, grid, tokens, batch, padded,
                            tuple(plans), unpredicted))
    return rows
