"""The token and memory plan (`vlm_vit.plan`) against what an encode does on a CPU: its token
counts against the encoder's, the processor's and `encode_budget`'s, its predicted peaks
against live tensor storage counted while the encode runs (issue 46: within 15%)."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vlm_vit.budget import encode_budget
from vlm_vit.config import EncoderConfig
from vlm_vit.model import VisionEncoder
from vlm_vit.plan import budget_peak_bytes, encode_plan

# The issue asks for 15%. On these configs the walk is exact (worst 0.0%), so the test holds
# it to 2%: a step of the block left out (one [T, D] tensor is about 10%) fails it.
TOLERANCE = 0.02

# Small, but shaped like a real tower (M = 4 D, 2 blocks, so block 2 holds the first input):
# with width 32 and patch 8 the pixels (192 floats a patch) would outweigh the blocks.
SMALL = dict(image_size=(32, 32), patch_size=8, width=64, depth=2, heads=4, mlp_width=256)
SIZES = [(8, 8), (32, 32), (16, 128), (64, 96), (96, 64), (128, 128), (40, 200), (160, 96),
         (8, 256), (192, 192)]
BUDGETS = [600, 1000, 2500]


class LiveStorage(TorchDispatchMode):
    """Counts the bytes of tensor storages alive: `given` from the start, then every storage an
    op returns that was not alive before (each once, until its last tensor is freed, seen by
    a weakref finalizer on the storage); `peak` is the largest total after any op."""

    def __init__(self, before: list[torch.Tensor], given: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in before}
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in given}
        self.known |= storages.keys()
        self.live = self.peak = sum(storages.values())
        self.alive: set[int] = set()

    def _freed(self, key: int, size: int) -> None:
        self.alive.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size and key not in self.known and key not in self.alive:
                self.alive.add(key)
                self.live += size
                weakref.finalize(storage, self._freed, key, size)
        self.peak = max(self.peak, self.live)
        return out


def measured_peak(encoder: VisionEncoder, encode, given: list[torch.Tensor]) -> int:
    """The peak of `encode()` under inference mode, after one warm-up call (which resizes and
    caches the position table, as a server's first call of a size does)."""
    with torch.inference_mode():
        encode()
        before = [*encoder.parameters(), *encoder.buffers(), *encoder._pos_cache.values()]
        with LiveStorage(before, given) as counter:
            encode()
    return counter.peak


def small_encoder(**fields) -> VisionEncoder:
    torch.manual_seed(0)
    return VisionEncoder(EncoderConfig(**{**SMALL, **fields})).eval()


def relative_error(predicted: int, measured: int) -> float:
    return abs(predicted - measured) / measured


def test_padded_and_budget_peaks_are_predicted_within_the_tolerance():
    """10 sizes encoded padded (a batch of 2 each) and together in buffers of 3 budgets."""
    encoder = small_encoder()
    rows = encode_plan(encoder, SIZES, batch=2)
    errors = {}
    for size, row in zip(SIZES, rows, strict=True):
        pixels = torch.randn(2, 3, *size)
        measured = measured_peak(encoder, lambda p=pixels: encoder(p), [pixels])
        errors[f"padded {size}"] = relative_error(row.padded_peak_bytes, measured)
    images = [torch.randn(3, *size) for size in SIZES]
    lengths = [row.tokens for row in rows]
    for capacity in BUDGETS:
        buffers, predicted = budget_peak_bytes(encoder.config, lengths, SIZES, capacity)
        measured = measured_peak(
            encoder, lambda n=capacity: encode_budget(encoder, images, tokens=n), images)
        assert buffers == len(encode_budget(encoder, images, tokens=capacity).buffers)
        errors[f"budget {capacity}"] = relative_error(predicted, measured)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, f"worst: {worst} off by {errors[worst]:.1%}"


MECHANISMS = {
    "M below 2D (attention dominates)": dict(mlp_width=96),
    "one block": dict(depth=1),
    "CLIP: pre-norm, QuickGELU": dict(pre_norm=True, act="quick_gelu"),
    "DINOv2: registers, LayerScale": dict(num_register_tokens=4, layer_scale_init=1e-5),
    "SwiGLU": dict(mlp="swiglu", act="silu"),
    "SwiGLU with sub-LN": dict(mlp="swiglu", act="silu", mlp_norm=True),
    "SiLU MLP (not in place)": dict(act="silu"),
    "RoPE and a position table": dict(rope_theta=100.0),
    "Pixtral-like: RoPE, RMSNorm, SwiGLU": dict(
        rope_theta=100.0, pos_embed="none", class_token=False, norm="rmsnorm", mlp="swiglu",
        act="silu"),
    "sin-cos table, patch norm": dict(pos_embed="sincos", patch_norm=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fields", MECHANISMS.values(), ids=MECHANISMS.keys())
def test_each_mechanism_is_predicted(fields, dtype):
    encoder = small_encoder(**fields).to(dtype)
    sizes, batch = [(32, 32), (64, 96)], 3
    rows = encode_plan(encoder, sizes, batch=batch, budgets=[300], dtype=dtype)
    for size, row in zip(sizes, rows, strict=True):
        pixels = torch.randn(batch, 3, *size)
        measured = measured_peak(encoder, lambda p=pixels: encoder(p), [pixels])
        assert relative_error(row.padded_peak_bytes, measured) <= TOLERANCE, (size, row)
        (budget,) = row.budgets
        if budget.refused:  # encode_budget's own refusal: RoPE with a class token
            assert fields.get("rope_theta") and budget.peak_bytes is None
            continue
        images = [image.clone() for image in pixels]  # each its own, as a server gets them
        measured = measured_peak(encoder, lambda i=images: encode_budget(encoder, i, tokens=300),
                                 images)
        assert relative_error(budget.peak_bytes, measured) <= TOLERANCE, (size, budget)


def test_tokens_are_what_the_encoder_the_tower_and_encode_budget_give():
    from vlm_vit import VisionTower, build_pooler

    encoder = small_encoder(num_register_tokens=2)
    tower = VisionTower(encoder, build_pooler("all", in_dim=64))
    rows = encode_plan(encoder.config, SIZES[:4], budgets=[1000])
    with torch.inference_mode():
        for size, row in zip(SIZES[:4], rows, strict=True):
            assert row.tokens == encoder(torch.zeros(1, 3, *size)).tokens.shape[1]
            assert row.tokens == tower.num_image_tokens(size) + encoder.num_prefix_tokens
            assert encode_budget(encoder, [torch.zeros(3, *size)], tokens=1000).lengths \
                == [row.tokens]
            assert row.grid == (size[0] // 8, size[1] // 8)


def test_a_processor_resizes_the_sizes_first():
    from vlm_vit.processor import ImageProcessor

    native = ImageProcessor(resize_mode="native", patch_multiple=8, max_output_pixels=64 * 96)
    (row,) = encode_plan(EncoderConfig(**SMALL), [(1080, 1920)], processor=native)
    (pixels,) = native(torch.rand(3, 1080, 1920))
    assert row.encoded_size == tuple(pixels.shape[-2:]) and row.image_size == (1080, 1920)
    assert row.tokens == (row.encoded_size[0] // 8) * (row.encoded_size[1] // 8) + 1
    squash = ImageProcessor(size=(64, 32), resize_mode="squash")
    (row,) = encode_plan(EncoderConfig(**SMALL), [(500, 300)], processor=squash)
    assert row.encoded_size == (64, 32) and row.tokens == 8 * 4 + 1


def test_window_attention_is_said_to_be_unpredicted():
    config = EncoderConfig(**{**SMALL, "window_size": 2, "pos_embed": "none",
                              "rope_theta": 100.0, "class_token": False})
    (row,) = encode_plan(config, [(64, 64)], budgets=[100])
    assert row.unpredicted == "window attention" and row.tokens == 64
    assert row.padded_peak_bytes is None and row.budgets[0].peak_bytes is None


@pytest.mark.parametrize("arguments, message", [
    (dict(image_sizes=[(0, 32)]), "image size 0x32 is not positive"),
    (dict(image_sizes=[(36, 32)]), "36x32 is not a positive multiple of patch size 8"),
    (dict(image_sizes=[(64, 64)], budgets=[64]), "an image of 64x64 takes 65 tokens, more "
                                                 "than the budget of 64"),
    (dict(image_sizes=[(64, 64)], budgets=[0]), "a budget must be an integer from 1"),
    (dict(image_sizes=[(64, 64)], batch=0), "batch must be a positive integer, got 0"),
])
def test_bad_plans_are_refused_with_their_values(arguments, message):
    with pytest.raises(ValueError, match=message):
        encode_plan(EncoderConfig(**SMALL), **arguments)
