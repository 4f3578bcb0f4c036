"""`MultimodalLM`: a `VisionTower` joined to a Hugging Face causal LM (LLaVA's design).

    mm = MultimodalLM(tower, llm, tokenizer)           # tower: a VisionTower with a projector
    out = mm(["<image>\\nWhat is this?"], [[image]])    # the LLM's output, with .logits
    mm.generate(["<image>\\n"], [[image]], max_new_tokens=20)   # ["a red square"]

A prompt holds one `image_token` per image. Tokenised, each placeholder becomes exactly
`tower.num_image_tokens(image size)` positions, and the projected image tokens replace the
embeddings there, in order. Counts cannot disagree: the positions are made from the images
themselves, and a prompt whose placeholders do not match its images is refused.

With a tiled tower (AnyRes: LLaVA-NeXT, OneVision; `VisionTower(tiling=...)`) each image
becomes its views and keeps its original (height, width), a `TiledImage`: the count comes
from that size, and every view of the batch goes through the tower in one call.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import numbers
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit import ImageProcessor, VisionEncoder, VisionTower
from vlm_vit.card import PLACEHOLDER, model_card, write_card
from vlm_vit.files import MODEL_FILES, atomic_directory, atomic_write, read_json
from vlm_vit.integrity import MANIFEST_NAME, read_manifest, verify_files, write_manifest
from vlm_vit_llm.parallel import idle_image_features

logger = logging.getLogger(__name__)

CONFIG_NAME = "multimodal_config.json"
TOWER_DIR, LLM_DIR = "tower", "llm"
LLM_ADAPTER_DIR, VISION_ADAPTER_DIR = "llm_adapter", "vision_adapter"
# What a save replaces whole in an existing folder: the previous model's files and every
# sub-folder (a new save without an adapter leaves no stale one behind); the user's own
# files are carried over.
SAVED_ENTRIES = (*MODEL_FILES, TOWER_DIR, LLM_DIR, LLM_ADAPTER_DIR, VISION_ADAPTER_DIR)
# The sub-folders hashed in their own `manifest.json` (the tower writes its own).
HASHED_DIRS = (LLM_DIR, LLM_ADAPTER_DIR, VISION_ADAPTER_DIR)
UNHASHED_FILES = (MANIFEST_NAME, "README.md")  # a card the user may edit is not a weight
IGNORE_INDEX = -100  # label positions the loss skips (Hugging Face's convention)
DEFAULT_LLM_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class MultimodalBatch:
    """Prompts (and targets) tokenised, with every image placeholder expanded.

    Attributes:
        input_ids: `[B, L]`; image positions hold the image token's id, padding the pad id.
        attention_mask: `[B, L]`, 0 on padding.
        position_ids: `[B, L]`, counting real tokens only (so left padding shifts nothing).
        image_mask: `[B, L]` bool, True where an image token goes.
        image_features: `[total image tokens, D]`, in the order of the True positions.
        labels: `[B, L]` target ids, `IGNORE_INDEX` on prompt, image and pad positions; None
            without targets.
        record_index: `[B, L]`, the prompt each token belongs to (-1 on padding).
        packing: None for one prompt per row (padded); for packed rows (`prepare(pack=...)`,
            `vlm_vit_llm.packing`), the attention path that confines each record.
        idle_features: `[M, D]`, a blank image's tokens when a batch without images must
            still run the tower (`vlm_vit_llm.parallel.idle_image_features`): `embed` adds
            them times 0.0, which changes no value but joins the tower to the graph; else
            None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    image_mask: torch.Tensor
    image_features: torch.Tensor
    labels: torch.Tensor | None = None
    record_index: torch.Tensor | None = None
    packing: str | None = None
    idle_features: torch.Tensor | None = None


@dataclass(frozen=True)
class TiledImage:
    """One image as a tiled tower takes it (`ImageProcessor.tile`).

    Attributes:
        views: `[1 + tiles, C, t, t]`, the base view first, then the tiles row by row.
        size: the original image's (height, width), which sets the tile grid, the
            unpadding and the token count.
    """

    views: torch.Tensor
    size: tuple[int, int]


class MultimodalLM(nn.Module):
    """A vision tower feeding a causal LM through its input embeddings.

    Args:
        tower: a `VisionTower` whose pooler returns tokens of the LLM's width (`mlp2x_gelu`
            with `out_dim=llm hidden size`, as LLaVA-1.5).
        llm: any Hugging Face causal LM (`AutoModelForCausalLM`), or a peft model on one.
        tokenizer: the LLM's tokenizer. `image_token` is added to it as a special token when
            missing, and the LLM's embeddings grow to match.
        image_token: the placeholder string in prompts.
        processor: turns PIL images and files into pixels; default: CLIP normalisation at
            the encoder's image size with `crop_rounding="floor"`, as LLaVA's transformers
            processor crops (logged); for a tiled tower, its own processor, else CLIP
            normalisation with its tiling.

    Raises:
        ValueError: when the tower returns a vector instead of tokens, or tokens of another
            width than the LLM's, or the processor tiles otherwise than the tower.
    """

    def __init__(self, tower: VisionTower, llm: nn.Module, tokenizer: Any,
                 image_token: str = "<image>", processor: ImageProcessor | None = None):
        super().__init__()
        if tower.num_image_tokens() is None:
            raise ValueError(f"the tower's {type(tower.pooler).__name__} pooler returns one "
                             "vector per image; an LLM needs tokens (use 'mlp2x_gelu', "
                             "'linear', 'pixel_shuffle', ...)")
        width = llm.get_input_embeddings().embedding_dim
        out_dim = getattr(tower.pooler, "out_dim", None)
        if out_dim is not None and out_dim != width:
            raise ValueError(f"the tower's projector gives width {out_dim}, but the LLM's "
                             f"embeddings have width {width}: build the pooler with "
                             f"out_dim={width}")
        self.tower, self.llm, self.tokenizer = tower, llm, tokenizer
        self.image_token = image_token
        tiling = tower.tiling
        if processor is None and tiling is not None:
            processor = tower.processor or ImageProcessor.for_family(
                "clip", size=tiling.tile_size, tiling=tiling)
        if processor is None:
            # transformers' crop rounding: the exported LLaVA's CLIPImageProcessor floors.
            processor = ImageProcessor.for_family("clip", size=tower.encoder.config.image_size,
                                                  crop_rounding="floor")
            logger.info("no processor given: CLIP normalisation at %s", processor.size)
        if processor.tiling != tiling:
            raise ValueError(f"the processor tiles by {processor.tiling} but the tower by "
                             f"{tiling}; give both the same tiling")
        self.processor = processor
        self.image_token_id = self._add_image_token()
        self._packed_attention: str | None = None  # chosen and checked at first use

    # -- tokens ------------------------------------------------------------------------------

    def _add_image_token(self) -> int:
        tokenizer = self.tokenizer
        if self.image_token not in tokenizer.get_vocab():
            tokenizer.add_tokens([self.image_token], special_tokens=True)
            logger.info("added %r to the tokenizer", self.image_token)
        ids = tokenizer(self.image_token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"the tokenizer splits the image token {self.image_token!r} into "
                             f"{len(ids)} tokens; it must be one")
        rows = self.llm.get_input_embeddings().num_embeddings
        if len(tokenizer) > rows:
            self.llm.resize_token_embeddings(len(tokenizer), mean_resizing=False)
            # LLaVA's recipe: new rows start at the mean of the old ones, in the input and
            # the output embeddings. Not random, so every process builds the same model (a
            # resumed run's frozen base matches its checkpoint's); a tied matrix is one.
            matrices = {id(m.weight): m.weight for m in (self.llm.get_input_embeddings(),
                                                         self.llm.get_output_embeddings())
                        if m is not None}
            with torch.no_grad():
                for matrix in matrices.values():  # (V, D)
                    matrix[rows:] = matrix[:rows].mean(dim=0, keepdim=True)
            logger.info("resized the LLM's embeddings to %d rows", len(tokenizer))
        return ids[0]

    @property
    def pad_token_id(self) -> int:
        """The id written on padding (masked out, so any id does): pad, else end of sequence."""
        tokenizer = self.tokenizer
        return next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)

    def encode_target(self, text: str) -> list[int]:
        """A target's token ids, ending with the end-of-sequence token."""
        return target_ids(self.tokenizer, text)

    @property
    def device(self) -> torch.device:
        return self.llm.get_input_embeddings().weight.device

    # -- images ------------------------------------------------------------------------------

    def _pixels(self, image: Any, prompt: int) -> torch.Tensor | TiledImage:
        if self.tower.tiling is not None:
            return self._tiled(image, prompt)
        if isinstance(image, torch.Tensor):
            if image.ndim == 4 and image.shape[0] == 1:
                image = image[0]
            if image.ndim != 3 or image.shape[0] != self.tower.encoder.config.in_channels:
                raise ValueError(f"prompt {prompt}: a pixel tensor must be [C, H, W] with C = "
                                 f"{self.tower.encoder.config.in_channels}, got "
                                 f"{tuple(image.shape)}")
            return image
        return self.processor.preprocess_one(image)

    def _tiled(self, image: Any, prompt: int) -> TiledImage:
        """An image (or a `TiledImage`) as the tiled tower's views and original size."""
        if isinstance(image, TiledImage):
            return image
        if isinstance(image, torch.Tensor) and image.dtype != torch.uint8:
            raise ValueError(f"prompt {prompt}: the tower tiles images (AnyRes), and a float "
                             f"tensor of shape {tuple(image.shape)} has lost the original size; "
                             "give the image itself, or TiledImage(views, size) as "
                             "ImageProcessor.tile gives them")
        views, sizes = self.processor.tile([image])
        return TiledImage(views[0], sizes[0])

    def _num_image_tokens(self, pixels: torch.Tensor | TiledImage) -> int:
        """The tokens an image given as `_pixels` makes: by its original size when tiled."""
        if isinstance(pixels, TiledImage):
            return self.tower.num_image_tokens(tuple(pixels.size))
        return self.tower.num_image_tokens(tuple(pixels.shape[1:]))

    def image_features(self, pixels: Sequence[torch.Tensor | TiledImage]) -> list[torch.Tensor]:
        """The projected tokens of each image, `[M_i, D]`, from one tower call: a stacked
        batch when the images share a size, else one packed pass over all of them
        (`vlm_vit.packing`: each image's tokens as if it were alone); for a tiled tower,
        every view of every `TiledImage` in one batch, packed by their sizes."""
        parameter = next(self.tower.parameters())
        cast = {"device": parameter.device, "dtype": parameter.dtype}
        if self.tower.tiling is not None:
            if not all(isinstance(image, TiledImage) for image in pixels):
                raise ValueError("the tower tiles images: give each as a TiledImage(views, "
                                 "size) (ImageProcessor.tile gives both)")
            features = self.tower([image.views.to(**cast) for image in pixels],
                                  image_sizes=[image.size for image in pixels])
        else:
            images = [image.to(**cast) for image in pixels]
            if len({tuple(image.shape) for image in images}) == 1:
                features = list(self.tower(torch.stack(images)))
            else:
                features = self.tower(images)
        for image, tokens in zip(pixels, features, strict=True):
            expected = self._num_image_tokens(image)
            if tokens.ndim != 2 or tokens.shape[0] != expected:  # a pooler breaking its contract
                size = image.size if isinstance(image, TiledImage) else tuple(image.shape[1:])
                raise RuntimeError(f"the tower returned {tuple(tokens.shape)} tokens for a "
                                   f"{size[0]}x{size[1]} image but promised {expected}")
        return features

    # -- batches -----------------------------------------------------------------------------

    def prepare(self, texts: Sequence[str | Sequence[int]],
                images: Sequence[Sequence[Any]] | None = None,
                targets: Sequence[str | Sequence[int]] | None = None, *,
                token_labels: Sequence[Sequence[int]] | None = None,
                padding_side: str = "right",
                pack: Sequence[Sequence[int]] | None = None) -> MultimodalBatch:
        """Tokenises, expands the placeholders and pads (see `MultimodalBatch`).

        Args:
            texts: one prompt per sequence: a string, or its token ids as the tokenizer
                gives them (`tokenizer(prompt)["input_ids"]`, one image token id per image).
            images: per prompt, its images in placeholder order (PIL images, files, arrays,
                or `[C, H, W]` pixel tensors); None or [] for a prompt without images.
            targets: per prompt, the text to learn after it (strings, or token ids from
                `encode_target`); the loss sees only these.
            token_labels: instead of `targets`, for prompts given as token ids: per prompt,
                a label per token (the id where it is learned, `IGNORE_INDEX` elsewhere), as
                `vlm_vit_llm.chat.tokenize_conversation` gives for multi-turn conversations.
            padding_side: "right" for training, "left" for generation.
            pack: instead of one prompt per row, the packing plan: per row, the indices of
                the prompts laid end to end there (`vlm_vit_llm.packing.pack_rows`).
                Positions restart at every prompt, each prompt's first token has no label,
                and `run` confines attention to each prompt (`packed_attention`).

        Raises:
            ValueError: naming the argument and the shape it needs: for no prompts, a
                sequence without a token, a token id outside the LLM's vocabulary, images
                not given as one list per prompt, a prompt whose placeholders do not match
                its images, mismatched list lengths, or a sequence longer than the LLM's
                context.
        """
        if isinstance(texts, str):
            raise ValueError("texts must be a list of prompts, not one string")
        if len(texts) == 0:
            raise ValueError("texts is empty: give one prompt or more (strings, or lists of "
                             "token ids)")
        images = _images_per_prompt(images, len(texts))
        if targets is not None and len(targets) != len(texts):
            raise ValueError(f"{len(texts)} prompts but {len(targets)} targets")
        if token_labels is not None:
            if targets is not None:
                raise ValueError("give targets or token_labels, not both")
            if len(token_labels) != len(texts) or any(
                    isinstance(text, str) or len(text) != len(row)
                    for text, row in zip(texts, token_labels, strict=True)):
                raise ValueError("token_labels need prompts as token ids, one label per token")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        token_ids = [self._prompt_ids(text, prompt) for prompt, text in enumerate(texts)]
        pixels, counts, owners = [], [], []
        for prompt, per_prompt in enumerate(images):
            placeholders = token_ids[prompt].count(self.image_token_id)
            if placeholders != len(per_prompt):
                raise ValueError(f"prompt {prompt} has {placeholders} {self.image_token!r} "
                                 f"placeholder(s) but {len(per_prompt)} image(s): "
                                 f"{str(texts[prompt])[:80]!r}")
            for image in per_prompt:
                pixels.append(self._pixels(image, prompt))
                counts.append(self._num_image_tokens(pixels[-1]))
                owners.append(prompt)
        features = self.image_features(pixels) if pixels else []  # one tower call
        idle = None if pixels else idle_image_features(self)  # see vlm_vit_llm.parallel

        sequences, label_rows, image_counts = [], [], iter(counts)
        for prompt, ids in enumerate(token_ids):
            expanded, labels = [], []
            given = (self._token_ids(token_labels[prompt], f"token_labels[{prompt}]", labels=True)
                     if token_labels is not None else [IGNORE_INDEX] * len(ids))
            for token, label in zip(ids, given, strict=True):
                if token == self.image_token_id:  # never learned, whatever the label says
                    count = next(image_counts)
                    expanded.extend([token] * count)
                    labels.extend([IGNORE_INDEX] * count)
                else:
                    expanded.append(token)
                    labels.append(label)
            if targets is not None:
                target = targets[prompt]
                target = self.encode_target(target) if isinstance(target, str) else \
                    self._token_ids(target, f"targets[{prompt}]", labels=True)
                target = [t for t in target if t != IGNORE_INDEX]
                if self.image_token_id in target:
                    raise ValueError(f"target {prompt} holds the image token "
                                     f"{self.image_token!r}; targets are text only")
                expanded, labels = expanded + target, labels + target
            if not expanded:
                raise ValueError(f"texts[{prompt}] is empty: it gives no token (and no target "
                                 f"follows it); every sequence needs one token or more")
            sequences.append(expanded)
            label_rows.append(labels)
        limit = getattr(getattr(self.llm, "config", None), "max_position_embeddings", None)
        longest = max(len(s) for s in sequences)
        if limit is not None and longest > limit:
            raise ValueError(f"a sequence of {longest} tokens (image tokens included) is longer "
                             f"than the LLM's context of {limit}")

        width = self.llm.get_input_embeddings().embedding_dim
        if pack is not None:
            return replace(self._packed(sequences, label_rows, pack, features, owners,
                                        with_labels=targets is not None
                                        or token_labels is not None), idle_features=idle)
        batch, length = len(sequences), longest
        input_ids = torch.full((batch, length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((batch, length), dtype=torch.long)
        for row, (sequence, label_row) in enumerate(zip(sequences, label_rows, strict=True)):
            span = slice(length - len(sequence), length) if padding_side == "left" \
                else slice(0, len(sequence))
            input_ids[row, span] = torch.tensor(sequence, dtype=torch.long)
            labels[row, span] = torch.tensor(label_row, dtype=torch.long)
            attention_mask[row, span] = 1
        image_mask = (input_ids == self.image_token_id) & attention_mask.bool()
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        record_index = torch.where(attention_mask.bool(), torch.arange(batch)[:, None], -1)
        device = self.device
        image_features = torch.cat(features) if features else torch.zeros(0, width)
        return MultimodalBatch(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device), image_mask=image_mask.to(device),
            image_features=image_features.to(device),
            labels=labels.to(device) if targets is not None or token_labels is not None
            else None, record_index=record_index.to(device), idle_features=idle)

    def _packed(self, sequences: list[list[int]], label_rows: list[list[int]],
                pack: Sequence[Sequence[int]], features: list[torch.Tensor],
                owners: list[int], with_labels: bool) -> MultimodalBatch:
        """`prepare`'s packed rows: the prompts laid out as `pack` says, their image tokens
        reordered to match (still from the one tower call)."""
        from vlm_vit_llm.packing import ONE_ROW_PATHS, layout_rows

        path = self.packed_attention()
        layout = layout_rows(sequences, label_rows, pack, self.pad_token_id,
                             one_row=path in ONE_ROW_PATHS)
        order = [index for row in pack for index in row]
        per_prompt: list[list[torch.Tensor]] = [[] for _ in sequences]
        for owner, tokens in zip(owners, features, strict=True):
            per_prompt[owner].append(tokens)
        in_order = [tokens for index in order for tokens in per_prompt[index]]
        width = self.llm.get_input_embeddings().embedding_dim
        image_features = torch.cat(in_order) if in_order else torch.zeros(0, width)
        attention_mask = layout["attention_mask"]
        device = self.device
        return MultimodalBatch(
            input_ids=layout["input_ids"].to(device), attention_mask=attention_mask.to(device),
            position_ids=layout["position_ids"].to(device),
            image_mask=((layout["input_ids"] == self.image_token_id)
                        & attention_mask.bool()).to(device),
            image_features=image_features.to(device),
            labels=layout["labels"].to(device) if with_labels else None,
            record_index=layout["record_index"].to(device), packing=path)

    def packed_attention(self) -> str:
        """How packed rows confine attention to each record on this LLM
        (`vlm_vit_llm.packing`): chosen once, checked once against records run alone, and
        logged.

        Raises:
            ValueError: for an LLM with multimodal (3-D) positions, naming it.
            vlm_vit_llm.packing.PackingLeakError: when the chosen path lets records attend
                to each other, naming the LLM's class.
        """
        if self._packed_attention is None:
            self.set_packed_attention(None)
        return self._packed_attention

    def set_packed_attention(self, path: str | None) -> str:
        """Chooses the packed attention path (None: the best available,
        `packing.choose_packed_attention`), checks it against records alone and keeps it.

        Raises:
            ValueError, PackingLeakError: as `packed_attention`.
        """
        from vlm_vit_llm.packing import PATHS, check_packed_attention, choose_packed_attention

        if path is not None and path not in PATHS:
            raise ValueError(f"unknown packed attention path {path!r}; known: {PATHS}")
        chosen = path or choose_packed_attention(self.llm)
        check_packed_attention(self.llm, chosen)
        self._packed_attention = chosen
        return chosen

    def _prompt_ids(self, text: str | Sequence[int], prompt: int) -> list[int]:
        if not isinstance(text, str):
            return self._token_ids(text, f"texts[{prompt}]")
        ids = list(self.tokenizer(text)["input_ids"])
        if ids.count(self.image_token_id) != text.count(self.image_token):
            raise ValueError(f"prompt {prompt}: the tokenizer reads "
                             f"{ids.count(self.image_token_id)} image tokens in "
                             f"{text.count(self.image_token)} placeholders: {text[:80]!r}")
        return ids

    def _token_ids(self, ids: Sequence[int] | torch.Tensor, name: str, *,
                   labels: bool = False) -> list[int]:
        """`ids` as a list of ints, each a row of the LLM's embeddings (or, for `labels`,
        `IGNORE_INDEX`).

        Raises:
            ValueError: naming `name[position]` for an entry that is no int or out of range.
        """
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, torch.Tensor)):
            raise ValueError(f"{name} is a {type(ids).__name__}; give a string or a list of "
                             "token ids [L]")
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        rows = self.llm.get_input_embeddings().num_embeddings
        for position, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name}[{position}] is {value!r}, not a token id: {name} must "
                                 f"be a flat list of ints [L] in 0..{rows - 1}")
            if not 0 <= value < rows and not (labels and value == IGNORE_INDEX):
                raise ValueError(f"{name}[{position}] is token id {value}, outside the "
                                 f"vocabulary 0..{rows - 1} of the LLM's embeddings")
        return [int(value) for value in values]

    def embed(self, batch: MultimodalBatch) -> torch.Tensor:
        """The LLM's input embeddings with the image tokens spliced in, `[B, L, D]`."""
        embeds = self.llm.get_input_embeddings()(batch.input_ids)
        if batch.idle_features is not None:  # adds exactly zero; the tower joins the graph
            embeds = embeds + 0.0 * batch.idle_features.sum().to(embeds.dtype)
        if batch.image_features.shape[0] == 0:
            return embeds
        return embeds.masked_scatter(batch.image_mask.unsqueeze(-1),
                                     batch.image_features.to(embeds.dtype))

    # -- running -----------------------------------------------------------------------------

    def forward(self, texts: Sequence[str | Sequence[int]],
                images: Sequence[Sequence[Any]] | None = None,
                targets: Sequence[str | Sequence[int]] | None = None, *,
                token_labels: Sequence[Sequence[int]] | None = None, **llm_kwargs: Any):
        """The LLM's output (`.logits`, and `.loss` over the targets or labels when given).

        Arguments as in `prepare`; `llm_kwargs` go to the LLM.
        """
        batch = self.prepare(texts, images, targets, token_labels=token_labels)
        return self.run(batch, **llm_kwargs)

    def run(self, batch: MultimodalBatch, **llm_kwargs: Any):
        """The LLM's output on a prepared batch, padded or packed (`.loss` with labels: the
        mean over the batch's supervised tokens); `llm_kwargs` go to the LLM."""
        if batch.packing is None:
            return self.llm(inputs_embeds=self.embed(batch), attention_mask=batch.attention_mask,
                            position_ids=batch.position_ids, labels=batch.labels, **llm_kwargs)
        from vlm_vit_llm.packing import run_packed

        return run_packed(self.llm, self.embed(batch), batch.position_ids, batch.record_index,
                          batch.packing, labels=batch.labels, **llm_kwargs)

    @torch.inference_mode()
    def generate(self, texts: Sequence[str], images: Sequence[Sequence[Any]] | None = None,
                 **generate_kwargs: Any) -> list[str]:
        """Continues each prompt through the LLM's own `generate`; returns the new text.

        Prompts are left-padded. Defaults: `max_new_tokens=32` unless a length is given, and
        the pad id. Other keyword arguments go to `generate` (`do_sample`, `num_beams`, ...).
        """
        batch = self.prepare(texts, images, padding_side="left")
        if "max_length" not in generate_kwargs:
            generate_kwargs.setdefault("max_new_tokens", 32)
        generate_kwargs.setdefault("pad_token_id", self.pad_token_id)
        output = self.llm.generate(inputs_embeds=self.embed(batch),
                                   attention_mask=batch.attention_mask, **generate_kwargs)
        # With embeddings alone as input, generate returns only the new tokens.
        return [text.strip() for text in
                self.tokenizer.batch_decode(output, skip_special_tokens=True)]

    # -- training set-ups --------------------------------------------------------------------

    def train_projector_only(self) -> MultimodalLM:
        """LLaVA stage 1: only the projector trains; the encoder runs without a graph."""
        self.requires_grad_(False)
        self.tower.pooler.requires_grad_(True)
        return self

    def add_lora(self, *, r: int = 16, alpha: float = 32, dropout: float = 0.0,
                 llm_targets: Sequence[str] = DEFAULT_LLM_LORA_TARGETS,
                 encoder_targets: str | Sequence[str] | None = None) -> MultimodalLM:
        """LLaVA stage 2 (with LoRA): LoRA on the LLM (and optionally the encoder, through
        `vlm_vit.lora.apply_lora`); the projector trains fully, everything else is frozen.

        Args:
            r, alpha, dropout: the LoRA settings, for both.
            llm_targets: module names (or name endings) in the LLM, peft's `target_modules`.
            encoder_targets: None to keep the encoder frozen, or a `vlm_vit.lora` preset
                (`"attn"`, `"attn_qv"`, `"mlp"`, `"all"`) or full module names.

        Raises:
            ValueError: when LoRA is already on, or a target matches nothing.
        """
        from vlm_vit.lora import apply_lora, import_peft

        peft = import_peft("LoRA on the LLM")  # bitsandbytes' kernel warnings held back
        if isinstance(self.llm, peft.PeftModel) or isinstance(self.tower.encoder, peft.PeftModel):
            raise ValueError("LoRA is already on this model; merge it or load it without")
        self.requires_grad_(False)
        config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, bias="none",
                                 target_modules=list(llm_targets), task_type="CAUSAL_LM")
        with _quiet_peft():
            self.llm = peft.get_peft_model(self.llm, config)
        self._packed_attention = None  # checked again, on the wrapped LLM
        if encoder_targets is not None:
            self.tower.encoder = apply_lora(self.tower.encoder, r=r, alpha=alpha,
                                            dropout=dropout, targets=encoder_targets)
            # Blocks past the tower's feature layer never run: their LoRA would get no
            # gradient (and DDP would wait for one), so it stays frozen at its no-op start.
            unused = re.compile(r"\.blocks\.(\d+)\.")
            for name, parameter in self.tower.encoder.named_parameters():
                found = unused.search(name)
                if found and ".lora_" in name and int(found[1]) >= self.tower.blocks_used:
                    parameter.requires_grad_(False)
        self.tower.pooler.requires_grad_(True)
        return self

    # -- saving ------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> Path:
        """Writes the whole model, atomically (the folder appears complete or not at all):

            multimodal_config.json   the image token and which adapters there are
            tower/                   the VisionTower (base weights) and the processor
            llm/                     the LLM's base weights and config, and the tokenizer
            llm_adapter/             peft's LoRA adapter on the LLM, when there is one
            vision_adapter/          the encoder's LoRA adapter (`vlm_vit.lora`), likewise

        Each folder holds a `manifest.json` of its files' sha256, checked by `from_pretrained`.
        A save over an earlier one replaces all of the above (a sub-folder the new save lacks
        is removed); only the user's own files in `directory` are carried over.

        Returns:
            The directory.
        """
        from vlm_vit.lora import save_adapter

        directory = Path(directory)
        llm_base, llm_adapter = _split_peft(self.llm)
        encoder_base, encoder_adapter = _split_peft(self.tower.encoder)
        tower = self.tower
        if encoder_adapter is not None:  # the tower again, on the encoder without LoRA
            encoder = VisionEncoder.from_state_dict(_base_state(encoder_base),
                                                    encoder_base.config)
            tower = VisionTower(encoder, tower.pooler, tower.feature_layer, tower.drop_prefix,
                                processor=tower.processor, tiling=tower.tiling)
            tower.image_newline = self.tower.image_newline  # the same parameter, or None
        with atomic_directory(directory, replaces=SAVED_ENTRIES) as temp:
            tower.save_pretrained(temp / TOWER_DIR)
            self.processor.save_pretrained(temp / TOWER_DIR)
            llm_base.save_pretrained(temp / LLM_DIR, state_dict=_base_state(llm_base))
            self.tokenizer.save_pretrained(temp / LLM_DIR)
            if llm_adapter is not None:
                llm_adapter.save_pretrained(str(temp / LLM_ADAPTER_DIR))
            if encoder_adapter is not None:
                save_adapter(encoder_adapter, temp / VISION_ADAPTER_DIR)
            for name in HASHED_DIRS:
                if (temp / name).is_dir():
                    write_manifest(temp / name, _hashed_files(temp / name))
            config = {"format": "vlm_vit_llm", "format_version": 1,
                      "image_token": self.image_token,
                      "llm_adapter": llm_adapter is not None,
                      "vision_adapter": encoder_adapter is not None}
            with atomic_write(temp / CONFIG_NAME, "w") as handle:
                json.dump(config, handle, indent=2)
                handle.write("\n")
            write_card(temp, self._model_card(llm_base))
        logger.info("saved the multimodal model to %s", directory)
        return directory

    def _model_card(self, llm: nn.Module) -> str:
        """The Hub card of a saved model: what it joins, and how to load it."""
        base = getattr(getattr(llm, "config", None), "_name_or_path", "") or ""
        facts = {"LLM": type(llm).__name__ + (f" ({base})" if base else ""),
                 "vision encoder": f"{self.tower.encoder.config.width} wide, "
                                   f"{self.tower.encoder.config.depth} blocks",
                 "projector": getattr(self.tower.pooler, "pooler_spec", {}).get("name"),
                 "feature layer": self.tower.feature_layer,
                 "image tokens": self.tower.num_image_tokens(),
                 "image token": f"`{self.image_token}`",
                 "LoRA adapters": ", ".join(name for name, on in (
                     ("LLM", hasattr(self.llm, "peft_config")),
                     ("encoder", _split_peft(self.tower.encoder)[1] is not None)) if on)
                                  or "none"}
        metadata = {"library_name": "vlm-vit", "pipeline_tag": "image-text-to-text",
                    "tags": ["vlm-vit", "llava", "multimodal"]}
        if base and not Path(base).exists():  # a Hub name, not a local folder
            metadata["base_model"] = base
        usage = ("from vlm_vit_llm import MultimodalLM\n\n"
                 f"mm = MultimodalLM.from_pretrained(\"{PLACEHOLDER}\")\n"
                 f"mm.generate([\"{self.image_token}\\nDescribe it.\"], [[\"photo.jpg\"]])")
        return model_card(metadata, "Multimodal LM (vlm-vit)", facts, usage)

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, trainable: bool = False,
                        dtype: torch.dtype | None = None,
                        verify: bool | None = None) -> MultimodalLM:
        """Reads what `save_pretrained` wrote, or a transformers LLaVA-NeXT / OneVision
        folder (`vlm_vit_llm.llava_next.read_llava`).

        Args:
            directory: the model folder, or its Hub name (`vlm_vit.hub`).
            trainable: load the adapters for further training (else for inference).
            dtype: the LLM's dtype (default: as saved).
            verify: check every folder's files against its `manifest.json` before anything
                is read (default: on, unless `VLM_VIT_VERIFY=0`; `vlm_vit.integrity`).

        Raises:
            FileNotFoundError, ValueError: naming the missing or malformed file.
            vlm_vit.integrity.IntegrityError: naming a file changed since it was saved, or
                one its folder's manifest does not list.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from vlm_vit import hub

        directory = hub.locate(directory, patterns=hub.LLM_PATTERNS).directory  # or a name
        if not (directory / CONFIG_NAME).is_file() and (directory / "config.json").is_file():
            from vlm_vit_llm.llava_next import MODEL_TYPES, read_llava

            if read_json(directory / "config.json").get("model_type") in MODEL_TYPES:
                return read_llava(directory, dtype=dtype)  # transformers' LLaVA-NeXT folder
        config = read_json(directory / CONFIG_NAME)
        if config.get("format") != "vlm_vit_llm":
            raise ValueError(f"{directory / CONFIG_NAME} is not a vlm-vit-llm model config")
        for name in HASHED_DIRS:  # all of them, before the LLM is read
            if (directory / name).is_dir():
                _verify_folder(directory / name, verify)
        tower = VisionTower.from_pretrained(directory / TOWER_DIR, verify=verify)
        processor = ImageProcessor.from_pretrained(directory / TOWER_DIR)
        llm = AutoModelForCausalLM.from_pretrained(directory / LLM_DIR, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(directory / LLM_DIR)
        if config.get("llm_adapter"):
            from peft import PeftModel

            with _quiet_peft():
                llm = PeftModel.from_pretrained(llm, str(directory / LLM_ADAPTER_DIR),
                                                is_trainable=trainable)
        if config.get("vision_adapter"):
            from vlm_vit.lora import load_adapter

            tower.encoder = load_adapter(tower.encoder, directory / VISION_ADAPTER_DIR,
                                         trainable=trainable)
        return cls(tower, llm, tokenizer, image_token=config["image_token"], processor=processor)

    def merged(self) -> MultimodalLM:
        """A copy with every LoRA adapter folded into its base weights (this one unchanged)."""
        copied = copy.deepcopy(self)
        llm_base, llm_adapter = _split_peft(copied.llm)
        if llm_adapter is not None:
            copied.llm = llm_adapter.merge_and_unload()
        encoder_base, encoder_adapter = _split_peft(copied.tower.encoder)
        if encoder_adapter is not None:
            copied.tower.encoder = encoder_adapter.merge_and_unload()
        return copied


def _images_per_prompt(images: Any, count: int) -> list[list[Any]]:
    """`prepare`'s images as one list per prompt (None or [] for a prompt without).

    Raises:
        ValueError: for images not given as a list of `count` lists, naming the entry.
    """
    if images is None:
        return [[] for _ in range(count)]
    if not isinstance(images, (list, tuple)):
        raise ValueError(f"images must be a list with one list of images per prompt, got a "
                         f"{type(images).__name__}: for one prompt with one image, [[image]]")
    if len(images) != count:
        raise ValueError(f"{count} prompts but images for {len(images)}")
    for index, per_prompt in enumerate(images):
        if per_prompt is not None and not isinstance(per_prompt, (list, tuple)):
            raise ValueError(f"images[{index}] is a {type(per_prompt).__name__}, not a list of "
                             f"that prompt's images: images takes one list per prompt, "
                             f"[[image]] for one prompt with one image")
    return [list(per_prompt or []) for per_prompt in images]


def target_ids(tokenizer: Any, text: str) -> list[int]:
    """The token ids the model learns for a target text: the text, then end of sequence."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


def _hashed_files(folder: Path) -> list[str]:
    """The files of a saved folder its manifest covers, relative to it (sub-folders too)."""
    return sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*")
                  if path.is_file() and path.name not in UNHASHED_FILES)


def _verify_folder(folder: Path, verify: bool | None) -> None:
    """Checks every file of `folder`, and every one its manifest lists, against the
    manifest (a file planted beside the saved ones is refused as unlisted)."""
    listed = read_manifest(folder) or {}
    verify_files(folder, sorted({*_hashed_files(folder), *listed}), verify)


def _split_peft(module: nn.Module) -> tuple[nn.Module, Any]:
    """(the base model, the peft model or None)."""
    base = getattr(module, "get_base_model", None)
    if base is not None and hasattr(module, "peft_config"):
        return base(), module
    return module, None


def _base_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's state dict without LoRA: peft's LoRA tensors dropped and its wrapped
    layers (`x.base_layer.weight`) under their own names again (`x.weight`)."""
    return {name.replace(".base_layer.", "."): tensor
            for name, tensor in module.state_dict().items() if ".lora_" not in name}


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """Wrapping a model, peft reads a property transformers 5 deprecates, with a warning
    the user can do nothing about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        yield


def merged_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's weights with its active LoRA adapters folded in, under the plain module's
    names (`x.weight`, not `x.base_layer.weight`); `module` itself is not changed.

    Only the weights LoRA wraps are new tensors, `W + scaling * B @ A` one at a time (peft's
    own `get_delta_weight`, with the layer's own per-adapter `scaling`); every other tensor is
    the module's own, shared, not copied. A fused qkv under the `attn_qv` preset needs nothing
    special: its lora_B key rows are zero, so the key rows of the sum are the base's exactly.
    Dropout acts on the LoRA branch's input while training and has no part in the weight.

    Args:
        module: a plain module (its state dict is returned), or a peft model on one.

    Raises:
        ValueError: for an adapter that does not merge by addition (DoRA and other variants).
    """
    base, adapter = _split_peft(module)
    if adapter is None:
        return module.state_dict()
    from peft.tuners.lora import LoraLayer

    state = _base_state(base)
    with torch.no_grad():
        for name, layer in base.named_modules():
            if not isinstance(layer, LoraLayer) or layer.disable_adapters:
                continue
            for active in layer.active_adapters:
                if active in layer.merged_adapters or not (
                        active in layer.lora_A or active in layer.lora_embedding_A):
                    continue  # merged already (in the base weight), or not on this layer
                if layer.use_dora.get(active) or active in getattr(layer, "lora_variant", {}):
                    raise ValueError(f"{name}: adapter {active!r} is not plain LoRA (DoRA or "
                                     "another variant) and does not merge by addition")
                weight = state[f"{name}.weight"]
                # As peft's merge: the sum in the wider dtype, stored in the weight's.
                state[f"{name}.weight"] = (weight + layer.get_delta_weight(active)).to(weight.dtype)
                if getattr(layer, "lora_bias", {}).get(active):
                    bias = state[f"{name}.bias"]
                    delta = layer.lora_B[active].bias * layer.scaling[active]
                    state[f"{name}.bias"] = (bias + delta).to(bias.dtype)
    return state
