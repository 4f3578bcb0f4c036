"""Issue 33's and issue 45's families load by Hub name from an offline cache exactly as by
path: HF Dinov2, Pixtral, Qwen2-VL's and Qwen2.5-VL's vision towers, SigLIP 2 (NaFlex),
AIMv2, DINOv3 and InternVL's vision tower saved by transformers; timm's DINOv2 with
registers, EVA-02, AIMv2, DINOv3 and the paper's hybrid (R50+ViT) in timm's hub layout
(config.json with the architecture and model_args)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vlm_vit import load_encoder, load_processor, load_tower
from vlm_vit.convert import detect_format
from vlm_vit.io.files import write_safetensors
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.testing import perturbed

from .convert import test_hf_aimv2 as hf_aimv2
from .convert import test_hf_dinov3 as hf_dinov3
from .convert import test_hf_internvl as hf_internvl
from .convert import test_hf_perception_lm as hf_perception_lm
from .convert import test_timm_aimv2 as timm_aimv2
from .convert import test_timm_dinov3 as timm_dinov3
from .convert import test_timm_naflex as timm_naflex
from .test_hub import cache, put_in_cache  # noqa: F401  (cache is a fixture)

transformers = pytest.importorskip("transformers")
pytest.importorskip("timm")


def save_dinov2(folder: Path) -> Path:
    config = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, mlp_ratio=2, image_size=32,
                                       patch_size=8)
    perturbed(transformers.Dinov2Model(config)).save_pretrained(folder)
    return folder


def save_pixtral(folder: Path) -> Path:
    config = transformers.PixtralVisionConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        head_dim=8, image_size=32, patch_size=8, hidden_act="silu")
    perturbed(transformers.PixtralVisionModel(config)).save_pretrained(folder)
    return folder


def save_qwen2_vl(folder: Path) -> Path:
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    config = Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=16, num_heads=2,
                                 patch_size=8, temporal_patch_size=2, spatial_merge_size=2)
    perturbed(Qwen2VisionTransformerPretrainedModel(config)).save_pretrained(folder)
    return folder


def save_qwen2_5_vl(folder: Path) -> Path:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    config = Qwen2_5_VLVisionConfig(depth=2, hidden_size=32, intermediate_size=48,
                                    out_hidden_size=40, num_heads=4, patch_size=8,
                                    temporal_patch_size=2, spatial_merge_size=2, window_size=32,
                                    fullatt_block_indexes=[1])
    perturbed(Qwen2_5_VisionTransformerPretrainedModel(config)).save_pretrained(folder)
    return folder


def save_siglip2(folder: Path) -> Path:
    config = transformers.Siglip2VisionConfig(hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=4, intermediate_size=48,
                                              patch_size=8, num_patches=16)
    perturbed(transformers.Siglip2VisionModel(config)).save_pretrained(folder)
    return folder


def save_timm_hybrid(folder: Path) -> Path:
    """vit_base_r50_s16_384's architecture (a ResNetV2 stem) at tiny size, as timm's hub
    layout: the stem's stages are read from the weights."""
    from .convert.test_timm_mechanisms import timm_hybrid

    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(timm_hybrid().state_dict(), folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(
        {"architecture": "vit_base_r50_s16_384", "num_classes": 0,
         "model_args": {"img_size": 32, "patch_size": 1, "embed_dim": 32, "depth": 2,
                        "num_heads": 4},
         "pretrained_cfg": {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5],
                            "input_size": [3, 32, 32]}}))
    return folder


def save_timm_dinov2_registers(folder: Path) -> Path:
    """vit_small_patch14_reg4_dinov2's arguments at tiny size, as timm's hub layout."""
    from timm.models.vision_transformer import VisionTransformer

    args = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, init_values=1e-5,
                reg_tokens=4, no_embed_class=True, num_classes=0)
    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(perturbed(VisionTransformer(**args)).state_dict(),
                      folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(
        {"architecture": "vit_small_patch14_reg4_dinov2", "num_classes": 0, "model_args": args,
         "pretrained_cfg": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
                            "input_size": [3, 32, 32]}}))
    return folder


def save_timm_eva02(folder: Path) -> Path:
    from .convert.test_timm_eva import save_eva

    folder.mkdir(parents=True, exist_ok=True)
    return save_eva(folder, "eva02_tiny_patch14_224", img_size=32, patch_size=8,
                    ref_feat_shape=(4, 4))[0]


FAMILIES = {"hf_dinov2": ("facebook/dinov2-tiny", save_dinov2),
            "hf_pixtral": ("mistral-community/pixtral-tiny", save_pixtral),
            "hf_qwen2_vl": ("Qwen/qwen2-vl-vision-tiny", save_qwen2_vl),
            "hf_qwen2_5_vl": ("Qwen/qwen2.5-vl-vision-tiny", save_qwen2_5_vl),
            "hf_siglip2": ("google/siglip2-naflex-tiny", save_siglip2),
            "timm_hybrid": ("timm/vit_base_r50_s16_384.tiny", save_timm_hybrid),
            "timm": ("timm/vit_small_patch14_reg4_dinov2.tiny", save_timm_dinov2_registers),
            "timm_eva": ("timm/eva02_tiny_patch14_224.tiny", save_timm_eva02),
            # issue 45's families, saved by their own tests' savers (folder, model)
            "hf_aimv2": ("apple/aimv2-tiny", lambda f: hf_aimv2.save_aimv2(f)[0]),
            "hf_dinov3": ("facebook/dinov3-vit-tiny", lambda f: hf_dinov3.save_dinov3(f)[0]),
            "hf_internvl": ("OpenGVLab/internvit-tiny",
                            lambda f: hf_internvl.save_internvl(f)[0]),
            "timm_aimv2": ("timm/aimv2_large_patch14_224.tiny",
                           lambda f: timm_aimv2.save_aimv2(f)[0]),
            "timm_dinov3": ("timm/vit_small_patch16_dinov3.tiny",
                            lambda f: timm_dinov3.save_dinov3(f, "vit_small_patch16_dinov3")[0]),
            "hf_perception_lm": ("facebook/Perception-LM-tiny",
                                 lambda f: hf_perception_lm.save_perception_lm(f)[0]),
            "timm_naflex": ("timm/naflexvit_base_patch16_radio_v3.tiny",
                            lambda f: timm_naflex.save_radio(f, "v3_base")[0])}


FORMATS = {"timm_hybrid": "timm"}  # the reader, where it is not the family's key


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_new_family_loads_by_name_as_by_path(tmp_path, cache, family):  # noqa: F811
    repo_id, save = FAMILIES[family]
    snapshot = put_in_cache(cache, repo_id, save(tmp_path / family))
    assert detect_format(read_checkpoint(snapshot)).name == FORMATS.get(family, family)
    by_path = load_encoder(snapshot).eval()
    x = torch.randn(2, 3, *by_path.config.image_size, generator=torch.Generator().manual_seed(1))
    for name in (repo_id, f"hf-hub:{repo_id}", f"{repo_id}@main"):
        by_name = load_encoder(name).eval()
        assert by_name.config == by_path.config
        with torch.no_grad():
            assert torch.equal(by_name(x).tokens, by_path(x).tokens)
    assert load_processor(repo_id) == load_processor(snapshot)
    tower, tower_by_path = load_tower(repo_id).eval(), load_tower(snapshot).eval()
    with torch.no_grad():
        assert torch.equal(tower(x), tower_by_path(x))
