"""The Vision Transformer encoder of Dosovitskiy et al., "An Image is Worth 16x16 Words:
Transformers for Image Recognition at Scale", ICLR 2021, section 3.1.

    z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos          (eq. 1)
    z'_l = MSA(LN(z_{l-1})) + z_{l-1},    l = 1..L           (eq. 2)
    z_l = MLP(LN(z'_l)) + z'_l,           l = 1..L           (eq. 3)
    y = LN(z_L)                                              (eq. 4, on every token here)

The encoder returns every token; pooling and projection happen outside it (`vlm_vit.poolers`).
Shapes: B images, N patches on a (rows, cols) grid, D the width, T = prefix + N tokens.
"""

from __future__ import annotations

import operator
from typing import Any, overload

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import vlm_vit.layers as layers
from vlm_vit.config import EncoderConfig
from vlm_vit.io.native import CONFIG_NAME as CONFIG_NAME  # re-exported: importers use these names
from vlm_vit.io.native import MODEL_TYPE as MODEL_TYPE
from vlm_vit.io.native import WEIGHTS_NAME as WEIGHTS_NAME
from vlm_vit.io.native import NativeFormat
from vlm_vit.io.native import check_state_dict as check_state_dict
from vlm_vit.layers import Attention, Segments
from vlm_vit.layers.patch_masking import keep_patches, mask_patches
from vlm_vit.layers.pos_embed import resample_pos_embed_cached
from vlm_vit.layers.pos_resize_sampled import resize_position_table
from vlm_vit.layers.residual import add_residual
from vlm_vit.layers.rope_one_based import build_rope
from vlm_vit.outputs import BlocksOutput, BlocksRecorder, EncoderOutput, PackedOutput
from vlm_vit.packing import encode_packed


class Block(nn.Module):
    """One pre-norm Transformer block (eqs. 2 and 3); each branch optionally LayerScaled
    (`ls1`, `ls2`: identities unless `layer_scale_init` is set)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        width = config.width
        self.norm1 = layers.build_norm(config.norm, width, config.norm_eps)
        self.attn = Attention(width, config.heads, qkv_bias=config.qkv_bias)
        self.ls1 = layers.build_layer_scale(width, config.layer_scale_init)
        self.norm2 = layers.build_norm(config.norm, width, config.norm_eps)
        self.mlp = layers.build_mlp(config.mlp, width, config.mlp_width, act=config.act,
                                    inner_norm=config.norm if config.mlp_norm else None,
                                    norm_eps=config.norm_eps)
        self.ls2 = layers.build_layer_scale(width, config.layer_scale_init)

    def forward(
        self, x: torch.Tensor, need_weights: bool = False, segments: Segments | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        windows: layers.Windows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | tuple[torch.Tensor, ...] | None]:
        attended, weights = self.attn(self.norm1(x), need_weights=need_weights,
                                      segments=segments, rope=rope, windows=windows)
        x = add_residual(x, self.ls1(attended))
        x = add_residual(x, self.ls2(self.mlp(self.norm2(x))))
        return x, weights


class VisionEncoder(NativeFormat, nn.Module):
    """The ViT encoder: patches in, every token out.

    Parameter names follow timm (`patch_embed.proj`, `cls_token`, `pos_embed`, `reg_token`,
    `norm_pre`, `blocks.N.{norm1,attn.qkv,attn.proj,ls1.gamma,norm2,mlp.fc1,mlp.fc2,ls2.gamma}`,
    SwiGLU's `mlp.{fc1_g,fc1_x,fc2}`, the hybrid's `patch_embed.backbone.*`, `norm`).
    `save_pretrained`, `from_pretrained` and `from_state_dict` come from `NativeFormat`
    (`vlm_vit.io.native`).

    Args:
        config: the architecture.
    """

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        width = config.width
        self.patch_embed = layers.build_patch_embed(
            config.patch_size, config.in_channels, width, config.patch_bias, config.hybrid_layers,
            config.temporal_patch_size,
            layers.build_norm(config.norm, width, config.norm_eps) if config.patch_norm else None)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width)) if config.class_token else None
        self.reg_token = (nn.Parameter(torch.zeros(1, config.num_register_tokens, width))
                          if config.num_register_tokens else None)
        # E_pos covers the class token (if any) and the patches; registers have no position.
        # A RoPE tower may have none: positions then enter only as q and k's rotation.
        entries = int(config.class_token) + config.grid[0] * config.grid[1]
        self.pos_embed = nn.Parameter(torch.zeros(1, entries, width)) \
            if config.pos_embed == "learned" else None
        self.rope = build_rope(width // config.heads, config.rope_theta,
                               config.rope_frequencies, config.rope_reference_grid,
                               config.rope_positions)
        self.norm_pre = layers.build_norm(config.norm, width, config.norm_eps) if config.pre_norm \
            else None
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.norm = layers.build_norm(config.norm, width, config.norm_eps) if config.final_norm \
            else None
        self._pos_cache: dict[tuple, torch.Tensor] = {}  # resized tables per grid, not saved
        self.gradient_checkpointing = False  # set by the trainer to trade compute for memory
        if not self.blocks[0].attn.qkv.weight.is_meta:  # a meta model is a shell for weights
            self.init_weights()

    @property
    def num_prefix_tokens(self) -> int:
        return self.config.num_prefix_tokens

    def init_weights(self) -> None:
        """timm's initialisation: truncated normal 0.02 for tables and Linears, zero biases."""
        if self.pos_embed is not None:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for token in (self.cls_token, self.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d, nn.Conv3d)):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        self._pos_cache.clear()

    # -- eq. 1: patch embedding, class token, position embedding -----------------------------

    def position_table(self, grid: tuple[int, int]) -> torch.Tensor:
        """E_pos for a patch grid, `[1, class + rows * cols, D]`, resized if needed: cached
        per grid while not trained, traced under `torch.export` (`resample_pos_embed_cached`);
        the fixed sin-cos table (`pos_embed="sincos"`) is computed for the grid."""
        if self.config.pos_embed == "sincos":
            return layers.sincos_position_table(grid, self.config.width,
                                                int(self.config.class_token),
                                                device=self.blocks[0].attn.qkv.weight.device)
        resize = dict(num_prefix_tokens=int(self.config.class_token),
                      mode=self.config.pos_resize_mode, antialias=self.config.pos_resize_antialias)
        if self.config.pos_resize_mode == "bicubic_grid_sample":
            # GLM-4V's, not cached: it samples its own grid too
            return resize_position_table(self.pos_embed, self.config.grid, grid, **resize)
        return resample_pos_embed_cached(self.pos_embed, self.config.grid, grid, self._pos_cache,
                                         resample=resize_position_table, **resize)

    def prepare_tokens(
        self,
        pixel_values: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        mask_token: torch.Tensor | None = None,
        source_index: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[int, int]]:
        """z_0: pixels to tokens (before the pre-norm), with the masking of pretraining.

        Args:
            pixel_values: `[B, C, H, W]`.
            mask: `[B, N]` bool, patches whose embedding becomes `mask_token` (the paper's
                masked patch prediction, BEiT).
            mask_token: `[D]`, the learned [mask] embedding (owned by the objective).
            source_index: `[B, N]` indices into the batch's B * N patch embeddings: patch
                (b, n) takes embedding `source_index[b, n]` (the paper's "random other
                patch"; the identity leaves everything in place).
            keep: `[B, K]` indices of the patches to keep, after the position embedding
                (MAE: the encoder sees the visible patches only).

        Returns:
            Tokens `[B, prefix + N (or K), D]` and the full patch grid.
        """
        x, grid = self.patch_embed(pixel_values)  # (B, N, D)
        x = mask_patches(x, mask=mask, mask_token=mask_token, source_index=source_index)
        return self.embed_patches(x, grid, keep=keep), grid

    def embed_patches(self, x: torch.Tensor, grid: tuple[int, int], *,
                      keep: torch.Tensor | None = None) -> torch.Tensor:
        """Patch embeddings `[B, N, D]` of a `grid` to z_0: E_pos added (resized to the grid),
        MAE's `keep` applied, then the class and register tokens in front."""
        batch, _, _ = x.shape  # (B, N, D)
        cls_entries = int(self.cls_token is not None)
        table = None if self.config.pos_embed == "none" else self.position_table(grid).to(x.dtype)
        if table is not None:
            x = x + table[:, cls_entries:]
        if keep is not None:
            x = keep_patches(x, keep)  # (B, K, D)
        prefix = []
        if self.cls_token is not None:
            cls_token = self.cls_token if table is None else self.cls_token + table[:, :1]
            prefix.append(cls_token.expand(batch, -1, -1))
        if self.reg_token is not None:
            prefix.append(self.reg_token.expand(batch, -1, -1))
        if prefix:
            x = torch.cat([*(p.to(x.dtype) for p in prefix), x], dim=1)
        return x

    # -- eqs. 2 to 4 -------------------------------------------------------------------------

    def layer_index(self, layer: int) -> int:
        """A hidden-state index (0 = embeddings, i = block i; negative from the end)."""
        count = self.config.depth + 1
        index = operator.index(layer)
        if not -count <= index < count:
            raise ValueError(
                f"feature layer {layer} is out of range for depth {self.config.depth} "
                f"(valid: {-count} to {count - 1})"
            )
        return index % count

    @overload
    def forward(self, pixel_values: torch.Tensor, **options: Any) -> EncoderOutput: ...

    @overload
    def forward(self, pixel_values: list[torch.Tensor] | tuple[torch.Tensor, ...],
                **options: Any) -> PackedOutput: ...

    def forward(
        self,
        pixel_values: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...],
        *,
        feature_layers: list[int] | tuple[int, ...] | int | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        mask: torch.Tensor | None = None,
        mask_token: torch.Tensor | None = None,
        source_index: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> EncoderOutput | PackedOutput:
        """Encodes images.

        Args:
            pixel_values: `[B, C, H, W]`, H and W multiples of the patch size; or a list of
                `[C, H_i, W_i]` images of any sizes (and, with a temporal patch embedding,
                `[frames, C, H, W]` clips), handed to `forward_packed`.
            feature_layers: hidden-state indices whose raw tokens to return in `features`
                (`[-2]` for LLaVA). Alone, they stop the run after the deepest one.
            output_hidden_states: return every hidden state.
            output_attentions: return every block's attention maps (computed explicitly).
            mask, mask_token, source_index, keep: pretraining's masking, applied in
                `prepare_tokens` (see there). With `keep`, `patch_tokens` holds the K kept
                patches, in `keep`'s order.

        Returns:
            An `EncoderOutput` for a batch; a `PackedOutput` for a list (see `forward_packed`).

        Raises:
            ValueError: for a bad shape, a side that is not a multiple of the patch size, or
                a feature layer out of range.
        """
        if isinstance(pixel_values, (list, tuple)):
            if any(t is not None for t in (mask, mask_token, source_index, keep)):
                raise ValueError("masking (mask, source_index, keep) takes a [B, C, H, W] "
                                 "batch of one size, not a list of images")
            return self.forward_packed(pixel_values, feature_layers=feature_layers,
                                       output_hidden_states=output_hidden_states,
                                       output_attentions=output_attentions)
        if keep is not None and self.rope is not None:
            raise ValueError("keep (MAE's visible patches) is not supported with 2D RoPE")
        x, grid = self.prepare_tokens(pixel_values, mask=mask, mask_token=mask_token,
                                      source_index=source_index, keep=keep)
        run = self.run_blocks(x, feature_layers=feature_layers,
                              output_hidden_states=output_hidden_states,
                              output_attentions=output_attentions, grids=[grid])
        return EncoderOutput.from_blocks(run, grid, self.num_prefix_tokens,
                                         has_class_token=self.cls_token is not None)

    def forward_packed(
        self,
        images: list[torch.Tensor] | tuple[torch.Tensor, ...],
        *,
        feature_layers: list[int] | tuple[int, ...] | int | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        backend: str = "auto",
        max_tokens: int | None = None,
        max_grid: tuple[int, int] | None = None,
        masks: list[torch.Tensor | None] | None = None,
        mask_token: torch.Tensor | None = None,
        keeps: list[torch.Tensor | None] | None = None,
    ) -> PackedOutput:
        """Encodes images of different sizes in one packed pass (NaViT; `vlm_vit.packing`):
        each image's tokens equal `self(image[None])`'s, end to end in one `[total, D]`.

        Args:
            images: `[C, H_i, W_i]` tensors, each side a multiple of the patch size, or
                clips `[frames, C, H, W]` (see `vlm_vit.packing`).
            feature_layers, output_hidden_states, output_attentions: as in `forward`
                (attention maps come per image, `[heads, L_i, L_i]`).
            backend, max_tokens, max_grid, masks, mask_token, keeps: as in
                `vlm_vit.packing.encode_packed` (masks and keeps: one per image, over its
                own grid).

        Returns:
            A `PackedOutput` (`.split()` gives one `EncoderOutput` per image).

        Raises:
            ValueError: for a bad list (naming the image) or feature layer.
        """
        return encode_packed(self, images, feature_layers=feature_layers,
                             output_hidden_states=output_hidden_states,
                             output_attentions=output_attentions, backend=backend,
                             max_tokens=max_tokens, max_grid=max_grid, masks=masks,
                             mask_token=mask_token, keeps=keeps)

    def run_blocks(
        self,
        x: torch.Tensor,
        *,
        feature_layers: list[int] | tuple[int, ...] | int | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        segments: Segments | None = None,
        grids: list[tuple[int, int]] | tuple[tuple[int, int], ...] | None = None,
    ) -> BlocksOutput:
        """Eqs. 2 to 4 on prepared tokens `[B, T, D]` (z_0 before the pre-norm).

        Args:
            x: the tokens; with `segments`, `[1, T, D]` holding several images end to end.
            feature_layers, output_hidden_states, output_attentions: as in `forward`.
            segments: the images of a packed sequence; attention stays within each.
            grids: each image's patch grid (one for a batch), for 2D RoPE's angles.
        """
        if isinstance(feature_layers, int):
            feature_layers = [feature_layers]
        wanted = [self.layer_index(i) for i in feature_layers] if feature_layers else []
        depth = self.config.depth
        run_to = max(wanted) if wanted and not (output_hidden_states or output_attentions) \
            else depth

        if self.norm_pre is not None:
            x = self.norm_pre(x)
        record = BlocksRecorder(x, wanted, output_hidden_states, output_attentions)
        rope = None if self.rope is None else \
            self.rope.for_grids(grids, self.num_prefix_tokens, device=x.device)
        windows = layers.build_windows(  # Qwen2.5-VL's window attention, or None
            self.config.window_size, grids, x.shape[0] * x.shape[1],
            batch=x.shape[0] if segments is None else 1,
            backend="auto" if segments is None else segments.backend, device=x.device)
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for index, block in enumerate(self.blocks[:run_to], start=1):
            local = None if index - 1 in self.config.full_attention_blocks else windows
            if checkpointing:  # recompute activations in backward; non-reentrant, so LoRA works
                x, weights = checkpoint(block, x, output_attentions, segments, rope, local,
                                        use_reentrant=False)
            else:
                x, weights = block(x, need_weights=output_attentions, segments=segments,
                                   rope=rope, windows=local)
            record.add(index, x, weights)

        tokens = None
        if run_to == depth:
            tokens = self.norm(x) if self.norm is not None else x
        return record.output(tokens)

    def resize_image(self, image_size: int | tuple[int, int]) -> None:
        """Makes `image_size` the native size, resizing the position table once (paper 3.2)."""
        new = EncoderConfig.from_dict({**self.config.to_dict(), "image_size": image_size})
        if self.pos_embed is None:  # nothing to resize: RoPE takes any grid
            self.config = new
            return
        with torch.no_grad():
            table = resize_position_table(
                self.pos_embed.data, self.config.grid, new.grid,
                num_prefix_tokens=int(new.class_token), mode=new.pos_resize_mode,
                antialias=new.pos_resize_antialias,
            )
        self.pos_embed = nn.Parameter(table.clone(), requires_grad=self.pos_embed.requires_grad)
        self.config = new
        self._pos_cache.clear()

