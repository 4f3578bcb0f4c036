"""`MultimodalLM` on a tiled (AnyRes) tower: each image keeps its original size with its
views, counts come from that size, every view of a batch goes through the tower in one call;
the loss, the logits, the spliced embeddings and greedy generation equal transformers'
`LlavaNextForConditionalGeneration` on the same weights; packed rows equal records alone."""

import numpy as np
import pytest
import torch
from conftest import tiny_llm, tiny_tower
from PIL import Image

from vlm_vit import ImageProcessor, VisionTower
from vlm_vit.convert.hf_clip import hf_clip_config
from vlm_vit.processor import Tiling
from vlm_vit_llm import MultimodalLM
from vlm_vit_llm.batch_types import TiledImage
from vlm_vit_llm.llava import VISION_PREFIX, llava_tensors
from vlm_vit_llm.pixels import as_tiled

transformers = pytest.importorskip("transformers")

LOGITS_ATOL = 1e-4
FEATURE_ATOL = 1e-6
PINPOINTS = [[32, 64], [64, 32], [64, 64]]  # LLaVA-NeXT's canvases at a 32-pixel tile
# 950 x 1256 (LLaVA-NeXT's documentation photo) and a 640 x 427 portrait, scaled by 32/336.
SIZES = [(90, 120), (61, 41)]
PROMPTS = ["<image>\nwhat is in the image", "<image> the dog <image>"]
TARGETS = ["two blue dogs", "a red square"]


def image(height, width):
    pixels = np.random.default_rng(height * 7919 + width).integers(0, 256, (height, width, 3))
    return Image.fromarray(pixels.astype(np.uint8))


def tiled_mm(tokenizer, tiling=None, kind="llama"):
    """A tiny CLIP-shaped tower with AnyRes on a tiny Llama (or Qwen2), every weight off its
    init."""
    tiling = tiling or Tiling(pinpoints=PINPOINTS, tile_size=32)
    base = tiny_tower()
    tower = VisionTower(base.encoder, base.pooler, feature_layer=-2, tiling=tiling)
    # room for the image token and OneVision's "<video>", which the export adds
    vocab = 128 if kind == "llama" else len(tokenizer) + 8
    mm = MultimodalLM(tower, tiny_llm(vocab, kind=kind), tokenizer)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in mm.named_parameters():
            if name.startswith("tower."):
                parameter.add_(torch.randn_like(parameter) * 0.02)
    return mm.eval()


def their_model(mm):
    """transformers' LLaVA-NeXT built by hand on `mm`'s weights."""
    config = transformers.LlavaNextConfig(
        vision_config=transformers.CLIPVisionConfig(**hf_clip_config(mm.tower.encoder)),
        text_config=mm.llm.config, image_token_index=mm.image_token_id,
        image_grid_pinpoints=PINPOINTS, vision_feature_layer=-2,
        vision_feature_select_strategy="default", projector_hidden_act="gelu")
    hf = transformers.LlavaNextForConditionalGeneration(config).eval()
    nested = any(name.startswith(VISION_PREFIX + "vision_model.") for name in hf.state_dict())
    tensors = llava_tensors(mm, VISION_PREFIX + ("vision_model." if nested else ""))
    tensors["model.image_newline"] = mm.tower.image_newline.detach()
    hf.load_state_dict(tensors, strict=True)
    return hf


def their_inputs(mm, images):
    """Pixels as their processor pads them: `[images, most views, 3, t, t]`, and sizes."""
    tiled = [as_tiled(picture, mm.processor, 0) for picture in images]
    most = max(len(one.views) for one in tiled)
    pixel_values = torch.stack([torch.cat([one.views, one.views.new_zeros(
        most - len(one.views), *one.views.shape[1:])]) for one in tiled])
    return pixel_values, torch.tensor([one.size for one in tiled])


def test_tiled_images_train_like_transformers_llava_next(tokenizer):
    mm = tiled_mm(tokenizer)
    hf = their_model(mm)
    first, second = image(*SIZES[0]), image(*SIZES[1])
    per_prompt = [[first], [second, first]]
    batch = mm.prepare(PROMPTS, per_prompt, TARGETS)
    counts = [mm.tower.num_image_tokens(size) for size in SIZES]
    assert counts[0] != counts[1]  # the sizes, not the tile, set the counts
    assert batch.image_mask.sum().item() == counts[0] * 2 + counts[1]
    pixel_values, image_sizes = their_inputs(mm, [first, second, first])
    assert image_sizes.tolist() == [list(SIZES[0]), list(SIZES[1]), list(SIZES[0])]

    spliced = {}

    def keep(module, args, kwargs):  # their LLM's input: the embeddings, images spliced in
        spliced.setdefault("embeds", kwargs["inputs_embeds"])

    hook = hf.model.language_model.register_forward_pre_hook(keep, with_kwargs=True)
    with torch.no_grad():
        ours = mm.run(batch)
        theirs = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    pixel_values=pixel_values, image_sizes=image_sizes, labels=batch.labels)
        features = torch.cat(hf.model.get_image_features(
            pixel_values=pixel_values, image_sizes=image_sizes).pooler_output)
        embeds = mm.embed(batch)
    hook.remove()
    torch.testing.assert_close(batch.image_features, features, rtol=0, atol=FEATURE_ATOL)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(embeds[real], spliced["embeds"][real], rtol=0, atol=FEATURE_ATOL)
    torch.testing.assert_close(ours.logits[real], theirs.logits[real], rtol=0, atol=LOGITS_ATOL)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=0, atol=LOGITS_ATOL)

    # Packed in one row, each record's logits and the loss are those of the padded batch.
    packed = mm.prepare(PROMPTS, per_prompt, TARGETS, pack=[[0, 1]])
    with torch.no_grad():
        out = mm.run(packed)
    for record in range(2):
        torch.testing.assert_close(out.logits[packed.record_index == record],
                                   ours.logits[record][real[record]], rtol=0, atol=LOGITS_ATOL)
    torch.testing.assert_close(out.loss, ours.loss, rtol=0, atol=LOGITS_ATOL)

    # Views given with their size (ImageProcessor.tile) are as good as the image itself.
    views, sizes = mm.processor.tile([second])
    again = mm.prepare(PROMPTS[:1], [[TiledImage(views[0], sizes[0])]])
    assert torch.equal(again.image_features, mm.prepare(PROMPTS[:1], [[second]]).image_features)


def test_tiled_images_generate_like_transformers_llava_next(tokenizer):
    mm = tiled_mm(tokenizer)
    hf = their_model(mm)
    picture = image(*SIZES[1])
    batch = mm.prepare(PROMPTS[:1], [[picture]], padding_side="left")
    pixel_values, image_sizes = their_inputs(mm, [picture])
    with torch.no_grad():
        output = hf.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             pixel_values=pixel_values, image_sizes=image_sizes,
                             max_new_tokens=6, do_sample=False, pad_token_id=mm.pad_token_id)
    generated = output[0, batch.input_ids.shape[1]:]
    expected = mm.tokenizer.decode(generated, skip_special_tokens=True).strip()
    assert mm.generate(PROMPTS[:1], [[picture]], max_new_tokens=6, do_sample=False) == [expected]
    assert len(generated) > 1


def test_a_tiled_model_refuses_what_loses_the_size(tokenizer):
    mm = tiled_mm(tokenizer)
    pixels = torch.zeros(3, 32, 32)
    with pytest.raises(ValueError, match="lost the original size; give the image itself, or "
                                         r"TiledImage\(views, size\)"):
        mm.prepare(PROMPTS[:1], [[pixels]])
    with pytest.raises(ValueError, match="give each as a TiledImage"):
        mm.image_features([pixels])
    with pytest.raises(ValueError, match="the processor tiles by None but the tower by Tiling"):
        MultimodalLM(mm.tower, mm.llm, mm.tokenizer,
                     processor=ImageProcessor.for_family("clip", size=32))
