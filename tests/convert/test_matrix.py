"""The conversion matrix through the CLI, trimmed to what it alone proves (issue 41): every
reader converts into the native format and every writer from it, and what is written loads
back to the same outputs; each field of the architecture that a writer cannot hold is refused
once, in one line, for that field (never for the shape of a pooler the reader itself chose).
Each family's own tests prove its reader and writer against the real library, so the other
reader-writer pairs add time, not evidence."""

import pytest
import torch

from vlm_vit import EncoderConfig, ImageProcessor, VisionEncoder, load_encoder
from vlm_vit.cli import main
from vlm_vit.cli.convert import writable_formats
from vlm_vit.testing import perturbed

transformers = pytest.importorskip("transformers")
pytest.importorskip("timm")
pytest.importorskip("open_clip")

# CLIP-shaped (pre-norm, no patch bias, eps 1e-5, head width 64): every writer can hold it.
CLIP_STYLE = dict(image_size=32, patch_size=8, width=128, depth=2, heads=2, mlp_width=256,
                  pre_norm=True, act="quick_gelu", norm_eps=1e-5, patch_bias=False)
TARGETS = {"native": "out", "hf_clip": "out", "timm": "out", "open_clip": "out",
           # issue 33: each family written back to its own format
           "hf_dinov2": "out", "hf_pixtral": "out", "hf_qwen2_vl": "out", "hf_qwen2_5_vl": "out",
           "timm_eva": "out",
           # issue 45: AIMv2 both ways
           "hf_aimv2": "out", "timm_aimv2": "out",
           # issue 45: DINOv3 both ways
           "hf_dinov3": "out", "timm_dinov3": "out",
           # issue 45: InternViT both ways
           "hf_internvl": "out",
           # Qwen3-VL's vision tower both ways
           "hf_qwen3_vl": "out",
           # GLM-4V's vision tower both ways
           "hf_glm4v": "out",
           # issue 45: Perception Encoder through timm
           "timm_pe": "out",
           # issue 45: RADIO through timm's NaFlexVit
           "timm_naflex": "out"}



def written_by_us(target: str):
    """A CLIP-style encoder written by our own writer for `target`."""
    def build(folder):
        torch.manual_seed(0)
        encoder = perturbed(VisionEncoder(EncoderConfig(**CLIP_STYLE)))
        encoder.save_pretrained(folder / "native")
        ImageProcessor.for_family("clip", size=32).save_pretrained(folder / "native")
        if target == "native":
            return folder / "native"
        destination = folder / TARGETS[target]
        floor = ["--crop-rounding", "floor"] if target == "hf_clip" else []
        assert main(["convert", str(folder / "native"), str(destination), "--to", target,
                     *floor]) == 0
        return destination
    return build


def saved_by_transformers(model_class: str, config_class: str, **options):
    """A tiny transformers vision model (the shapes of `CLIP_STYLE`), saved by transformers."""
    def build(folder):
        config = getattr(transformers, config_class)(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
            image_size=32, patch_size=8)
        model = getattr(transformers, model_class)(config, **options)
        perturbed(model).save_pretrained(folder / model_class)
        return folder / model_class
    return build


def google_npz(folder):
    """The paper's `.npz` layout, written from a timm model by the JAX test's helper."""
    from .test_jax_npz import google_arrays, save, timm_model

    folder.mkdir(parents=True, exist_ok=True)
    save(folder / "vit.npz", google_arrays(timm_model()))
    return folder / "vit.npz"


def google_hybrid_npz(folder):
    """Google's hybrid (R50+ViT) `.npz` layout at tiny size, written by the hybrid test's helper."""
    from .test_jax_npz_hybrid import hybrid_npz

    return hybrid_npz(folder)


def timm_dinov2_registers(folder):
    """A tiny `vit_small_patch14_reg4_dinov2`-shaped timm model (LayerScale, registers without
    position entries), saved as timm's hub layout."""
    import json

    from timm.models.vision_transformer import VisionTransformer

    from vlm_vit.io.files import write_safetensors

    args = dict(img_size=32, patch_size=8, embed_dim=128, depth=2, num_heads=2,
                init_values=1e-5, reg_tokens=4, no_embed_class=True, num_classes=0)
    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(perturbed(VisionTransformer(**args)).state_dict(),
                      folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(
        {"architecture": "vit_small_patch14_reg4_dinov2", "model_args": args}))
    return folder


def pixtral(folder):
    """A tiny `PixtralVisionModel` (2D RoPE, RMSNorm, SwiGLU, no class token), saved by
    transformers."""
    config = transformers.PixtralVisionConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
        head_dim=64, image_size=32, patch_size=8, hidden_act="silu")
    perturbed(transformers.PixtralVisionModel(config)).save_pretrained(folder / "pixtral")
    return folder / "pixtral"


def qwen2_vl(folder):
    """A tiny `Qwen2VisionTransformerPretrainedModel` (Conv3d over 2 frames, 2D RoPE, a 2x2
    merger), saved by transformers."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    config = Qwen2VLVisionConfig(depth=2, embed_dim=128, hidden_size=64, num_heads=2,
                                 patch_size=8, temporal_patch_size=2, spatial_merge_size=2)
    perturbed(Qwen2VisionTransformerPretrainedModel(config)).save_pretrained(folder / "qwen")
    return folder / "qwen"


def qwen2_5_vl(folder):
    """A tiny `Qwen2_5_VisionTransformerPretrainedModel` (RMSNorm, SwiGLU, 2-patch windows
    but in block 1, an RMSNorm merger), saved by transformers."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    config = Qwen2_5_VLVisionConfig(depth=2, hidden_size=128, intermediate_size=192,
                                    out_hidden_size=64, num_heads=2, patch_size=8,
                                    temporal_patch_size=2, spatial_merge_size=2, window_size=16,
                                    fullatt_block_indexes=[1])
    perturbed(Qwen2_5_VisionTransformerPretrainedModel(config)).save_pretrained(folder / "qwen25")
    return folder / "qwen25"


def qwen3_vl(folder):
    """A tiny `Qwen3VLVisionModel` (a 4x4 table resized with the corners aligned and 2D RoPE,
    Conv3d patches with a bias, a 2x2 merger, a DeepStack merger), saved by transformers."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    config = Qwen3VLVisionConfig(depth=2, hidden_size=128, intermediate_size=256,
                                 out_hidden_size=64, num_heads=2, patch_size=8,
                                 num_position_embeddings=16, deepstack_visual_indexes=[0])
    perturbed(Qwen3VLVisionModel(config)).save_pretrained(folder / "qwen3")
    return folder / "qwen3"


def glm4v(folder):
    """A tiny `Glm4vVisionModel` (a 4x4 table read by grid_sample and 2D RoPE, Conv3d patches
    with a bias and an RMSNorm, bias-free SwiGLU blocks, a downsample and merger), saved by
    transformers."""
    from transformers.models.glm4v.configuration_glm4v import Glm4vVisionConfig
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

    config = Glm4vVisionConfig(depth=2, hidden_size=128, intermediate_size=256,
                               out_hidden_size=64, num_heads=2, patch_size=8, image_size=32)
    perturbed(Glm4vVisionModel(config)).save_pretrained(folder / "glm4v")
    return folder / "glm4v"


def siglip2(folder):
    """A tiny `Siglip2VisionModel` (NaFlex: a Linear patch embedding, a 4x4 table resized
    per image), saved by transformers."""
    config = transformers.Siglip2VisionConfig(hidden_size=128, num_hidden_layers=2,
                                              num_attention_heads=2, intermediate_size=256,
                                              patch_size=8, num_patches=16)
    perturbed(transformers.Siglip2VisionModel(config)).save_pretrained(folder / "siglip2")
    return folder / "siglip2"


def timm_eva02(folder):
    """A tiny `eva02_tiny_patch14_224`-shaped timm Eva, saved as timm's hub layout."""
    from .test_timm_eva import save_eva

    folder.mkdir(parents=True, exist_ok=True)
    return save_eva(folder, "eva02_tiny_patch14_224", img_size=32, patch_size=8, embed_dim=128,
                    ref_feat_shape=(4, 4))[0]


def aimv2_hf(folder):
    """A tiny `Aimv2VisionModel` (RMSNorm, SwiGLU, a patch-embedding norm, an attention-pooling
    head), saved by transformers."""
    config = transformers.Aimv2VisionConfig(hidden_size=128, num_hidden_layers=2,
                                            num_attention_heads=2, intermediate_size=256,
                                            image_size=32, patch_size=8)
    perturbed(transformers.Aimv2VisionModel(config)).save_pretrained(folder / "aimv2")
    return folder / "aimv2"


def aimv2_timm(folder):
    """A tiny `aimv2_large_patch14_224`-shaped timm model, saved as timm's hub layout."""
    from .test_timm_aimv2 import save_aimv2

    folder.mkdir(parents=True, exist_ok=True)
    return save_aimv2(folder, img_size=32, patch_size=8, embed_dim=128)[0]


def dinov3_hf(folder):
    """A tiny `DINOv3ViTModel` (RoPE at patch centres, 2 registers, LayerScale, no k bias),
    saved by transformers."""
    config = transformers.DINOv3ViTConfig(hidden_size=128, num_hidden_layers=2,
                                          num_attention_heads=2, intermediate_size=256,
                                          image_size=32, patch_size=8, num_register_tokens=2)
    perturbed(transformers.DINOv3ViTModel(config)).save_pretrained(folder / "dinov3")
    return folder / "dinov3"


def dinov3_timm(folder):
    """A tiny `vit_small_patch16_dinov3_qkvb`-shaped timm Eva, saved as timm's hub layout."""
    from .test_timm_dinov3 import save_dinov3

    folder.mkdir(parents=True, exist_ok=True)
    return save_dinov3(folder, "vit_small_patch16_dinov3_qkvb", embed_dim=128, num_heads=2)[0]


def pe_timm(folder):
    """A tiny `vit_pe_core_tiny_patch16_384`-shaped timm Eva (a table and RoPE counted from 1,
    its MAP head), saved as timm's hub layout."""
    from .test_timm_pe import save_pe

    folder.mkdir(parents=True, exist_ok=True)
    return save_pe(folder, "vit_pe_core_tiny_patch16_384", embed_dim=128, num_heads=2)[0]


def perception_lm(folder):
    """A tiny `PerceptionLMForConditionalGeneration` (its tower a timm PE in a
    `TimmWrapperModel`), saved by transformers."""
    from .test_hf_perception_lm import VISION, save_perception_lm

    args = {**VISION["model_args"], "embed_dim": 128, "num_heads": 2}
    return save_perception_lm(folder / "plm", vision={**VISION, "model_args": args})[0]


def radio_timm(folder):
    """A tiny `naflexvit_base_patch16_radio_v3`-shaped timm NaFlexVit (a table resized to the
    square of the longer side with its corners aligned, 7 registers, LayerScale), saved as
    timm's hub layout."""
    from .test_timm_naflex import save_radio

    folder.mkdir(parents=True, exist_ok=True)
    return save_radio(folder, "v3_base", embed_dim=128, num_heads=2)[0]


SOURCES = {"native": written_by_us("native"), "hf_clip (ours)": written_by_us("hf_clip"),
           "timm (ours)": written_by_us("timm"), "open_clip (ours)": written_by_us("open_clip"),
           # the reproduction: a CLIPVisionModel with no projection
           "hf CLIPVisionModel": saved_by_transformers("CLIPVisionModel", "CLIPVisionConfig"),
           # paper-style towers (no pre-norm, patch bias); SigLIP without a class token
           "hf InternVLVisionModel": saved_by_transformers("InternVLVisionModel",
                                                           "InternVLVisionConfig"),
           "hf ViTModel": saved_by_transformers("ViTModel", "ViTConfig",
                                                add_pooling_layer=False),
           "hf SiglipVisionModel": saved_by_transformers("SiglipVisionModel",
                                                         "SiglipVisionConfig"),
           "hf ViTMAEModel": saved_by_transformers("ViTMAEModel", "ViTMAEConfig"),
           "google npz": google_npz,
           # issue 33: LayerScale and registers (DINOv2), the hybrid's ResNet stem
           "hf Dinov2Model": saved_by_transformers("Dinov2Model", "Dinov2Config"),
           "timm dinov2 registers": timm_dinov2_registers,
           "google npz hybrid": google_hybrid_npz,
           # issue 33: 2D RoPE without a position table
           "hf PixtralVisionModel": pixtral,
           # issue 33: Qwen2-VL's vision tower (its merger read as the patch_merger pooler)
           "hf Qwen2-VL vision": qwen2_vl,
           # issue 33: Qwen2.5-VL's (window attention, RMSNorm, SwiGLU, an RMSNorm merger)
           "hf Qwen2.5-VL vision": qwen2_5_vl,
           # Qwen3-VL's (a learned table and 2D RoPE, Conv3d patches with a bias)
           "hf Qwen3-VL vision": qwen3_vl,
           # GLM-4V's (a table read by grid_sample, a patch RMSNorm after the Conv3d, a
           # downsample and merger read as the conv_merger pooler)
           "hf GLM-4V vision": glm4v,
           # issue 33: timm's EVA-02 (RoPE, packed SwiGLU, q/v biases)
           "timm eva02": timm_eva02,
           # issue 31: SigLIP 2 NaFlex (a Linear patch embedding, bilinear table resize)
           "hf Siglip2VisionModel": siglip2,
           # issue 45: AIMv2 (a patch-embedding RMSNorm, bias-free Linears, its pooling head)
           "hf Aimv2VisionModel": aimv2_hf, "timm aimv2": aimv2_timm,
           # issue 45: DINOv3 (RoPE at patch centres, registers, LayerScale, no position table)
           "hf DINOv3ViTModel": dinov3_hf, "timm dinov3": dinov3_timm,
           # issue 45: Perception Encoder (a table beside RoPE counted from 1, a MAP head)
           "timm pe": pe_timm,
           # issue 45: RADIO (a linear patch embedding, RADIO's square-crop table resize)
           "timm radio": radio_timm,
           # issue 45: PerceptionLM's tower (timm's PE in transformers' TimmWrapperModel)
           "hf PerceptionLM": perception_lm}
PE = ("timm pe", "hf PerceptionLM")
DINOV3 = ("hf DINOv3ViTModel", "timm dinov3")
AIMV2 = ("hf Aimv2VisionModel", "timm aimv2")
GLM4V = "hf GLM-4V vision"
# Pairs the target's architecture cannot hold, and the reason the refusal must give.
# (Paper-style towers, with no pre-norm, do not fit CLIP's layouts; the hf-clip writer writes
# CLIP, not SigLIP.)
CANNOT = {(source, target): "pre_norm=False"
          for source in ("hf ViTModel", "hf ViTMAEModel", "hf SiglipVisionModel", "google npz")
          for target in ("open_clip", "hf_clip")}
# CLIP's layouts hold neither LayerScale nor a ResNet stem; timm builds its hybrid from code only.
CANNOT.update({(source, target): "layer_scale_init"
               for source in ("hf Dinov2Model", "timm dinov2 registers")
               for target in ("open_clip", "hf_clip")})
CANNOT.update({("google npz hybrid", target): "hybrid_layers"
               for target in ("open_clip", "hf_clip", "timm")})
# Pixtral (RoPE, RMSNorm, SwiGLU with SiLU) fits none of the writable layouts but our own.
CANNOT.update({("hf PixtralVisionModel", "timm"): "norm='rmsnorm'",
               ("hf PixtralVisionModel", "open_clip"): "rope_theta=10000.0",
               ("hf PixtralVisionModel", "hf_clip"): "rope_theta=10000.0"})
CANNOT.update({("hf Qwen2-VL vision", target): "rope_theta=10000.0"
               for target in ("open_clip", "hf_clip")})
CANNOT["hf Qwen2-VL vision", "timm"] = "temporal_patch_size=2"  # timm has no Conv3d patches
CANNOT.update({("hf Qwen2.5-VL vision", "timm"): "norm='rmsnorm'",
               **{("hf Qwen2.5-VL vision", target): "rope_theta=10000.0"
                  for target in ("open_clip", "hf_clip")}})
CANNOT.update({("hf Qwen3-VL vision", "timm"): "temporal_patch_size=2",
               **{("hf Qwen3-VL vision", target): "rope_theta=10000.0"
                  for target in ("open_clip", "hf_clip")}})
# GLM-4V (2D RoPE, RMSNorm, SwiGLU with SiLU, a patch norm) fits none of the plain layouts.
CANNOT.update({(GLM4V, "timm"): "norm='rmsnorm'", (GLM4V, "open_clip"): "act='silu'",
               (GLM4V, "hf_clip"): "rope_theta=10000.0"})
CANNOT.update({("timm eva02", "timm"): "mlp='swiglu'",
               **{("timm eva02", target): "rope_theta=10000.0"
                  for target in ("open_clip", "hf_clip")}})
# SigLIP 2 (no class token, no pre-norm, tanh GELU) is SigLIP for the CLIP layouts.
CANNOT.update({("hf Siglip2VisionModel", target): CANNOT["hf SiglipVisionModel", target]
               for target in ("open_clip", "hf_clip")})
# AIMv2 (RMSNorm, SwiGLU, no class token, no pre-norm) fits neither timm's ViT nor CLIP's.
# PE (a table beside 2D RoPE, pre-norm, no patch bias) fits neither timm's ViT nor CLIP's.
CANNOT.update({(source, target): "rope_theta=10000.0" for source in PE
               for target in ("timm", "open_clip", "hf_clip")})
CANNOT.update({(source, target): reason for source in AIMV2
               for target, reason in (("timm", "norm='rmsnorm'"), ("open_clip", "pre_norm=False"),
                                      ("hf_clip", "pre_norm=False"))})
# The families' own formats (issue 33) hold their own family, and DINOv2's the paper-style
# towers (LayerScale of one); every other pair is refused for a field of the architecture.
CLIP_SHAPED = ("native", "hf_clip (ours)", "timm (ours)", "open_clip (ours)",
               "hf CLIPVisionModel")
QWEN = ("hf Qwen2-VL vision", "hf Qwen2.5-VL vision", "hf Qwen3-VL vision")
WRITTEN_BACK = {"hf_dinov2": ("google npz", "hf Dinov2Model", "hf ViTMAEModel", "hf ViTModel",
                              "timm dinov2 registers"),
                "hf_pixtral": ("hf PixtralVisionModel",), "hf_qwen2_vl": (QWEN[0],),
                "hf_qwen2_5_vl": (QWEN[1],), "hf_qwen3_vl": (QWEN[2],), "hf_glm4v": (GLM4V,),
                "timm_eva": ("timm eva02",),
                "hf_aimv2": AIMV2, "timm_aimv2": AIMV2,
                "hf_dinov3": DINOV3, "timm_dinov3": DINOV3, "timm_pe": PE,
                # timm's DINOv2 with registers: no class position, bicubic with antialias
                "timm_naflex": ("timm radio", "timm dinov2 registers"),
                # paper-style towers: LayerScale of one, bicubic resize without antialias
                "hf_internvl": ("hf InternVLVisionModel", "google npz", "hf Dinov2Model",
                                "hf ViTMAEModel", "hf ViTModel")}
REASONS = {
    "hf_dinov2": {**dict.fromkeys(CLIP_SHAPED, "pre_norm=True"),
                  "google npz hybrid": "hybrid_layers", "timm eva02": "final_norm=False",
                  **dict.fromkeys(DINOV3, "pos_embed='none'"),
                  **dict.fromkeys(PE, "pre_norm=True"),
                  "default": "class_token=False"},
    "hf_pixtral": {**dict.fromkeys((*QWEN, GLM4V), "pre_norm=False"),
                   "timm eva02": "class_token=True",
                   **dict.fromkeys((*DINOV3, *PE), "class_token=True"),
                   "default": "rope_theta=None"},
    "hf_qwen2_vl": {QWEN[1]: "norm='rmsnorm'", QWEN[2]: "pos_embed='learned'",
                    GLM4V: "patch_norm=True", "default": "temporal_patch_size=None"},
    "hf_qwen2_5_vl": {**dict.fromkeys(QWEN[::2], "norm='layernorm'"), GLM4V: "patch_norm=True",
                      "default": "temporal_patch_size=None"},
    "hf_qwen3_vl": {**dict.fromkeys(QWEN[:2], "patch_bias=False"),
                    GLM4V: "pos_resize_mode='bicubic_grid_sample'",
                    "default": "temporal_patch_size=None"},
    "hf_glm4v": {**dict.fromkeys(QWEN, "patch_norm=False"),
                 "default": "temporal_patch_size=None"},
    "timm_eva": {**dict.fromkeys(CLIP_SHAPED, "norm_eps=1e-05"),
                 **dict.fromkeys(("hf ViTModel", "hf ViTMAEModel"), "norm_eps=1e-12"),
                 **dict.fromkeys(("hf SiglipVisionModel", "hf Siglip2VisionModel", "google npz"),
                                 "act='gelu_tanh'"),
                 **dict.fromkeys(("hf Dinov2Model", "timm dinov2 registers"), "no k bias"),
                 "google npz hybrid": "hybrid_layers",
                 **dict.fromkeys(QWEN[::2], "temporal_patch_size=2"),
                 **dict.fromkeys(DINOV3, "rope_positions='centered'"),
                 **dict.fromkeys(PE, "rope_positions='one_based'"),
                 "default": "norm='rmsnorm'"},  # Pixtral, Qwen2.5-VL, AIMv2
    "hf_aimv2": {GLM4V: "temporal_patch_size=2", "default": "patch_norm=False"},
    "timm_aimv2": {GLM4V: "temporal_patch_size=2", "default": "patch_norm=False"},
    "hf_dinov3": {**dict.fromkeys(PE, "rope_positions='one_based'"),
                  "default": "rope_positions='index'"},
    "timm_dinov3": {**dict.fromkeys(PE, "rope_positions='one_based'"),
                    "default": "rope_positions='index'"},
    "timm_pe": {"hf PixtralVisionModel": "norm='rmsnorm'",
                **dict.fromkeys((*QWEN, GLM4V), "temporal_patch_size=2"),
                "timm eva02": "mlp='swiglu'",
                **dict.fromkeys(DINOV3, "rope_positions='centered'"),
                "default": "rope_theta=None"},
    "hf_internvl": {"default": "(InternVL needs"},
    "timm_naflex": {**dict.fromkeys(("hf InternVLVisionModel", "hf Dinov2Model"),
                                    "its class token has a position"),
                    **dict.fromkeys(("hf ViTModel", "hf ViTMAEModel"), "norm_eps=1e-12"),
                    **dict.fromkeys(("hf SiglipVisionModel", "hf Siglip2VisionModel",
                                     "google npz", "google npz hybrid", QWEN[2]),
                                    "act='gelu_tanh'"),
                    **dict.fromkeys(("hf PixtralVisionModel", QWEN[1], GLM4V, *AIMV2),
                                    "norm='rmsnorm'"),
                    QWEN[0]: "act='quick_gelu'", "timm eva02": "mlp='swiglu'",
                    "default": "norm_eps=1e-05"},  # CLIP-shaped, DINOv3, PE
}
REASONS["hf_dinov2"]["timm radio"] = "final_norm=False"
REASONS["timm_eva"]["timm radio"] = "no k bias"
# RADIO (no pre-norm, registers) fits no CLIP layout; timm's ViT resizes its table otherwise.
CANNOT.update({("timm radio", "timm"): "pos_resize_mode='bilinear_corners_square_crop'",
               ("timm radio", "open_clip"): "pre_norm=False",
               ("timm radio", "hf_clip"): "pre_norm=False"})
CANNOT.update({(source, target): reasons.get(source, reasons["default"])
               for target, reasons in REASONS.items() for source in SOURCES
               if source not in WRITTEN_BACK[target]})
# Sources whose processor crops as torchvision does (open_clip's reader records OpenAI's):
# transformers cannot reproduce that, so hf-clip output needs an explicit --crop-rounding floor.
ROUNDING_CROPS = {"native", "timm (ours)", "open_clip (ours)"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each source built once for the module (conversions only read it)."""
    paths = {}

    def build(name: str):
        if name not in paths:
            paths[name] = SOURCES[name](tmp_path_factory.mktemp(name.replace(" ", "_")))
        return paths[name]
    return build


def test_the_matrix_covers_every_readable_and_writable_format(built):
    from vlm_vit.convert import FORMATS, detect_format
    from vlm_vit.io.loading import read_checkpoint  # importing loading registers every format

    assert set(TARGETS) == set(writable_formats())
    read = {detect_format(read_checkpoint(built(name))).name for name in SOURCES}
    assert read == set(FORMATS.names())


def one_refusal_per_field() -> list[tuple[str, str]]:
    """For each reason a writer gives, the first pair (in sorted order) refused for it."""
    chosen: dict[str, tuple[str, str]] = {}
    for pair in sorted(CANNOT):
        chosen.setdefault(CANNOT[pair], pair)
    return sorted(chosen.values())


# Every reader into native; native into every writer (a CLIP-shaped native encoder, which the
# families' own formats refuse), so each of those writers also writes its own family back.
PAIRS = sorted({*((source, "native") for source in SOURCES),
                *(("native", target) for target in TARGETS),
                *((sources[0], target) for target, sources in WRITTEN_BACK.items()),
                *one_refusal_per_field()})


@pytest.mark.parametrize(("source", "target"), PAIRS)
def test_a_reader_and_a_writer_compose(tmp_path, built, source, target, capsys):
    path = built(source)
    capsys.readouterr()  # what building the source printed (transformers' save progress)
    destination = tmp_path / "converted" / TARGETS[target]
    argv = ["convert", str(path), str(destination), "--to", target]
    if target == "hf_clip" and source in ROUNDING_CROPS:
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "--crop-rounding floor" in err and len(err.strip().splitlines()) == 1
        argv += ["--crop-rounding", "floor"]
    status = main(argv)
    err = capsys.readouterr().err
    if (source, target) in CANNOT:
        assert status == 1 and CANNOT[source, target] in err and len(err.strip().splitlines()) == 1
        return
    assert status == 0, err
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = load_encoder(path).eval()(x).tokens
        torch.testing.assert_close(load_encoder(destination).eval()(x).tokens, expected,
                                   atol=1e-5, rtol=1e-5)


def test_convert_to_an_open_clip_directory_loads_in_open_clip(tmp_path):
    import open_clip

    source = written_by_us("native")(tmp_path / "source")
    assert main(["convert", str(source), str(tmp_path / "oc"), "--to", "open_clip"]) == 0
    model = open_clip.create_model(f"local-dir:{tmp_path / 'oc'}").eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(x), load_encoder(source).eval()(x).cls_token,
                                   atol=1e-5, rtol=1e-5)
