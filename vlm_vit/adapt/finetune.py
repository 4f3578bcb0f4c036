"""Fine-tuning tasks on the trainer: image classification with a new head (paper section 3.2),
on an encoder or a tower, fully, with LoRA (`vlm_vit.adapt.lora`), or with the encoder frozen
(projector-only training of a tower's pooler)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import vlm_vit.io.hub as hub
from vlm_vit.io.files import (
    atomic_directory,
    atomic_write,
    read_json,
    write_safetensors,
)
from vlm_vit.io.integrity import verify_files, write_manifest
from vlm_vit.io.native import check_state_dict
from vlm_vit.io.tensor_files import read_safetensors
from vlm_vit.model import VisionEncoder
from vlm_vit.presets import POOLINGS as POOLINGS
from vlm_vit.presets import parse_dtype
from vlm_vit.pretrain.base import ObjectiveOutput
from vlm_vit.processor import ImageProcessor
from vlm_vit.tower import VisionTower, no_graph_if_frozen

CLASSIFIER_CONFIG_NAME = "classifier.json"
HEAD_WEIGHTS_NAME = "classifier_head.safetensors"
# The most classes a classifier may have: ImageNet-21k has 21,843, the largest face and
# product datasets about a million; more is a mistake, refused before anything is allocated.
MAX_CLASSES = 1_000_000


class ImageClassifier(nn.Module):
    """A zero-initialised linear head on an encoder's class token or mean patch token, or on a
    tower's output (averaged over its tokens when it returns a sequence).

    The paper (section 3.2) removes the pre-trained head and attaches a zero-initialised
    D x K layer; at a higher resolution the position table is interpolated (load the encoder
    with `image_size=`).

    Args:
        backbone: a `VisionEncoder`, or a `VisionTower` (its pooler is then trained too).
        num_classes: K.
        pooling: for an encoder, "cls" (the class token) or "mean" (the patch tokens).
        freeze_encoder: freeze the encoder; it then runs without an autograd graph.
        layer_decay: layer-wise learning-rate decay for the trainer (BEiT, MAE fine-tuning):
            block i of L trains at lr * layer_decay ** (L - i), the embeddings at
            lr * layer_decay ** (L + 1), the head and final norm at lr; 1.0: one LR.
    """

    def __init__(self, backbone: VisionEncoder | VisionTower, num_classes: int, *,
                 pooling: str = "cls", freeze_encoder: bool = False,
                 layer_decay: float = 1.0) -> None:
        super().__init__()
        if not 0 < layer_decay <= 1:
            raise ValueError(f"layer_decay must lie in (0, 1], got {layer_decay}")
        self.layer_decay = layer_decay
        if not 2 <= num_classes <= MAX_CLASSES:
            raise ValueError(f"a classifier needs 2 to {MAX_CLASSES:,} classes, got "
                             f"{num_classes:,}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
        self.backbone = backbone
        self.encoder = backbone.encoder if isinstance(backbone, VisionTower) else backbone
        if pooling == "cls" and isinstance(backbone, VisionEncoder) \
                and not backbone.config.class_token:
            raise ValueError("pooling='cls' needs a class token, and this encoder has none; "
                             "use pooling='mean'")
        self.pooling = pooling
        width = getattr(getattr(backbone, "pooler", None), "out_dim", None) \
            or self.encoder.config.width
        self.head = nn.Linear(width, num_classes)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        if freeze_encoder:
            self.encoder.requires_grad_(False)

    # -- saving --------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path, *, classes: Sequence[str] | None = None,
                        processor: ImageProcessor | None = None) -> Path:
        """Writes a classifier directory: the encoder (or tower) as `save_pretrained` does,
        so `load_encoder` still reads it, plus `classifier.json` (pooling, class names) and
        the head's weights; the processor too when given.

        Raises:
            ValueError: when `classes` does not have one name per class.
        """
        classes = list(classes) if classes is not None else getattr(self, "classes", None)
        if classes is not None and len(classes) != self.head.out_features:
            raise ValueError(f"{len(classes)} class names for {self.head.out_features} classes")
        directory = Path(directory)
        with atomic_directory(directory) as temp:  # every file appears at once
            self.backbone.save_pretrained(temp)
            write_safetensors(self.head.state_dict(), temp / HEAD_WEIGHTS_NAME)
            write_manifest(temp, [HEAD_WEIGHTS_NAME], merge=True)  # beside the backbone's
            with atomic_write(temp / CLASSIFIER_CONFIG_NAME, "w") as handle:
                json.dump({"num_classes": self.head.out_features, "pooling": self.pooling,
                           "backbone": "tower" if isinstance(self.backbone, VisionTower)
                           else "encoder", "classes": classes}, handle, indent=2)
            if processor is not None:
                processor.save_pretrained(temp)
        return directory

    @classmethod
    def from_pretrained(cls, name: str | Path, *, dtype: str | torch.dtype | None = None,
                        verify: bool | None = None) -> ImageClassifier:
        """Reads a directory written by `save_pretrained` (class names in `.classes`).

        Args:
            name: the classifier's directory, or a Hub name of one.
            dtype: cast the weights, the head's too: a `torch.dtype` or its usual string
                (`vlm_vit.presets.parse_dtype`; default: as stored).
            verify: check the weights against `manifest.json`, as in
                `VisionEncoder.from_pretrained`; False skips it.

        Raises:
            FileNotFoundError, ValueError: naming the missing or malformed file;
                `vlm_vit.io.integrity.IntegrityError` for weights that do not match their hash.
        """
        dtype = parse_dtype(dtype)
        directory = hub.resolve(name)
        config = read_json(directory / CLASSIFIER_CONFIG_NAME)
        try:
            num_classes, pooling = int(config["num_classes"]), str(config["pooling"])
            kind, classes = config.get("backbone", "encoder"), config.get("classes")
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{directory / CLASSIFIER_CONFIG_NAME}: {error!r}") from error
        backbone = (VisionTower if kind == "tower" else VisionEncoder).from_pretrained(
            directory, dtype=dtype, verify=verify)
        classifier = cls(backbone, num_classes, pooling=pooling)
        verify_files(directory, [directory / HEAD_WEIGHTS_NAME], verify)
        state = read_safetensors(directory / HEAD_WEIGHTS_NAME)
        check_state_dict(classifier.head, state, directory / HEAD_WEIGHTS_NAME)
        classifier.head.load_state_dict(state)
        if dtype is not None:
            classifier.head.to(dtype)
        classifier.classes = classes
        return classifier.eval()

    def parameter_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups for the trainer: `train.parameter_groups`'s decay split, each group
        further split by layer with its `lr_scale` (see `layer_decay`)."""
        from vlm_vit.train.trainer import parameter_groups

        depth = self.encoder.config.depth
        groups: dict[tuple[float, float], dict] = {}
        for group in parameter_groups(self, weight_decay):
            for name, parameter in zip(group["names"], group["params"], strict=True):
                scale = self.layer_decay ** (depth + 1 - _layer_id(name, depth))
                entry = groups.setdefault((group["weight_decay"], scale), {
                    "params": [], "names": [], "weight_decay": group["weight_decay"],
                    "lr_scale": scale})
                entry["params"].append(parameter)
                entry["names"].append(name)
        return list(groups.values())

    def features(self, pixel_values: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """`[B, width]` features for the head; a list of `[C, H_i, W_i]` images of any sizes
        (or `vlm_vit.packing.PackedImages`) is encoded in one packed pass."""
        packed = isinstance(pixel_values, (list, tuple))
        if isinstance(self.backbone, VisionTower):
            out = self.backbone(pixel_values)  # the tower skips the graph of a frozen encoder
            if packed:
                return torch.stack([o.mean(dim=0) if o.ndim == 2 else o for o in out])
            return out.mean(dim=1) if out.ndim == 3 else out
        with no_graph_if_frozen(self.encoder):
            out = self.backbone(pixel_values)
        if packed:
            starts = torch.tensor(out.offsets[:-1], device=out.tokens.device)
            if self.pooling == "cls":
                return out.tokens[starts]  # each image's class token
            prefix = out.num_prefix_tokens
            return torch.stack([part[prefix:].mean(dim=0) for part in
                                out.tokens.split(list(out.lengths))])
        return out.cls_token if self.pooling == "cls" else out.patch_tokens.mean(dim=1)

    def forward(self, pixel_values: torch.Tensor | Sequence[torch.Tensor],
                labels: torch.Tensor | None = None) -> ObjectiveOutput | torch.Tensor:
        """Logits `[B, K]`; with `labels`, the cross-entropy loss and accuracy. Images of
        different sizes come as a list (see `features`)."""
        logits = self.head(self.features(pixel_values)).float()
        if labels is None:
            return logits
        accuracy = (logits.argmax(-1) == labels).float().mean().item()
        return ObjectiveOutput(loss=F.cross_entropy(logits, labels),
                               metrics={"accuracy": accuracy})


_EMBEDDINGS = frozenset({"patch_embed", "cls_token", "reg_token", "pos_embed", "norm_pre"})


def _layer_id(name: str, depth: int) -> int:
    """0 for the embeddings, i for block i - 1, depth + 1 for the rest (final norm, pooler,
    head)."""
    parts = name.split(".")
    if "blocks" in parts:
        return int(parts[parts.index("blocks") + 1]) + 1
    return 0 if _EMBEDDINGS.intersection(parts) else depth + 1
