"""Native resolution: images of different sizes encoded in one packed pass (NaViT, Dehghani
et al. 2023, "Patch n' Pack: NaViT, a Vision Transformer for any Aspect Ratio and
Resolution").

Each image is embedded as it would be alone (its own patch grid, its own resize of E_pos,
paper section 3.2, with the encoder's cache, its own class and register tokens); the token
sequences are then laid end to end in one `[1, total, D]` tensor, and every block runs once
over it, attention restricted to each image (`vlm_vit.layers.varlen`). So each image's
tokens equal `encoder(image[None])` for that image alone, while the Linears, norms and MLPs,
most of the FLOPs, run as one matrix with no padding.

    out = encoder.forward_packed([image_0, image_1, ...])  # [C, H_i, W_i] each; PackedOutput
    out.tokens                                             # [total, D]
    out.split()                                            # one EncoderOutput per image

`encoder([image_0, image_1, ...])` is the same call (`forward` hands a list on).

Video (Qwen2-VL): with a temporal patch embedding (`temporal_patch_size`), an item of the list
may be a clip `[frames, C, H, W]`. Its frames are padded to a multiple of the temporal patch
by repeating the last one (as Qwen2-VL's processor does), its T x P x P tubes embedded by
the Conv3d, and each of its `frames / T` temporal slices is then one segment with the
image's grid, attention within the slice, as in Qwen2-VL's tower. `out.frames` says how many
segments each input gave.

Masked pretraining at native resolution passes one mask per image (`masks=`, each over that
image's own grid, with the objective's `mask_token`): each image's masked patches are replaced
in its own z_0, so a mask never reaches another image.
"""

from __future__ import annotations

from typing import Protocol

import torch

from vlm_vit.config import EncoderConfig
from vlm_vit.layers.varlen import Segments
from vlm_vit.outputs import BlocksOutput, PackedOutput


class PackableEncoder(Protocol):
    """What packing needs of an encoder (`vlm_vit.model.VisionEncoder` is one): its config
    (channels, patch size), its prefix, eq. 1 for one image and the blocks over a sequence."""

    config: EncoderConfig
    cls_token: torch.Tensor | None

    @property
    def num_prefix_tokens(self) -> int: ...

    def prepare_tokens(self, pixel_values: torch.Tensor, *, mask: torch.Tensor | None = None,
                       mask_token: torch.Tensor | None = None,
                       keep: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, tuple[int, int]]: ...

    def embed_patches(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor: ...

    def run_blocks(self, x: torch.Tensor, *,
                   feature_layers: list[int] | tuple[int, ...] | int | None = None,
                   output_hidden_states: bool = False, output_attentions: bool = False,
                   segments: Segments | None = None,
                   grids: list[tuple[int, int]] | None = None) -> BlocksOutput: ...


class PackedImages(tuple):
    """A batch of `[C, H_i, W_i]` images of different sizes, for packed encoding: a tuple
    with what the trainer asks of a batch (`len`, `.to(device)`, `.tensor_split(n)`), so
    packed batches train like stacked ones (see `vlm_vit.train.token_budget`)."""

    def to(self, *args, **kwargs) -> PackedImages:
        """Every image moved or cast as `torch.Tensor.to` does."""
        return PackedImages(image.to(*args, **kwargs) for image in self)

    def tensor_split(self, sections: int) -> tuple[PackedImages, ...]:
        """`sections` consecutive parts of near-equal image counts, as `torch.tensor_split`."""
        bounds = torch.arange(len(self)).tensor_split(sections)
        return tuple(PackedImages(self[int(b[0]):int(b[-1]) + 1] if len(b) else ())
                     for b in bounds)


def pad_frames(clip: torch.Tensor, temporal_patch_size: int) -> torch.Tensor:
    """A clip `[frames, C, H, W]` with its last frame repeated up to a multiple of the
    temporal patch (Qwen2-VL's processor)."""
    short = -clip.shape[0] % temporal_patch_size
    return torch.cat([clip, clip[-1:].expand(short, -1, -1, -1)]) if short else clip


def check_images(encoder: PackableEncoder, images: list[torch.Tensor] | tuple[torch.Tensor, ...],
                 *, max_tokens: int | None = None,
                 max_grid: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    """Checks a list of images (and clips) for packing; returns their patch grids (a clip's:
    the grid of each of its frames).

    Raises:
        ValueError: for an empty list, an image that is not `[C, H, W]` (or a clip
            `[frames, C, H, W]` for an encoder with a temporal patch embedding) with the
            encoder's channels, a side that is not a positive multiple of the patch size, a
            grid over `max_grid`, or a pack over `max_tokens`, naming the image index and its
            size.
    """
    if not isinstance(images, (list, tuple)) or not images:
        raise ValueError("packed encoding needs a non-empty list of [C, H, W] images")
    channels, patch = encoder.config.in_channels, encoder.config.patch_size
    temporal = encoder.config.temporal_patch_size
    grids, total = [], 0
    for index, image in enumerate(images):
        clip = isinstance(image, torch.Tensor) and image.ndim == 4 and temporal is not None
        if not isinstance(image, torch.Tensor) or not (image.ndim == 3 or clip):
            shape = list(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
            hint = "" if temporal is None else " or a [frames, C, H, W] clip"
            if isinstance(image, torch.Tensor) and image.ndim == 4 and temporal is None:
                hint = " (a [frames, C, H, W] clip needs an encoder with a temporal patch " \
                       "embedding: temporal_patch_size)"
            raise ValueError(f"image {index} must be a [C, H, W] tensor, got {shape}{hint}")
        if clip and image.shape[0] == 0:
            raise ValueError(f"clip {index} has no frame ({list(image.shape)})")
        if image.shape[-3] != channels:
            raise ValueError(f"image {index} has {image.shape[-3]} channels "
                             f"({list(image.shape)}); the encoder takes {channels}")
        height, width = image.shape[-2:]
        if height % patch or width % patch or height == 0 or width == 0:
            raise ValueError(f"image {index} is {height}x{width}: each side must be a positive "
                             f"multiple of the patch size {patch}")
        grid = (height // patch, width // patch)
        if max_grid is not None and (grid[0] > max_grid[0] or grid[1] > max_grid[1]):
            raise ValueError(f"image {index} is {height}x{width}, a {grid[0]}x{grid[1]} grid, "
                             f"over the maximum grid {max_grid[0]}x{max_grid[1]}")
        grids.append(grid)
        slices = -(-image.shape[0] // temporal) if clip else 1
        total += slices * (encoder.num_prefix_tokens + grid[0] * grid[1])
    if max_tokens is not None and total > max_tokens:
        raise ValueError(f"the {len(images)} images make {total} tokens, over the budget of "
                         f"{max_tokens} (sizes: {[tuple(i.shape[1:]) for i in images]})")
    return grids


def check_masks(masks: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...] | None,
                grids: list[tuple[int, int]], images: list[torch.Tensor] | tuple[torch.Tensor, ...]
                ) -> list[torch.Tensor | None]:
    """Each image's mask flattened to `[rows * cols]` (None where it has none).

    Raises:
        ValueError: for a count other than one per image, a mask that is not bool, one whose
            size is not its image's grid, or a mask on a clip, naming the image.
    """
    if masks is None:
        return [None] * len(grids)
    if len(masks) != len(grids):
        raise ValueError(f"{len(masks)} masks for {len(grids)} images: give one per image "
                         "(None for an unmasked one)")
    flat = []
    for index, (mask, grid) in enumerate(zip(masks, grids, strict=True)):
        if mask is None:
            flat.append(None)
            continue
        if images[index].ndim != 3:
            raise ValueError(f"image {index} is a clip; masks apply to images only")
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool \
                or mask.numel() != grid[0] * grid[1]:
            shape = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"mask {index} must be a bool tensor over its image's "
                             f"{grid[0]}x{grid[1]} grid, got {shape}")
        flat.append(mask.reshape(-1))
    return flat


def check_keeps(keeps: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...] | None,
                grids: list[tuple[int, int]], images: list[torch.Tensor] | tuple[torch.Tensor, ...],
                encoder: PackableEncoder) -> list[torch.Tensor | None]:
    """Each image's kept patch indices (None where it keeps every patch).

    Raises:
        ValueError: for a count other than one per image, indices that are not a non-empty
            1-D integer tensor inside the image's grid, a clip, or an encoder with 2D RoPE
            (whose angles follow the full grid), naming the image.
    """
    if keeps is None:
        return [None] * len(grids)
    if len(keeps) != len(grids):
        raise ValueError(f"{len(keeps)} keeps for {len(grids)} images: give one per image "
                         "(None to keep every patch)")
    if getattr(encoder, "rope", None) is not None and any(k is not None for k in keeps):
        raise ValueError("keeps (kept patches) are not supported with 2D RoPE")
    for index, (keep, grid) in enumerate(zip(keeps, grids, strict=True)):
        if keep is None:
            continue
        if images[index].ndim != 3:
            raise ValueError(f"image {index} is a clip; keeps apply to images only")
        patches = grid[0] * grid[1]
        if not isinstance(keep, torch.Tensor) or keep.ndim != 1 or not len(keep) \
                or keep.dtype.is_floating_point or keep.dtype == torch.bool \
                or int(keep.min()) < 0 or int(keep.max()) >= patches:
            shape = list(keep.shape) if isinstance(keep, torch.Tensor) else type(keep).__name__
            raise ValueError(f"keep {index} must be a non-empty 1-D integer tensor of patch "
                             f"indices in [0, {patches}) (its {grid[0]}x{grid[1]} grid), got "
                             f"{shape}")
    return list(keeps)


def clip_tokens(encoder: PackableEncoder, clip: torch.Tensor) -> list[torch.Tensor]:
    """z_0 of each temporal slice of a clip `[frames, C, H, W]`: `[1, L, D]` each."""
    clip = pad_frames(clip, encoder.config.temporal_patch_size)
    x, (slices, rows, cols) = encoder.patch_embed.forward_clip(clip.transpose(0, 1)[None])
    # (1, slices * rows * cols, D), time first: one slice after another
    return [encoder.embed_patches(part, (rows, cols)) for part in x.chunk(slices, dim=1)]


def encode_packed(
    encoder: PackableEncoder,
    images: list[torch.Tensor] | tuple[torch.Tensor, ...],
    *,
    feature_layers: list[int] | tuple[int, ...] | int | None = None,
    output_hidden_states: bool = False,
    output_attentions: bool = False,
    backend: str = "auto",
    max_tokens: int | None = None,
    max_grid: tuple[int, int] | None = None,
    masks: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...] | None = None,
    mask_token: torch.Tensor | None = None,
    keeps: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...] | None = None,
) -> PackedOutput:
    """Encodes images of different sizes in one packed pass (see the module docstring).

    Args:
        encoder: a `VisionEncoder` (anything `PackableEncoder` describes).
        images: `[C, H_i, W_i]` tensors, each side a multiple of the patch size.
        feature_layers, output_hidden_states: as in `VisionEncoder.forward`; the run stops
            after the deepest feature layer when only features are asked for.
        output_attentions: return each image's attention maps per block.
        backend: the attention backend (`vlm_vit.layers.varlen.BACKENDS`; "auto" picks
            FlashAttention's varlen kernel or nested-tensor SDPA on CUDA, per-image SDPA on
            a CPU).
        max_tokens: refuse a pack of more tokens than this.
        max_grid: refuse an image whose patch grid (rows, cols) exceeds this.
        masks: one bool mask per image (None: unmasked), `[rows, cols]` or `[rows * cols]`
            over that image's grid: its masked patches' embeddings become `mask_token`
            (masked pretraining; see `VisionEncoder.prepare_tokens`).
        mask_token: `[D]`, needed with `masks`.
        keeps: one `[K_i]` index tensor per image (None: every patch), the patches of its
            grid that image keeps (MAE's and I-JEPA's context encoder: the others never
            enter the sequence; see `VisionEncoder.prepare_tokens`).

    Returns:
        A `PackedOutput`.

    Raises:
        ValueError: for a bad list (see `check_images`) or feature layer, or masks or keeps
            that are not one per image, each of its image's grid (naming the image).
    """
    input_grids = check_images(encoder, images, max_tokens=max_tokens, max_grid=max_grid)
    masks = check_masks(masks, input_grids, images)
    keeps = check_keeps(keeps, input_grids, images, encoder)
    # z_0 per image, exactly as for that image alone: (1, L_i, D) each; a clip's per slice.
    parts, grids, frames = [], [], []
    for image, grid, mask, keep in zip(images, input_grids, masks, keeps, strict=True):
        masking = {} if mask is None else {"mask": mask[None], "mask_token": mask_token}
        if keep is not None:
            masking["keep"] = keep[None]
        tokens = [encoder.prepare_tokens(image[None], **masking)[0]] if image.ndim == 3 \
            else clip_tokens(encoder, image)
        parts += tokens
        grids += [grid] * len(tokens)
        frames.append(len(tokens))
    segments = Segments(tuple(p.shape[1] for p in parts), backend=backend)
    x = torch.cat(parts, dim=1)  # (1, total, D)
    run = encoder.run_blocks(x, feature_layers=feature_layers,
                             output_hidden_states=output_hidden_states,
                             output_attentions=output_attentions, segments=segments,
                             grids=grids)

    def flat(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[0]  # (total, D)

    return PackedOutput(
        tokens=flat(run.tokens),
        lengths=segments.lengths,
        grids=tuple(grids),
        num_prefix_tokens=encoder.num_prefix_tokens,
        has_class_token=encoder.cls_token is not None,
        hidden_states=tuple(flat(h) for h in run.hidden_states)
        if run.hidden_states is not None else None,
        features=tuple(flat(f) for f in run.features) if run.features is not None else None,
        attentions=run.attentions,
        frames=tuple(frames),
    )
