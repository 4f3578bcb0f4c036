"""A fixed-capacity packed program (issue 46): the encoder's blocks over one buffer of exactly
N tokens, as `vlm_vit.budget.encode_budget` fills it, with everything that depends on the
packing given as inputs, so one graph, with no data-dependent shape or guard, serves every
mix of image sizes (what a server captures once as a CUDA graph or an exported program).

Inputs, per buffer (`budget_inputs` builds them; `INPUTS` describes them):

    patches      float32 [N, C*P*P]  each patch token's pixels, flattened (c, i, j) as the
                                     patch kernel; zeros for prefix and padding tokens
    token_kind   int64   [N]         0 padding, 1 patch, 2 + k: prefix token k (the class
                                     token first, then the registers)
    segment_ids  int64   [N]         each token's image in the buffer; the padding one more
    positions    float32 [N, D]      E_pos per token, resized to its image's grid (the class
                                     token's row for it, zeros for registers and padding);
                                     only with a position table
    rope_cos, rope_sin float32 [N, head_dim]  2D RoPE's angles per token; only with RoPE
    window_ids   int64   [N]         each token's attention window; only with windows

and one output, `tokens` float32 [N, D], every token after the final norm. Attention is one
`scaled_dot_product_attention` over the buffer under the block-diagonal mask
`segment_ids[:, None] == segment_ids[None, :]` (`window_ids` for windowed blocks), built in
the graph; the padding attends only to itself, as in eager. The table resize, the angles
and the windows, which depend on each image's grid, stay outside the graph: a server caches
them per grid. The mask costs N x N scores per head where varlen kernels compute only the
images' own (sum L_i^2): the price of one fixed graph. In ONNX Runtime the program equals
eager `encode_budget` within 2.4e-6 (tests/test_export_budget.py: the Linear on flattened
patches and the masked softmax sum in another order than the convolution and per-image SDPA).

Not taken (`check_budget_encoder`): the hybrid's ResNet stem (a token's embedding is not a
function of its own patch), and, as in `encode_budget`, 2D RoPE with prefix tokens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vlm_vit.budget import MAX_BUDGET, BudgetOutput, BudgetPlan, encode_budget, plan_budget
from vlm_vit.deploy.export import ONNX_OPSET
from vlm_vit.deploy.export_runtime import ExportError, require_onnx, staged_output
from vlm_vit.layers.residual import add_residual
from vlm_vit.layers.rope_2d import apply_rope
from vlm_vit.layers.window_segments import build_windows

logger = logging.getLogger(__name__)

PADDING, PATCH, PREFIX = 0, 1, 2  # token_kind values; prefix token k is PREFIX + k
METADATA_KEY = "vlm_vit.budget"  # the ONNX metadata entry holding `budget_metadata`
INPUTS = {  # name -> what it holds (shapes in `budget_metadata`)
    "patches": "each patch token's pixels flattened (channel, row, column in the patch); "
               "zeros elsewhere",
    "token_kind": "0 padding, 1 patch, 2 + k prefix token k (class token first, then "
                  "registers)",
    "segment_ids": "each token's segment: its image's place in the buffer, the padding last",
    "positions": "each token's position-table row, resized to its image's grid (class token: "
                 "row 0; registers and padding: zeros)",
    "rope_cos": "2D RoPE cosines per token (padding: a grid of 1 x padding)",
    "rope_sin": "2D RoPE sines per token",
    "window_ids": "each token's attention window, unique in the buffer",
}


def check_budget_encoder(encoder) -> None:
    """An ExportError, naming the feature, for an encoder the budget program cannot hold."""
    config = encoder.config
    if config.hybrid_layers is not None:
        raise ExportError("--budget cannot export a hybrid (ResNet stem) encoder: its stem "
                          "convolves the whole image, so a token is not a function of its "
                          "own patch's pixels")
    if encoder.rope is not None and encoder.num_prefix_tokens:
        raise ExportError("--budget cannot export an encoder with 2D RoPE and prefix (class "
                          "or register) tokens, as encode_budget cannot encode one")
    if encoder.blocks[0].attn.qkv.weight.dtype != torch.float32:
        raise ExportError("--budget exports a float32 encoder")


def input_names(encoder) -> list[str]:
    """The program's inputs for `encoder`, in order."""
    names = ["patches", "token_kind", "segment_ids"]
    if encoder.config.pos_embed != "none":
        names.append("positions")
    if encoder.rope is not None:
        names += ["rope_cos", "rope_sin"]
    if encoder.config.window_size is not None:
        names.append("window_ids")
    return names


def masked_attention(attn: nn.Module, x: torch.Tensor, mask: torch.Tensor,
                     rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """`Attention`'s packed path with the segments as a mask: tokens `[N, D]`, mask `[N, N]`
    bool (True: may attend), RoPE's cos and sin `[N, head_dim]` or None; returns `[N, D]`."""
    tokens, width = x.shape
    # (N, 3, heads, head_dim) -> three (N, heads, head_dim)
    q, k, v = attn.qkv(x).reshape(tokens, 3, attn.heads, attn.head_dim).unbind(1)
    if rope is not None:
        q, k = (apply_rope(t, rope[0][:, None], rope[1][:, None]) for t in (q, k))
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, N, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return attn.proj(out[0].transpose(0, 1).reshape(tokens, width))


class BudgetForward(nn.Module):
    """What the budget program computes: the inputs of one buffer (see the module) to its
    tokens `[N, D]` after the final norm; the encoder's own modules and weights."""

    def __init__(self, encoder) -> None:
        super().__init__()
        check_budget_encoder(encoder)
        self.encoder = encoder
        self.input_names = input_names(encoder)

    def patch_weight(self) -> torch.Tensor:
        """The patch kernel as a matrix `[D, C*P*P]` (an image through a temporal embedding
        is its frame repeated: the kernel summed over time, as `TemporalPatchEmbed` does)."""
        weight = self.encoder.patch_embed.proj.weight
        if weight.ndim == 5:  # (D, C, T, P, P)
            weight = weight.sum(dim=2)
        return weight.reshape(weight.shape[0], -1)

    def embed(self, patches: torch.Tensor, token_kind: torch.Tensor,
              positions: torch.Tensor | None) -> torch.Tensor:
        """z_0 `[N, D]` (before the pre-norm): eq. 1 per token, by its kind."""
        encoder = self.encoder
        embedded = F.linear(patches, self.patch_weight(), encoder.patch_embed.proj.bias)
        if getattr(encoder.patch_embed, "norm", None) is not None:
            embedded = encoder.patch_embed.norm(embedded)
        width = embedded.shape[-1]
        # rows PADDING and PATCH are zeros, then the prefix tokens: (2 + prefix, D)
        table = [embedded.new_zeros(PREFIX, width)]
        table += [token[0] for token in (encoder.cls_token, encoder.reg_token) if token is not None]
        prefix = torch.cat(table)[token_kind]  # (N, D)
        x = torch.where((token_kind == PATCH)[:, None], embedded, prefix)
        return x if positions is None else x + positions

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        named = dict(zip(self.input_names, inputs, strict=True))
        encoder = self.encoder
        x = self.embed(named["patches"], named["token_kind"], named.get("positions"))
        if encoder.norm_pre is not None:
            x = encoder.norm_pre(x)
        segments = named["segment_ids"]
        full = segments[:, None] == segments[None, :]  # (N, N) block-diagonal
        windows = full if "window_ids" not in named else \
            named["window_ids"][:, None] == named["window_ids"][None, :]
        rope = (named["rope_cos"], named["rope_sin"]) if "rope_cos" in named else None
        for index, block in enumerate(encoder.blocks):
            mask = full if index in encoder.config.full_attention_blocks else windows
            # Block.forward's two residual branches (eqs. 2 and 3)
            attended = masked_attention(block.attn, block.norm1(x), mask, rope)
            x = add_residual(x, block.ls1(attended))
            x = add_residual(x, block.ls2(block.mlp(block.norm2(x))))
        return x if encoder.norm is None else encoder.norm(x)


def patch_rows(image: torch.Tensor, patch: int) -> torch.Tensor:
    """An image `[C, H, W]` as one row per patch, row-major: `[rows * cols, C*P*P]`, each
    flattened (channel, row, column) as the patch kernel `[D, C, P, P]` is."""
    channels, height, width = image.shape
    rows, cols = height // patch, width // patch
    # (C, rows, P, cols, P) -> (rows, cols, C, P, P)
    return image.reshape(channels, rows, patch, cols, patch).permute(1, 3, 0, 2, 4) \
        .reshape(rows * cols, channels * patch * patch).float()


def budget_inputs(encoder, images: list[torch.Tensor] | tuple[torch.Tensor, ...], *,
                  tokens: int) -> tuple[BudgetPlan, list[dict[str, torch.Tensor]]]:
    """The program's inputs for `images`, buffer by buffer, laid out as `encode_budget`
    lays them (`vlm_vit.budget.plan_budget`).

    Returns:
        The plan, and per buffer the inputs by name (`input_names`).

    Raises:
        ValueError: as `encode_budget`.
    """
    plan = plan_budget(encoder, images, tokens=tokens)
    config, names = encoder.config, input_names(encoder)
    prefix, cls_entries = encoder.num_prefix_tokens, int(config.class_token)
    pixels_per_patch = config.in_channels * config.patch_size**2
    buffers = []
    for number, buffer in enumerate(plan.buffers):
        sizes, grids = plan.layout(number)
        patches, kinds, positions = [], [], []
        for index in buffer:
            rows = patch_rows(images[index], config.patch_size)
            patches += [rows.new_zeros(prefix, pixels_per_patch), rows]
            kinds.append(torch.cat([torch.arange(PREFIX, PREFIX + prefix),
                                    torch.full((len(rows),), PATCH)]))
            if "positions" in names:
                with torch.no_grad():
                    table = encoder.position_table(plan.grids[index])[0].float()
                positions.append(torch.cat([table[:cls_entries],
                                            table.new_zeros(prefix - cls_entries, config.width),
                                            table[cls_entries:]]))
        pad = tokens - sum(sizes[:len(buffer)])
        patches.append(torch.zeros(pad, pixels_per_patch))
        kinds.append(torch.full((pad,), PADDING))
        positions.append(torch.zeros(pad, config.width))
        inputs = {"patches": torch.cat(patches), "token_kind": torch.cat(kinds),
                  "segment_ids": torch.repeat_interleave(torch.arange(len(sizes)),
                                                         torch.tensor(sizes))}
        if "positions" in names:
            inputs["positions"] = torch.cat(positions)
        if "rope_cos" in names:
            inputs["rope_cos"], inputs["rope_sin"] = encoder.rope.for_grids(grids)
        if "window_ids" in names:
            inputs["window_ids"] = build_windows(config.window_size, grids, tokens).window_ids
        buffers.append({name: inputs[name] for name in names})
    return plan, buffers


def encode_with(run, encoder, images: list[torch.Tensor] | tuple[torch.Tensor, ...], *,
                tokens: int) -> BudgetOutput:
    """`encode_budget` through a program: `run` takes one buffer's inputs (a dict by name)
    and gives its tokens `[N, D]` (`onnx_budget_session`, or `BudgetForward` called on the
    dict's values)."""
    plan, buffers = budget_inputs(encoder, images, tokens=tokens)
    out: list[torch.Tensor | None] = [None] * len(images)
    for number, (indices, inputs) in enumerate(zip(plan.buffers, buffers, strict=True)):
        sizes, _ = plan.layout(number)
        for index, piece in zip(indices, run(inputs).split(sizes), strict=False):
            out[index] = piece
    return BudgetOutput(out, plan.buffers, plan.lengths, tokens)


def budget_metadata(encoder, tokens: int) -> dict:
    """What a server needs to fill the program's inputs: their names, shapes, dtypes and
    meaning, the token kinds, and the encoder's sizes."""
    config = encoder.config
    head_dim = config.width // config.heads
    shapes = {"patches": [tokens, config.in_channels * config.patch_size**2],
              "positions": [tokens, config.width], "rope_cos": [tokens, head_dim],
              "rope_sin": [tokens, head_dim]}
    inputs = [{"name": name, "shape": shapes.get(name, [tokens]),
               "dtype": "float32" if name in shapes else "int64", "meaning": INPUTS[name]}
              for name in input_names(encoder)]
    kinds = {str(PADDING): "padding", str(PATCH): "patch"}
    prefix = ["class token"] * int(config.class_token) + \
        [f"register {k}" for k in range(config.num_register_tokens)]
    kinds.update({str(PREFIX + k): name for k, name in enumerate(prefix)})
    return {"program": "vlm_vit.budget", "tokens": tokens, "patch_size": config.patch_size,
            "in_channels": config.in_channels, "width": config.width,
            "num_prefix_tokens": encoder.num_prefix_tokens, "inputs": inputs,
            "outputs": [{"name": "tokens", "shape": [tokens, config.width], "dtype": "float32",
                         "meaning": "every token after the final norm"}],
            "token_kind": kinds}


def check_budget(encoder, tokens: int) -> int:
    """`tokens` if a buffer of that many can hold an image (the prefix and one patch) and is
    at most `MAX_BUDGET`, else an ExportError naming the bound."""
    smallest = encoder.num_prefix_tokens + 1
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens > MAX_BUDGET:
        raise ExportError(f"--budget must be an integer of at most {MAX_BUDGET} tokens, "
                          f"got {tokens!r}")
    if tokens < smallest:
        raise ExportError(f"--budget {tokens} is too small: a buffer must hold an image of "
                          f"one patch, {smallest} tokens with this encoder's "
                          f"{encoder.num_prefix_tokens} prefix token(s)")
    return tokens


def sample_packings(encoder, tokens: int) -> list[list[tuple[int, int]]]:
    """Image sizes (H, W) for the checks: one image as square as fits; several of mixed
    shapes; and one that fills the buffer exactly (no padding)."""
    patch, prefix = encoder.config.patch_size, encoder.num_prefix_tokens
    room = tokens - prefix
    side = max(1, int(room**0.5))
    mixed, used = [], 0
    for rows, cols in [(2, 3), (1, 1), (3, 2), (2, 2), (1, 4), (3, 3)]:
        if used + prefix + rows * cols <= tokens:
            mixed.append((rows * patch, cols * patch))
            used += prefix + rows * cols
    return [[(side * patch, side * patch)], mixed or [(patch, patch)], [(patch, room * patch)]]


def export_budget_program(encoder, *, tokens: int) -> torch.export.ExportedProgram:
    """Traces `BudgetForward` with `torch.export` at `tokens` tokens: every shape static,
    every packing an input.

    Raises:
        ExportError: for an encoder it cannot hold (`check_budget_encoder`) or a budget out
            of range (`check_budget`).
    """
    forward = BudgetForward(encoder).eval()
    check_budget(encoder, tokens)
    _, buffers = budget_inputs(encoder, _images(encoder, sample_packings(encoder, tokens)[1]),
                               tokens=tokens)
    with torch.no_grad():
        return torch.export.export(forward, tuple(buffers[0].values()), strict=False)


def _images(encoder, sizes: list[tuple[int, int]], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(encoder.config.in_channels, *size, generator=generator)
            for size in sizes]


def onnx_budget_session(path: str | Path):
    """An ONNX Runtime session (CPU provider) on a budget program, as a callable: one
    buffer's inputs (by name) to its tokens `[N, D]`."""
    require_onnx("onnxruntime")
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [value.name for value in session.get_inputs()]

    def run(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.from_numpy(session.run(None, {n: inputs[n].numpy() for n in names})[0])

    return run


@dataclass
class BudgetReport:
    """What `export_budget_onnx` wrote and how it compares with eager `encode_budget`.

    Attributes:
        path: the ONNX file.
        sidecar: the JSON beside it (`budget_metadata`).
        tokens: the buffer's capacity N.
        checks: per packing checked, its image `sizes`, `buffers` and `max_abs_difference`.
    """

    path: Path
    sidecar: Path
    tokens: int
    checks: list[dict] = field(default_factory=list)

    @property
    def max_abs_difference(self) -> float:
        return max(check["max_abs_difference"] for check in self.checks)


def export_budget_onnx(encoder, path: str | Path, *, tokens: int) -> BudgetReport:
    """Writes the budget program as ONNX (`torch.onnx.export` of the `torch.export`
    program, opset `ONNX_OPSET`), its metadata in the file (`METADATA_KEY`) and in
    `PATH.json` beside it, then checks it in ONNX Runtime against eager `encode_budget` on
    `sample_packings`. Each file appears only once written (the ONNX file only once
    checked), the JSON after the ONNX file.

    Raises:
        ExportError: as `export_budget_program`, or for a `path` that is a directory.
        ImportError: without onnx, onnxscript and onnxruntime.
    """
    require_onnx("onnx", "onnxscript", "onnxruntime")
    forward = BudgetForward(encoder).eval()
    check_budget(encoder, tokens)
    metadata = budget_metadata(encoder, tokens)
    packings = sample_packings(encoder, tokens)
    sidecar = Path(path).with_name(Path(path).name + ".json")
    with staged_output(path) as staged:
        program = export_budget_program(encoder, tokens=tokens)
        with torch.no_grad():
            onnx_program = torch.onnx.export(program, dynamo=True, opset_version=ONNX_OPSET,
                                             input_names=forward.input_names,
                                             output_names=["tokens"], verbose=False)
        onnx_program.model.metadata_props[METADATA_KEY] = json.dumps(metadata)
        onnx_program.save(staged)
        run = onnx_budget_session(staged)
        checks = []
        for number, sizes in enumerate(packings):
            images = _images(encoder, sizes, seed=1 + number)
            with torch.no_grad():
                got = encode_with(run, encoder, images, tokens=tokens)
                expected = encode_budget(encoder, images, tokens=tokens)
            difference = max((a - b).abs().max().item()
                             for a, b in zip(got.tokens, expected.tokens, strict=True))
            checks.append({"sizes": [list(size) for size in sizes],
                           "buffers": len(expected.buffers), "max_abs_difference": difference})
            logger.info("budget %d, images %s: max |difference| %.3g", tokens, sizes,
                        difference)
    with staged_output(sidecar) as staged:
        staged.write_text(json.dumps(metadata, indent=2) + "\n")
    return BudgetReport(Path(path), sidecar, tokens, checks)
