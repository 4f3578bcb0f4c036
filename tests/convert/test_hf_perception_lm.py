"""PerceptionLM's vision tower (issue 45): a `PerceptionLMForConditionalGeneration` saved by
transformers, its tower a `TimmWrapperModel` of a timm Perception Encoder, loads to the same
function: every hidden state and the last hidden state within 1e-5 of transformers' tower on
perturbed tiny weights; the tower gives the tokens PerceptionLM's projector reads (the class
token dropped or kept as `vision_use_cls_token` says); the processor is the thumbnail's; what
cannot be represented is refused by name before a model is built."""

import json

import pytest
import torch

from vlm_vit import load_encoder, load_processor, load_tower
from vlm_vit.convert import detect_format
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.testing import perturbed

from .refusals import assert_refused_before_building
from .test_timm_pe import timm_states

transformers = pytest.importorskip("transformers")
pytest.importorskip("timm")

# PerceptionLM's own vision_config (vit_pe_core_large_patch14_336 without its MAP head, no
# final norm, LayerScale 0.1) at tiny widths: a 4 x 4 grid of 8-pixel patches.
VISION = {"model_type": "timm_wrapper", "architecture": "vit_pe_core_large_patch14_336",
          "model_args": {"embed_dim": 32, "depth": 2, "num_heads": 4, "img_size": [32, 32],
                         "patch_size": 8, "ref_feat_shape": [4, 4], "global_pool": "",
                         "use_post_transformer_norm": False, "init_values": 0.1}}
TEXT = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64,
        "vocab_size": 300}


def save_perception_lm(folder, vision=None, **options):
    """A tiny `PerceptionLMForConditionalGeneration` (perturbed) and its image processor,
    saved by transformers; returns the folder and the model's vision tower."""
    torch.manual_seed(0)
    config = transformers.PerceptionLMConfig(
        vision_config=vision or VISION, text_config=TEXT, projector_pooling_ratio=2,
        image_token_id=290, video_token_id=291, **options)
    model = perturbed(transformers.PerceptionLMForConditionalGeneration(config)).eval()
    model.save_pretrained(folder)
    transformers.PerceptionLMImageProcessor(tile_size=32).save_pretrained(folder)
    return folder, model.model.vision_tower


def test_every_hidden_state_and_the_tokens_match_transformers(tmp_path):
    folder, vision = save_perception_lm(tmp_path)
    assert detect_format(read_checkpoint(folder)).name == "hf_perception_lm"
    ours, tower = load_encoder(folder).eval(), load_tower(folder).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        states, _ = timm_states(vision.timm_model, x)
        last = vision(x).last_hidden_state
        pooled = tower(x)
    for a, b in zip(out.hidden_states, states, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.tokens, last, atol=1e-5, rtol=0)
    torch.testing.assert_close(pooled, last[:, 1:], atol=1e-5, rtol=0)  # the projector's input
    assert (ours.config.rope_positions, ours.config.layer_scale_init) == ("one_based", 0.1)


def test_the_class_token_is_kept_when_perception_lm_keeps_it(tmp_path):
    folder, vision = save_perception_lm(tmp_path, vision_use_cls_token=False)
    tower = load_tower(folder).eval()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(tower(x), vision(x).last_hidden_state, atol=1e-5, rtol=0)


def test_the_processor_is_the_thumbnails(tmp_path):
    folder, _ = save_perception_lm(tmp_path)
    processor = load_processor(folder)
    assert (processor.size, processor.resize_mode, processor.resample) == \
        ((32, 32), "squash", "bicubic")
    assert processor.mean == processor.std == (0.5, 0.5, 0.5)


@pytest.mark.parametrize(("change", "named"), [
    (dict(architecture="resnet50"), "vision_config must be a timm_wrapper of a Perception"),
    (dict(model_args=[1, 2]), "vision_config.model_args must be a JSON object"),
    ("num_heads", "width 32 is not divisible by heads 3"),
    ("use_cls", "vision_use_cls_token must be true or false"),
], ids=["not_pe", "model_args_list", "heads", "use_cls_not_bool"])
def test_what_cannot_be_represented_is_refused_before_a_model_is_built(tmp_path, monkeypatch,
                                                                      change, named):
    folder, _ = save_perception_lm(tmp_path)
    meta = json.loads((folder / "config.json").read_text())
    if change == "num_heads":
        meta["vision_config"]["model_args"]["num_heads"] = 3
    elif change == "use_cls":
        meta["vision_use_cls_token"] = "yes"
    else:
        meta["vision_config"].update(change)
    (folder / "config.json").write_text(json.dumps(meta))
    assert_refused_before_building(folder, monkeypatch, named)


def test_dropping_the_first_token_of_a_tower_without_a_class_token_is_refused(tmp_path):
    vision = {**VISION, "architecture": "vit_pe_core_gigantic_patch14_448"}  # no class token
    folder, _ = save_perception_lm(tmp_path, vision=vision)
    with pytest.raises(ValueError, match="vision_use_cls_token drops the first token, but this "
                                         "tower has class_token=False"):
        load_encoder(folder)
