"""Encoder configuration and the table of named variants.

Sizes come from Dosovitskiy et al. 2021, Table 1 (Base, Large, Huge), from Touvron et al.
2021 (DeiT: Tiny, Small, the sizes timm and big_vision use) and from Radford et al. 2021
(CLIP's image towers).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

from vlm_vit.registry import unknown_name_error

ACTIVATIONS = ("gelu", "quick_gelu", "gelu_tanh", "silu")
POS_RESIZE_MODES = ("bicubic", "bilinear", "bilinear_corners", "bicubic_grid_sample",
                    "bilinear_square_crop", "bilinear_corners_square_crop")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("mlp", "swiglu")
POS_EMBEDS = ("learned", "sincos", "none")
ROPE_FREQUENCIES = ("shared", "alternating")
ROPE_POSITIONS = ("index", "centered", "one_based")
# The hybrid's ResNet (`layers.hybrid_stem`): at most 4 stages (a whole R50), each of at most
# 64 blocks (the deepest BiT stage, R152's, has 36).
MAX_HYBRID_STAGES, MAX_HYBRID_BLOCKS = 4, 64
MAX_TEMPORAL_PATCH = 16  # frames per tube; Qwen2-VL and Qwen2.5-VL use 2, ViViT up to 8

# The sizes a config may give, (low, high) inclusive. They are far above every released ViT
# (the largest, ViT-22B of Dehghani et al. 2023: width 6144, depth 48, MLP 24576, 48 heads)
# and low enough that a hand-edited or hostile config.json cannot ask for an encoder whose
# construction alone hangs or exhausts memory. The weights must then hold exactly these
# sizes (`vlm_vit.convert.base.check_config_fits`).
LIMITS: dict[str, tuple[int, int]] = {
    "image_size": (1, 16_384),  # each side, in pixels
    "patch_size": (1, 16_384),  # and at most the image side (sides are multiples of it)
    "width": (1, 16_384),
    "depth": (1, 256),
    "heads": (1, 16_384),  # and a divisor of width
    "mlp_width": (1, 65_536),
    "in_channels": (1, 1_024),  # hyperspectral sensors have a few hundred bands
    "num_register_tokens": (0, 64),  # Darcet et al. 2024 use up to 16
}
MAX_GRID_TOKENS = 1024 * 1024  # patches per image at `image_size`: a 1024 x 1024 grid
MAX_NORM_EPS = 1.0  # LayerNorm eps in (0, 1]; 1e-12 .. 1e-5 in practice
BOOLEAN_FIELDS = ("class_token", "pre_norm", "final_norm", "qkv_bias", "patch_bias",
                  "pos_resize_antialias", "mlp_norm", "patch_norm")
CHOICES = {"act": ACTIVATIONS, "pos_resize_mode": POS_RESIZE_MODES, "norm": NORMS, "mlp": MLPS,
           "pos_embed": POS_EMBEDS, "rope_frequencies": ROPE_FREQUENCIES,
           "rope_positions": ROPE_POSITIONS}


# The mechanism fields at the paper's block: what a writer of a plain-ViT layout (CLIP,
# SigLIP, open_clip) needs them to be.
PAPER_MECHANISMS: dict[str, Any] = dict(layer_scale_init=None, norm="layernorm", mlp="mlp",
                                        mlp_norm=False, patch_norm=False, hybrid_layers=None,
                                        pos_embed="learned",
                                        rope_theta=None, rope_reference_grid=None,
                                        temporal_patch_size=None, window_size=None)


class ConfigError(ValueError):
    """A config field whose value is not one it allows.

    The message names the file (when known), the field, what it allows and the value.

    Attributes:
        field: the field, in `EncoderConfig`'s (or the processor's, the tower's) terms.
        value: the value given.
        allowed: what the field accepts, in words (e.g. "a positive int (1..256)").
        source: the file it came from, or None.
    """

    def __init__(self, field: str, value: Any, allowed: str, *, source: object = None,
                 problem: str | None = None) -> None:
        self.field, self.value, self.allowed, self.source = field, value, allowed, source
        self.problem = problem or f"{field} must be {allowed}, got {value!r}"
        super().__init__(self.problem if source is None else f"{source}: {self.problem}")

    def located(self, source: object, spelled: str | None = None) -> ConfigError:
        """The same error naming `source`, and the field as that file spells it."""
        problem = self.problem if spelled in (None, self.field) else f"{self.problem} ({spelled})"
        return ConfigError(self.field, self.value, self.allowed, source=source, problem=problem)


def is_int(value: Any) -> bool:
    """An integer (Python's or numpy's), and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A finite real number (an int or a float, Python's or numpy's), and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) \
        and math.isfinite(value)


def check_int(field: str, value: Any, low: int, high: int) -> int:
    """`value` as an int if it is one in `low..high`, else a `ConfigError`."""
    if not (is_int(value) and low <= value <= high):
        kind = "a positive int" if low == 1 else "an int"
        raise ConfigError(field, value, f"{kind} ({low}..{high})")
    return int(value)


def check_bool(field: str, value: Any) -> bool:
    """`value` if it is a bool (JSON true or false), else a `ConfigError`."""
    if not isinstance(value, bool):
        raise ConfigError(field, value, "true or false")
    return value


def check_choice(field: str, value: Any, choices: tuple[str, ...]) -> str:
    """`value` if it is one of `choices`, else a `ConfigError`."""
    if not (isinstance(value, str) and value in choices):
        raise ConfigError(field, value, f"one of {', '.join(choices)}",
                          problem=f"{field} {value!r} is not one of {', '.join(choices)}")
    return value


def _as_pair(value: Any, name: str) -> tuple[int, int]:
    low, high = LIMITS["image_size"]  # image_size, or rope_reference_grid in patches
    if is_int(value):
        value = (value, value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
        is_int(v) and low <= v <= high for v in value
    ):
        return (int(value[0]), int(value[1]))
    raise ConfigError(name, value, f"an int or a (height, width) pair of ints ({low}..{high})")


@dataclass
class EncoderConfig:
    """Every architecture fact a ViT checkpoint family needs.

    The defaults are ViT-B/16 at 224 x 224 as in the paper. Every field is validated on
    construction (see `validate` for the bounds).
    """

    image_size: tuple[int, int] = (224, 224)  # (height, width) the position table was trained at
    patch_size: int = 16
    width: int = 768  # D, the token width
    depth: int = 12  # L, the number of blocks
    heads: int = 12
    mlp_width: int = 3072
    in_channels: int = 3
    class_token: bool = True
    num_register_tokens: int = 0  # extra learned prefix tokens without position (Darcet et al.)
    pre_norm: bool = False  # a LayerNorm before the first block (CLIP's ln_pre)
    final_norm: bool = True  # the LayerNorm after the last block (ViT's norm, CLIP's ln_post)
    act: str = "gelu"  # gelu (exact erf), quick_gelu (OpenAI CLIP), gelu_tanh (the JAX code)
    norm_eps: float = 1e-6  # 1e-6 in the paper's code and timm, 1e-5 in CLIP
    qkv_bias: bool = True
    patch_bias: bool = True  # CLIP's patch convolution has no bias
    # How the learned position table is resized to another grid (paper section 3.2).
    # bicubic with antialias matches timm and open_clip; Hugging Face uses bicubic without
    # antialias; the JAX code uses bilinear; Qwen3-VL bilinear with the corners aligned
    # ("bilinear_corners", `layers.pos_resize_corners`); GLM-4V bicubic by `grid_sample` at
    # each patch centre ("bicubic_grid_sample", `layers.pos_resize_sampled`); RADIO bilinear
    # to the square of the longer side, top-left kept ("bilinear_square_crop", with the
    # corners aligned "bilinear_corners_square_crop", `layers.pos_resize_square_crop`).
    pos_resize_mode: str = "bicubic"
    pos_resize_antialias: bool = True
    # Mechanisms beyond the paper's block, each a module in `vlm_vit.layers`; the defaults are
    # the paper's ViT.
    layer_scale_init: float | None = None  # LayerScale's start value on both branches (DINOv2)
    norm: str = "layernorm"  # every norm of the encoder; rmsnorm in Qwen2.5-VL's tower
    mlp: str = "mlp"  # fc1, act, fc2; or swiglu: fc2(act(fc1_g) * fc1_x), act silu (EVA-02)
    mlp_norm: bool = False  # swiglu's hidden normed (`norm`) before fc2: EVA-02 B/L's sub-LN
    # The hybrid (paper 3.1): patches cut from a ResNet's feature map, these blocks per stage
    # ((3, 4, 9) for R50+ViT-B/16); patch_size is then the ResNet's stride, `hybrid_stride`.
    hybrid_layers: tuple[int, ...] | None = None
    # The learned table E_pos (eq. 1); sincos: the fixed 2D sin-cos table of MAE computed for
    # every grid (AIMv2 native, `layers.pos_embed.sincos_2d_pos_embed`); none (RoPE-only).
    pos_embed: str = "learned"
    patch_norm: bool = False  # `norm` over each patch embedding before E_pos (AIMv2's, GLM-4V's)
    # 2D RoPE on q and k in every block, this frequency base (10000 in Pixtral and Qwen2-VL);
    # null for none. Rows and columns turn at the same head_dim/4 frequencies ("shared",
    # Qwen2-VL) or take the even and odd ones of head_dim/2 ("alternating", Pixtral).
    rope_theta: float | None = None
    rope_frequencies: str = "shared"
    # RoPE positions scaled so every image's grid spans this (rows, cols) one, row i at
    # i * ref_rows / rows (EVA-02's ref_feat_shape, its pretraining grid); null: patch indices.
    rope_reference_grid: tuple[int, int] | None = None
    # Where RoPE puts each patch: "index", its (row, col) index as above; "centered", DINOv3's
    # patch centres normalised to [-1, 1] over the image's own grid, in turns
    # (`layers.rope_centered`), with no reference grid; "one_based", Perception Encoder's
    # (row + 1, col + 1), its class token at (0, 0), then scaled as above
    # (`layers.rope_one_based`).
    rope_positions: str = "index"
    # A Conv3d patch embedding over this many frames (Qwen2-VL: 2), so images and video share
    # a tower; an image is its frame repeated (`layers.temporal_patch_embed`). null: Conv2d.
    temporal_patch_size: int | None = None
    # Window attention (Qwen2.5-VL): blocks attend within windows of this many patches a side,
    # tiled from the top-left corner (Qwen2.5-VL's 112 pixels / patch 14 = 8); null: none.
    window_size: int | None = None
    full_attention_blocks: tuple[int, ...] = ()  # blocks (from 0) that attend globally

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Checks every field's type and range, normalising numbers to `int` / `float`.

        The bounds are `LIMITS` (each side of `image_size` 1..16384, `patch_size` up to the
        side, `width` 1..16384 and a multiple of `heads`, `depth` 1..256, `mlp_width`
        1..65536, `in_channels` 1..1024, `num_register_tokens` 0..64), at most
        `MAX_GRID_TOKENS` (1024 x 1024) patches at `image_size`, and `norm_eps` a finite
        number in (0, 1]; the booleans must be booleans and `act` / `pos_resize_mode` /
        `norm` / `mlp` one of their names; `layer_scale_init` null or a finite number > 0;
        `mlp` swiglu with `act` silu; `mlp_norm` only with swiglu; `hybrid_layers` null or 1
        to 4 stages of 1..64 blocks, with `patch_size` the ResNet's stride; `pos_embed`
        learned, none or sincos (with a width divisible by 4); `patch_norm` not with the
        hybrid; `rope_theta` null or a finite number > 0, with a head dimension
        (width / heads) divisible by 4;
        `rope_reference_grid` null or a (rows, cols) of 1..16384, only with `rope_theta`;
        `rope_positions` index, centered (only with `rope_theta`, without a reference grid)
        or one_based (only with `rope_theta`);
        `temporal_patch_size` null or 1..16, not with the hybrid; `window_size` null or a
        positive int no larger than the grid at `image_size` on both sides, without class or
        register tokens; `full_attention_blocks` distinct block indices, only with a window.

        Raises:
            ConfigError: (a ValueError) for the first field that is off, naming the field,
                what it allows and the value; `from_dict(source=...)` adds the file.
        """
        self.image_size = _as_pair(self.image_size, "image_size")
        for name, (low, high) in LIMITS.items():
            if name != "image_size":
                setattr(self, name, check_int(name, getattr(self, name), low, high))
        for name in BOOLEAN_FIELDS:
            check_bool(name, getattr(self, name))
        for name, choices in CHOICES.items():
            check_choice(name, getattr(self, name), choices)
        if not (is_real(self.norm_eps) and 0 < self.norm_eps <= MAX_NORM_EPS):
            raise ConfigError("norm_eps", self.norm_eps,
                              f"a finite number in (0, {MAX_NORM_EPS:g}]")
        self.norm_eps = float(self.norm_eps)
        self._validate_mechanisms()
        if self.width % self.heads:
            raise ConfigError("heads", self.heads, f"a divisor of width {self.width}",
                              problem=f"width {self.width} is not divisible by heads "
                              f"{self.heads}")
        self._validate_rope()
        height, width = self.image_size
        if height % self.patch_size or width % self.patch_size:
            raise ConfigError("image_size", list(self.image_size),
                              f"multiples of patch size {self.patch_size}",
                              problem=f"image_size {height}x{width} is not a multiple of "
                              f"patch size {self.patch_size}")
        rows, cols = self.grid
        if rows * cols > MAX_GRID_TOKENS:
            raise ConfigError("image_size", list(self.image_size),
                              f"at most {MAX_GRID_TOKENS} patches",
                              problem=f"image_size {height}x{width} with patch size "
                              f"{self.patch_size} is a {rows}x{cols} grid of {rows * cols} "
                              f"patches, more than {MAX_GRID_TOKENS}")
        self._validate_windows()

    def _validate_windows(self) -> None:
        """`window_size` and `full_attention_blocks` (see `validate`)."""
        window, full = self.window_size, self.full_attention_blocks
        if not (isinstance(full, (tuple, list)) and all(is_int(i) and 0 <= i < self.depth
                                                        for i in full)
                and len(set(full)) == len(full)):
            raise ConfigError("full_attention_blocks", full,
                              f"distinct block indices in 0..{self.depth - 1}")
        self.full_attention_blocks = tuple(sorted(int(i) for i in full))
        if window is None:
            if full:
                raise ConfigError("full_attention_blocks", full, "empty without window_size",
                                  problem="full_attention_blocks needs window_size: without a "
                                  "window every block attends globally")
            return
        rows, cols = self.grid
        if is_int(window) and window > max(rows, cols):
            raise ConfigError("window_size", window, f"at most the grid side {max(rows, cols)}",
                              problem=f"window_size {window} patches is larger than the "
                              f"{rows}x{cols} patch grid at image_size {self.image_size[0]}x"
                              f"{self.image_size[1]}: one window would be global attention")
        self.window_size = check_int("window_size", window, 1, max(rows, cols))
        if self.num_prefix_tokens:
            raise ConfigError("window_size", window, "null with a class or register token",
                              problem="window attention windows the patch grid: a class or "
                              "register token lies in no window (class_token false, "
                              "num_register_tokens 0)")

    def _validate_mechanisms(self) -> None:
        """`layer_scale_init`, `mlp`'s activation and `hybrid_layers` (see `validate`)."""
        scale = self.layer_scale_init
        if scale is not None:
            if not (is_real(scale) and scale > 0):
                raise ConfigError("layer_scale_init", scale, "null or a finite number > 0")
            self.layer_scale_init = float(scale)
        if self.mlp == "swiglu" and self.act != "silu":
            raise ConfigError("act", self.act, "silu with mlp swiglu",
                              problem=f"mlp 'swiglu' gates with SiLU: act must be 'silu', got "
                              f"{self.act!r}")
        if self.mlp_norm and self.mlp != "swiglu":
            raise ConfigError("mlp_norm", True, "false unless mlp is swiglu",
                              problem=f"mlp_norm normalises SwiGLU's gated hidden activation: it "
                              f"needs mlp 'swiglu', got mlp {self.mlp!r}")
        if self.patch_norm and self.hybrid_layers is not None:
            raise ConfigError("patch_norm", True, "false with hybrid_layers",
                              problem="patch_norm normalises the Conv2d or Conv3d patch "
                              "embedding's output: the hybrid's has none")
        if self.pos_embed == "sincos" and self.width % 4:
            raise ConfigError("pos_embed", "sincos", "a width divisible by 4",
                              problem=f"pos_embed 'sincos' splits the width in four (sin and "
                              f"cos of rows and columns): width {self.width} is not "
                              "divisible by 4")
        frames = self.temporal_patch_size
        if frames is not None:
            self.temporal_patch_size = check_int("temporal_patch_size", frames, 1,
                                                 MAX_TEMPORAL_PATCH)
            if self.hybrid_layers is not None:
                raise ConfigError("temporal_patch_size", frames, "null with hybrid_layers",
                                  problem="temporal_patch_size and hybrid_layers are two patch "
                                  "embeddings: choose one")
        if self.hybrid_layers is None:
            return
        layers = self.hybrid_layers
        if not (isinstance(layers, (tuple, list)) and 1 <= len(layers) <= MAX_HYBRID_STAGES
                and all(is_int(n) and 1 <= n <= MAX_HYBRID_BLOCKS for n in layers)):
            raise ConfigError("hybrid_layers", layers,
                              f"null or 1 to {MAX_HYBRID_STAGES} block counts "
                              f"(1..{MAX_HYBRID_BLOCKS}), one per ResNet stage")
        self.hybrid_layers = tuple(int(n) for n in layers)
        stride = hybrid_stride(self.hybrid_layers)
        if self.patch_size != stride:
            raise ConfigError("patch_size", self.patch_size, f"{stride}, the hybrid's stride",
                              problem=f"hybrid_layers {self.hybrid_layers} make a ResNet of "
                              f"stride {stride}: patch_size must be {stride}, got "
                              f"{self.patch_size}")

    def _validate_rope(self) -> None:
        """`rope_theta`, `rope_reference_grid`, and a head dimension 2D RoPE can split (see
        `validate`)."""
        theta, reference = self.rope_theta, self.rope_reference_grid
        if self.rope_positions == "centered" and (theta is None or reference is not None):
            raise ConfigError("rope_positions", "centered", "index without rope_theta or with "
                              "rope_reference_grid",
                              problem="rope_positions 'centered' places 2D RoPE's patches at "
                              "their centres over each image's own grid: it needs rope_theta "
                              f"(got {theta!r}) and no rope_reference_grid (got {reference!r})")
        if self.rope_positions == "one_based" and theta is None:
            raise ConfigError("rope_positions", "one_based", "index without rope_theta",
                              problem="rope_positions 'one_based' counts 2D RoPE's patches from "
                              "1: it needs rope_theta, which is null")
        if theta is None:
            if reference is not None:
                raise ConfigError("rope_reference_grid", reference, "null without rope_theta",
                                  problem="rope_reference_grid rescales 2D RoPE positions: it "
                                  f"needs rope_theta, which is null (got {reference!r})")
            return
        if reference is not None:
            self.rope_reference_grid = _as_pair(reference, "rope_reference_grid")
        if not (is_real(theta) and theta > 0):
            raise ConfigError("rope_theta", theta, "null or a finite number > 0")
        self.rope_theta = float(theta)
        head_dim = self.width // self.heads
        if head_dim % 4:
            raise ConfigError("heads", self.heads, "heads giving a head dimension divisible by 4",
                              problem=f"2D RoPE needs a head dimension divisible by 4 (a quarter "
                              f"each for rows and columns in both rotation halves): width "
                              f"{self.width} / heads {self.heads} = {head_dim}")

    @property
    def grid(self) -> tuple[int, int]:
        """The patch grid (rows, cols) at `image_size`."""
        return (self.image_size[0] // self.patch_size, self.image_size[1] // self.patch_size)

    @property
    def num_prefix_tokens(self) -> int:
        """Class token plus register tokens, placed before the patch tokens."""
        return int(self.class_token) + self.num_register_tokens

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> EncoderConfig:
        """The config of a named variant, e.g. ``"vit-b/16"`` or ``"clip-vit-l/14-336"``.

        Args:
            name: a name from `available_variants()`.
            **overrides: any field to change, e.g. ``image_size=(384, 384)``.

        Raises:
            UnknownNameError: (a KeyError) for an unknown name, listing the close matches.
        """
        key = name.lower()
        if key not in VARIANTS:
            raise unknown_name_error("variant", name, VARIANTS)
        return cls(**{**VARIANTS[key], **overrides})

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values (what `config.json` records under `encoder`)."""
        data = dataclasses.asdict(self)
        data["image_size"] = list(self.image_size)
        if self.hybrid_layers is not None:
            data["hybrid_layers"] = list(self.hybrid_layers)
        data["full_attention_blocks"] = list(self.full_attention_blocks)
        if self.rope_reference_grid is not None:
            data["rope_reference_grid"] = list(self.rope_reference_grid)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: object = None) -> EncoderConfig:
        """Builds a config from `to_dict()` output; unknown keys are an error, not ignored.

        Args:
            data: the fields, e.g. the `encoder` section of a native `config.json`.
            source: the file `data` comes from, named in every error.

        Raises:
            ConfigError: (a ValueError) for a value `validate` refuses, naming `source`.
            ValueError: for unknown fields, or `data` that is not a dict.
        """
        where = f"{source}: " if source is not None else ""
        if not isinstance(data, dict):
            raise ValueError(f"{where}the encoder config must be a JSON object of fields, "
                             f"got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}unknown EncoderConfig fields: "
                             f"{', '.join(map(str, unknown))}; known: {', '.join(sorted(known))}")
        try:
            return cls(**data)
        except ConfigError as error:
            if source is None:
                raise
            raise error.located(source) from None

def hybrid_stride(layers: tuple[int, ...]) -> int:
    """The hybrid ResNet's overall stride: 4 in the stem, then 2 in every stage after the
    first (`layers.hybrid_stem.ResNetV2Backbone.stride`); 16 for R50+ViT-B/16's 3 stages."""
    return 4 * 2 ** (len(layers) - 1)


def _vit(width: int, depth: int, heads: int, mlp_width: int, patch: int, **extra: Any) -> dict:
    return dict(width=width, depth=depth, heads=heads, mlp_width=mlp_width, patch_size=patch,
                **extra)


# CLIP towers: a LayerNorm before the blocks, QuickGELU, eps 1e-5, no bias in the patch conv.
_CLIP = dict(pre_norm=True, act="quick_gelu", norm_eps=1e-5, patch_bias=False)

VARIANTS: dict[str, dict[str, Any]] = {
    # DeiT sizes (Touvron et al. 2021), used by timm and big_vision.
    "vit-ti/16": _vit(192, 12, 3, 768, 16),
    "vit-s/16": _vit(384, 12, 6, 1536, 16),
    # Paper, Table 1.
    "vit-b/16": _vit(768, 12, 12, 3072, 16),
    "vit-b/32": _vit(768, 12, 12, 3072, 32),
    "vit-l/14": _vit(1024, 24, 16, 4096, 14),
    "vit-l/16": _vit(1024, 24, 16, 4096, 16),
    "vit-l/32": _vit(1024, 24, 16, 4096, 32),
    "vit-h/14": _vit(1280, 32, 16, 5120, 14),
    # CLIP (Radford et al. 2021) image towers.
    "clip-vit-b/32": _vit(768, 12, 12, 3072, 32, **_CLIP),
    "clip-vit-b/16": _vit(768, 12, 12, 3072, 16, **_CLIP),
    "clip-vit-l/14": _vit(1024, 24, 16, 4096, 14, **_CLIP),
    "clip-vit-l/14-336": _vit(1024, 24, 16, 4096, 14, image_size=(336, 336), **_CLIP),
    # Paper, section 3.1 and Table 5: ViT-B over a ResNet-50 of 3 stages (3, 4, 9 blocks),
    # "patch" 16 relative to the input; timm's vit_base_r50_s16_384 (at 384 x 384).
    "r50+vit-b/16": _vit(768, 12, 12, 3072, 16, image_size=(384, 384), hybrid_layers=(3, 4, 9)),
}


def available_variants() -> list[str]:
    """Names accepted by `EncoderConfig.from_name`."""
    return list(VARIANTS)
