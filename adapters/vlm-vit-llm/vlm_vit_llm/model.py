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

import copy
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit import ImageProcessor, VisionTower
from vlm_vit_llm.batch_types import MultimodalBatch, TiledImage, Video
from vlm_vit_llm.deepstack import DeepStack, fed, train_projectors
from vlm_vit_llm.mrope import (
    batch_positions,
    context_length,
    generation_inputs,
    image_spans,
    multimodal_rope,
    packed_batch_positions,
    time_step,
    token_grid,
)
from vlm_vit_llm.multimodal_batch import build_batch, checked_arguments, expand, token_ids
from vlm_vit_llm.packing import PATHS, check_packed_attention, choose_packed_attention, run_packed
from vlm_vit_llm.parallel import idle_image_features
from vlm_vit_llm.peft_helpers import add_llm_and_encoder_lora, split_peft
from vlm_vit_llm.pixels import Pixels, as_pixels, token_count
from vlm_vit_llm.placeholders import add_image_token, existing_token_id
from vlm_vit_llm.qwen_vl_writer import base_writer
from vlm_vit_llm.readers import READERS, transformers_reader
from vlm_vit_llm.saving import CONFIG_NAME, LAYOUT, ModelParts, read_folder, write_folder
from vlm_vit_llm.timestamps import timestamped_clips
from vlm_vit_llm.video_processor import VideoProcessor, checked_video_processor

logger = logging.getLogger(__name__)

DEFAULT_LLM_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# CONFIG_NAME is `vlm_vit_llm.saving`'s, read from here by the CLI.
__all__ = ["CONFIG_NAME", "DEFAULT_LLM_LORA_TARGETS", "MultimodalLM", "target_ids"]


class MultimodalLM(nn.Module):
    """A vision tower feeding a causal LM through its input embeddings.

    Args:
        tower: a `VisionTower` whose pooler returns tokens of the LLM's width (`mlp2x_gelu`
            with `out_dim=llm hidden size`, as LLaVA-1.5).
        llm: any Hugging Face causal LM (`AutoModelForCausalLM`), or a peft model on one.
        tokenizer: the LLM's tokenizer. `image_token` is added to it as a special token when
            missing, and the LLM's embeddings grow to match.
        image_token: the placeholder string in prompts.
        video_token: a second placeholder, for clips only (`Video`), which the tokenizer must
            hold (Qwen-VL's `<|video_pad|>`); a clip may stand at `image_token` too.
        deepstack: Qwen3-VL's DeepStack mergers, fed to the LLM's first layers
            (`vlm_vit_llm.deepstack.DeepStack`), or None.
        processor: turns PIL images and files into pixels; default: CLIP normalisation at
            the encoder's image size with `crop_rounding="floor"`, as LLaVA's transformers
            processor crops (logged); for a tiled tower, its own processor, else CLIP
            normalisation with its tiling.
        video_processor: sizes a clip's frames together (Qwen-VL's video processors,
            `vlm_vit_llm.video_processor`); None: each frame as `processor` makes an image.

    Raises:
        ValueError: when the tower returns a vector instead of tokens, or tokens of another
            width than the LLM's, the processor tiles otherwise than the tower, or the
            video processor's temporal patch is not the tower's.
    """

    def __init__(self, tower: VisionTower, llm: nn.Module, tokenizer: Any,
                 image_token: str = "<image>", processor: ImageProcessor | None = None,
                 video_token: str | None = None, deepstack: DeepStack | None = None,
                 video_processor: VideoProcessor | None = None):
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
        self.deepstack = deepstack
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
        self.video_processor = checked_video_processor(video_processor, tower)
        self.image_token_id = add_image_token(tokenizer, llm, image_token)
        self.video_token, self.video_token_id = video_token, None if video_token is None else \
            existing_token_id(tokenizer, video_token, "video token")
        self._packed_attention: str | None = None  # chosen and checked at first use

    # -- tokens ------------------------------------------------------------------------------

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

    def image_features(self, pixels: Sequence[Pixels]) -> list[torch.Tensor]:
        """The projected tokens of each image, `[M_i, D]`, from one tower call: a stacked
        batch when the images share a size, else one packed pass over all of them
        (`vlm_vit.packing`: each image's tokens as if it were alone; a `Video`'s temporal
        slices end to end); for a tiled tower,
        every view of every `TiledImage` in one batch, packed by their sizes.

        Raises:
            ValueError: for pixels that are not `[C, H, W]`, a `TiledImage` (tiled) or a
                `Video` of `[T, C, H, W]` (a 4-D tensor alone is refused: clips are Videos).
        """
        parameter = next(self.tower.parameters())
        cast = {"device": parameter.device, "dtype": parameter.dtype}
        if self.tower.tiling is not None:
            if not all(isinstance(image, TiledImage) for image in pixels):
                raise ValueError("the tower tiles images: give each as a TiledImage(views, "
                                 "size) (ImageProcessor.tile gives both)")
            features = self.tower([image.views.to(**cast) for image in pixels],
                                  image_sizes=[image.size for image in pixels])
        else:
            if any(isinstance(image, torch.Tensor) and image.ndim != 3 for image in pixels):
                raise ValueError("image pixels must be [C, H, W] each; give a clip as "
                                 "Video(frames [T, C, H, W])")
            images = [(image.frames if isinstance(image, Video) else image).to(**cast)
                      for image in pixels]
            if len({tuple(image.shape) for image in images}) == 1 and images[0].ndim == 3:
                features = list(self.tower(torch.stack(images)))
            else:
                features = self.tower(images)
        for image, tokens in zip(pixels, features, strict=True):
            expected = token_count(self.tower, image)
            if tokens.ndim != 2 or tokens.shape[0] != expected:  # a pooler breaking its contract
                size = image.size if isinstance(image, TiledImage) else \
                    tuple((image.frames if isinstance(image, Video) else image).shape[-2:])
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
            images: per prompt, a list (or tuple) of its images in placeholder order (PIL
                images, files, arrays, `[C, H, W]` pixel tensors, `TiledImage`s), a clip as
                one `Video`; None or [] for a prompt without images.
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
                sequence without a token, a token id outside the LLM's vocabulary, images not
                given as one list per prompt, a prompt whose placeholders do not match its
                images, mismatched list lengths, or a sequence longer than the LLM's context.
        """
        images = checked_arguments(texts, images, targets, token_labels, padding_side)
        texts, images = timestamped_clips(self, texts, images)  # Qwen3-VL's clips
        prompt_ids = [self._prompt_ids(text, prompt) for prompt, text in enumerate(texts)]
        pixels, counts, owners = self._pixels_per_image(texts, images, prompt_ids)
        if self.deepstack is None:
            features, taps = self.image_features(pixels) if pixels else [], None  # one tower call
        else:  # Qwen3-VL: the DeepStack taps from the same encoder run
            features, taps = self.deepstack.image_features(self, pixels)
        idle = None if pixels else idle_image_features(self)  # see vlm_vit_llm.parallel
        vocabulary = self.llm.get_input_embeddings().num_embeddings
        labels = None if token_labels is None else [
            token_ids(row, f"token_labels[{prompt}]", vocabulary, labels=True)
            for prompt, row in enumerate(token_labels)]
        target_ids = None if targets is None else [
            self.encode_target(target) if isinstance(target, str) else
            token_ids(target, f"targets[{prompt}]", vocabulary, labels=True)
            for prompt, target in enumerate(targets)]
        sequences, label_rows = expand(prompt_ids, counts, self._placeholders, labels=labels,
                                       targets=target_ids)
        limit = context_length(self.llm)
        longest = max(len(s) for s in sequences)
        if limit is not None and longest > limit:
            raise ValueError(f"a sequence of {longest} tokens (image tokens included) is "
                             f"longer than the LLM's context of {limit}")
        per_prompt: list[list[torch.Tensor]] = [[] for _ in sequences]
        for owner, tokens in zip(owners, features, strict=True):
            per_prompt[owner].append(tokens)
        batch = build_batch(
            sequences, label_rows, per_prompt, image_token_id=self._placeholders,
            pad_token_id=self.pad_token_id, width=self.llm.get_input_embeddings().embedding_dim,
            with_labels=targets is not None or token_labels is not None,
            padding_side=padding_side, pack=pack,
            packing=None if pack is None else self.packed_attention(), device=self.device)
        config = getattr(self.llm, "config", None)
        if multimodal_rope(config):  # Qwen-VL's 3-D positions
            grids = [token_grid(self.tower, one) for one in pixels]
            steps = [time_step(config, self.tower, one) for one in pixels]
            if pack is None:
                spans = image_spans(batch.image_mask, batch.attention_mask, grids, owners, steps)
                positions = batch_positions(batch.attention_mask, spans)
            else:
                positions = packed_batch_positions(batch.position_ids, batch.record_index,
                                                   batch.image_mask, grids, owners, steps)
            batch = replace(batch, position_ids=positions)
        return replace(batch, idle_features=idle, deepstack_features=None if taps is None else
                       DeepStack.in_batch_order(taps, owners, pack))

    def _prompt_ids(self, text: str | Sequence[int], prompt: int) -> list[int]:
        """A prompt's token ids, checked: as many image tokens as placeholders."""
        vocabulary = self.llm.get_input_embeddings().num_embeddings
        if not isinstance(text, str):
            return token_ids(text, f"texts[{prompt}]", vocabulary)
        ids = list(self.tokenizer(text)["input_ids"])
        for token, token_id in zip((self.image_token, self.video_token), self._placeholders):
            if ids.count(token_id) != text.count(token):
                raise ValueError(f"prompt {prompt}: the tokenizer reads {ids.count(token_id)} "
                                 f"{token!r} tokens in {text.count(token)} placeholders: "
                                 f"{text[:80]!r}")
        return ids

    @property
    def _placeholders(self) -> tuple[int, ...]:
        """The ids an image (or clip) stands at: the image token's, then the video token's."""
        return (self.image_token_id,) + (() if self.video_token_id is None
                                         else (self.video_token_id,))

    def _pixels_per_image(self, texts: Sequence[str | Sequence[int]],
                          images: list[list[Any]], prompt_ids: list[list[int]]
                          ) -> tuple[list[Any], list[int], list[int]]:
        """Every image of the batch in order as the tower takes it, with its token count
        and the prompt it belongs to; a prompt whose placeholders do not match its images
        is refused."""
        pixels, counts, owners = [], [], []
        for prompt, per_prompt in enumerate(images):
            kinds = [token for token in prompt_ids[prompt] if token in self._placeholders]
            if len(kinds) != len(per_prompt):
                raise ValueError(f"prompt {prompt} has {len(kinds)} {self.image_token!r} "
                                 f"placeholder(s) but {len(per_prompt)} image(s): "
                                 f"{str(texts[prompt])[:80]!r}")
            for kind, image in zip(kinds, per_prompt):
                if kind == self.video_token_id and not isinstance(image, Video):
                    raise ValueError(f"prompt {prompt}: a {self.video_token!r} placeholder "
                                     f"takes a clip, Video(frames), not {type(image).__name__}")
                pixels.append(as_pixels(image, self.tower, self.processor, prompt,
                                        self.video_processor))
                counts.append(token_count(self.tower, pixels[-1]))
                owners.append(prompt)
        return pixels, counts, owners

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
        if path is not None and path not in PATHS:
            raise ValueError(f"unknown packed attention path {path!r}; known: {PATHS}")
        chosen = path or choose_packed_attention(self.llm)
        check_packed_attention(self.llm, chosen)
        self._packed_attention = chosen
        return chosen

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
        with fed(self.deepstack, batch):  # Qwen3-VL's DeepStack features reach the LLM
            if batch.packing is None:
                return self.llm(inputs_embeds=self.embed(batch),
                                attention_mask=batch.attention_mask,
                                position_ids=batch.position_ids, labels=batch.labels,
                                **llm_kwargs)
            return run_packed(self.llm, self.embed(batch), batch.position_ids,
                              batch.record_index, batch.packing, labels=batch.labels,
                              **llm_kwargs)

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
        if batch.position_ids.dim() == 3:  # M-RoPE (Qwen-VL): its 3D ids
            generate_kwargs.update(generation_inputs(batch))
        with fed(self.deepstack, batch):  # the prefill takes them
            output = self.llm.generate(inputs_embeds=self.embed(batch),
                                       attention_mask=batch.attention_mask, **generate_kwargs)
        # With embeddings alone as input, generate returns only the new tokens.
        return [text.strip() for text in
                self.tokenizer.batch_decode(output, skip_special_tokens=True)]

    # -- training set-ups --------------------------------------------------------------------

    def train_projector_only(self) -> MultimodalLM:
        """LLaVA stage 1: only the projectors train; the encoder runs without a graph."""
        self.requires_grad_(False)
        train_projectors(self)
        return self

    def add_lora(self, *, r: int = 16, alpha: float = 32, dropout: float = 0.0,
                 llm_targets: Sequence[str] = DEFAULT_LLM_LORA_TARGETS,
                 encoder_targets: str | Sequence[str] | None = None) -> MultimodalLM:
        """LLaVA stage 2 (with LoRA): LoRA on the LLM (and optionally the encoder, through
        `vlm_vit.adapt.lora.apply_lora`); the projectors train fully, the rest is frozen.

        Args:
            r, alpha, dropout: the LoRA settings, for both.
            llm_targets: module names (or name endings) in the LLM, peft's `target_modules`.
            encoder_targets: None to keep the encoder frozen, or a `vlm_vit.adapt.lora` preset
                (`"attn"`, `"attn_qv"`, `"mlp"`, `"all"`) or full module names.

        Raises:
            ValueError: when LoRA is already on, or a target matches nothing.
        """
        add_llm_and_encoder_lora(self, r=r, alpha=alpha, dropout=dropout,
                                 llm_targets=llm_targets,
                                 encoder_targets=encoder_targets)
        return self

    # -- saving ------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> Path:
        """Writes the whole model, atomically (the folder appears complete or not at all):

            multimodal_config.json   the image token and which adapters there are
            tower/                   the VisionTower (base weights) and the processor
            llm/                     the LLM's base weights and config, and the tokenizer
            llm_adapter/             peft's LoRA adapter on the LLM, when there is one
            vision_adapter/          the encoder's LoRA adapter (`vlm_vit.adapt.lora`), likewise

        Each folder holds a `manifest.json` of its files' sha256, checked by `from_pretrained`.
        A save over an earlier one replaces all of the above (a sub-folder the new save lacks
        is removed); only the user's own files in `directory` are carried over.

        Returns:
            The directory.
        """
        parts = ModelParts(self.tower, self.llm, self.tokenizer, self.processor,
                           self.image_token, video_token=self.video_token,
                           deepstack=self.deepstack, video_processor=self.video_processor)
        return write_folder(parts, directory, base_writer=base_writer(self.llm))

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, trainable: bool = False,
                        dtype: torch.dtype | None = None,
                        verify: bool | None = None) -> MultimodalLM:
        """Reads what `save_pretrained` wrote, or a transformers LLaVA-1.5, LLaVA-NeXT or
        OneVision folder (`vlm_vit_llm.readers`).

        Args:
            directory: the model folder, or its Hub name (`vlm_vit.io.hub`).
            trainable: load the adapters for further training (else for inference).
            dtype: the LLM's dtype (default: as saved).
            verify: check every folder's files against its `manifest.json` before anything
                is read (default: on, unless `VLM_VIT_VERIFY=0`; `vlm_vit.io.integrity`).

        Raises:
            FileNotFoundError, ValueError: naming the missing or malformed file.
            vlm_vit.io.integrity.IntegrityError: naming a file changed since it was saved, or
                one its folder's manifest does not list.
        """
        from vlm_vit.io import hub

        directory = hub.locate(directory, patterns=hub.LLM_PATTERNS).directory  # or a name
        reader = transformers_reader(directory)
        parts = reader(directory, dtype=dtype) if reader is not None else \
            read_folder(directory, trainable=trainable, dtype=dtype, verify=verify,
                        base_readers=READERS)
        mm = cls(parts.tower, parts.llm, parts.tokenizer, image_token=parts.image_token,
                 processor=parts.processor, video_token=parts.video_token,
                 deepstack=parts.deepstack, video_processor=parts.video_processor)
        # transformers' LLaVA folders load for inference, as transformers loads them.
        return mm if parts.layout == LAYOUT else mm.eval()

    def merged(self) -> MultimodalLM:
        """A copy with every LoRA adapter folded into its base weights (this one unchanged)."""
        copied = copy.deepcopy(self)
        llm_base, llm_adapter = split_peft(copied.llm)
        if llm_adapter is not None:
            copied.llm = llm_adapter.merge_and_unload()
        encoder_base, encoder_adapter = split_peft(copied.tower.encoder)
        if encoder_adapter is not None:
            copied.tower.encoder = encoder_adapter.merge_and_unload()
        return copied


def target_ids(tokenizer: Any, text: str) -> list[int]:
    """The token ids the model learns for a target text: the text, then end of sequence."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
