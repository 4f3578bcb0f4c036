"""Hugging Face `DINOv3ViTModel` directories (model_type "dinov3_vit"; Siméoni et al. 2025).

A DINOv3 ViT block is DINOv2's (LayerScale on both branches, `layer_scale1.lambda1`, our
`ls1.gamma`; for the large ones a SwiGLU MLP, `use_gated_mlp`) without a position table: 2D
RoPE turns q and k of the patch tokens (not of the class and register tokens) by their patch
centres normalised to [-1, 1] over each image's own grid (`rope_positions="centered"`,
`layers.rope_centered`), at theta^(-4j/head_dim) turns per unit ("shared" frequencies,
theta `rope_theta`, 100 in every release). The register tokens follow the class token,
without position: our layout.

What the file fixes, recorded in `Converted.rules`:

* q, k and v are separate Linears whose biases each may be absent (`query_bias`, `key_bias`,
  `value_bias`: k has none in every release), as may the output's (`proj_bias`) and the MLP's
  (`mlp_bias`); an absent bias reads as a zero one (the same function);
* `pos_embed_shift`, `pos_embed_jitter` and `pos_embed_rescale` move the RoPE coordinates at
  random in training only: these are the coordinates transformers uses at inference;
* pooling is the class token after the final norm (`pooler_output`).

The files use the names `save_pretrained` writes (`layer.N.`); transformers 5's module names
(`model.layer.N.`), found in a state dict saved by hand, are read too.

`write` goes the other way: a `DINOv3ViTModel` directory under the names `save_pretrained`
writes, each bias flag set by whether that bias is zero (a k bias that is zero is left out, as
in every release); an encoder without LayerScale gets scales of one (the same function).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_vit.config import EncoderConfig
from vlm_vit.convert.base import (
    Checkpoint,
    Converted,
    NativePooler,
    check_block_count,
    held_blocks,
    register_format,
)
from vlm_vit.convert.hf_common import (
    PREPROCESSOR_NAME,
    VIT_IMAGE_PROCESSOR,
    hf_encoder_config,
    squash_processor,
)
from vlm_vit.convert.hf_writing import (
    HF_ACTIVATIONS,
    detached,
    mismatches,
    parameter_free,
    refuse,
    write_hf_directory,
)
from vlm_vit.convert.keymap import fuse_qkv, origins, rename, split_qkv
from vlm_vit.io.weights import DEFAULT_MAX_SHARD_SIZE
from vlm_vit.processor import ImageProcessor

MODEL_TYPE = "dinov3_vit"
CONFIG_FILE = "config.json"
# transformers' DINOv3ViTConfig defaults, for config files written before a key existed.
HF_DEFAULTS: dict[str, Any] = dict(
    hidden_size=384, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=6,
    hidden_act="gelu", layer_norm_eps=1e-5, rope_theta=100.0, image_size=224, patch_size=16,
    num_channels=3, query_bias=True, key_bias=False, value_bias=True, proj_bias=True,
    mlp_bias=True, layerscale_value=1.0, use_gated_mlp=False, num_register_tokens=0,
    pos_embed_shift=None, pos_embed_jitter=None, pos_embed_rescale=2.0,
)
BIAS_FLAGS = ("query_bias", "key_bias", "value_bias", "proj_bias", "mlp_bias", "use_gated_mlp")
LAYER_PREFIXES = ("layer.{}.", "model.layer.{}.")  # save_pretrained's, transformers 5 modules'
BLOCK_PATTERN = r"(?:model\.)?layer\.(\d+)\."
# Deliberately dropped: the masked-image-modelling token.
IGNORED = (r"embeddings\.mask_token$",)


def block_modules(hf: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """A layer's modules: their name -> (our name, whether it has a bias), as the config
    builds them."""
    gated = hf["use_gated_mlp"]
    return {
        "norm1": ("norm1", True), "norm2": ("norm2", True),
        "attention.q_proj": ("attn.q", hf["query_bias"]),
        "attention.k_proj": ("attn.k", hf["key_bias"]),
        "attention.v_proj": ("attn.v", hf["value_bias"]),
        "attention.o_proj": ("attn.proj", hf["proj_bias"]),
        "mlp.up_proj": ("mlp.fc1_x" if gated else "mlp.fc1", hf["mlp_bias"]),
        "mlp.down_proj": ("mlp.fc2", hf["mlp_bias"]),
        **({"mlp.gate_proj": ("mlp.fc1_g", hf["mlp_bias"])} if gated else {}),
    }


def key_map(hf: dict[str, Any], layer_prefixes: tuple[str, ...] = LAYER_PREFIXES
            ) -> dict[str, str]:
    """Source -> native names for the tensors the config says the model has (a bias it says
    is absent is then an unknown tensor, refused by `rename`)."""
    names = {"embeddings.cls_token": "cls_token", "embeddings.register_tokens": "reg_token",
             "embeddings.patch_embeddings.weight": "patch_embed.proj.weight",
             "embeddings.patch_embeddings.bias": "patch_embed.proj.bias",
             "norm.weight": "norm.weight", "norm.bias": "norm.bias"}
    for prefix in layer_prefixes:
        names[prefix + "layer_scale1.lambda1"] = "blocks.{}.ls1.gamma"
        names[prefix + "layer_scale2.lambda1"] = "blocks.{}.ls2.gamma"
        for theirs, (ours, bias) in block_modules(hf).items():
            for kind in ("weight", "bias") if bias else ("weight",):
                names[f"{prefix}{theirs}.{kind}"] = f"blocks.{{}}.{ours}.{kind}"
    return names


def hf_settings(config: dict[str, Any], source: object) -> dict[str, Any]:
    """The config with transformers' defaults filled in, its switches checked.

    Raises:
        ValueError: naming `source` and the key, for a switch that is not true or false, or
            a patch size that is not one int (or two equal ones).
    """
    hf = {**HF_DEFAULTS, **config}
    for key in BIAS_FLAGS:
        if not isinstance(hf[key], bool):
            raise ValueError(f"{source}: {key} must be true or false, got {hf[key]!r}")
    patch = hf["patch_size"]
    if isinstance(patch, (list, tuple)) and len(patch) == 2 and patch[0] == patch[1]:
        hf["patch_size"] = patch[0]
    elif isinstance(patch, (list, tuple)):
        raise ValueError(f"{source}: patch_size {patch!r} is not square; vlm-vit's patches are")
    return hf


def encoder_config(hf: dict[str, Any], source: object = CONFIG_FILE) -> EncoderConfig:
    """Our architecture from a DINOv3ViTConfig dict (defaults filled in, `hf_settings`).

    Raises:
        ValueError: for settings vlm-vit refuses (a gated MLP whose activation is not SiLU,
            sizes out of range, heads that do not divide the width), naming `source`.
    """
    gated = hf["use_gated_mlp"]
    return hf_encoder_config(
        hf, source, qkv_bias=hf["query_bias"] or hf["key_bias"] or hf["value_bias"],
        num_register_tokens=hf["num_register_tokens"], layer_scale_init=hf["layerscale_value"],
        mlp="swiglu" if gated else "mlp", pos_embed="none", rope_theta=hf["rope_theta"],
        rope_frequencies="shared", rope_positions="centered")


def zero_absent_biases(state: dict[str, torch.Tensor], config: EncoderConfig,
                       hf: dict[str, Any]) -> list[str]:
    """A zero bias for each Linear the config builds without one (in place): q, k and v (when
    any has one), the attention output and the MLP. Returns their names in block 0."""
    added = []
    for i in range(config.depth):
        reference = state[f"blocks.{i}.norm1.weight"]
        for theirs, (ours, bias) in block_modules(hf).items():
            if bias or not ours.startswith(("attn.", "mlp.")):
                continue
            if ours in ("attn.q", "attn.k", "attn.v") and not config.qkv_bias:
                continue
            size = config.mlp_width if ours in ("mlp.fc1", "mlp.fc1_g", "mlp.fc1_x") \
                else config.width
            state[f"blocks.{i}.{ours}.bias"] = reference.new_zeros(size)
            added += [theirs] if i == 0 else []
    return added


def image_processor(settings: dict[str, Any] | None, image_size: tuple[int, int],
                    source: object) -> tuple[ImageProcessor, list[str]]:
    """The ImageProcessor of a `preprocessor_config.json` (DINOv3ViTImageProcessorFast: a
    resize straight to {height, width}, bilinear, ImageNet mean and std); without one, those
    at the model's image size."""
    return squash_processor(settings, image_size, source, resample="bilinear",
                            family="DINOv3's", processor_class=VIT_IMAGE_PROCESSOR)


class HfDinov3Format:
    """`DINOv3ViTModel` saved by `save_pretrained`."""

    name = "hf_dinov3"

    def matches(self, checkpoint: Checkpoint) -> bool:
        return checkpoint.config is not None and checkpoint.config.get("model_type") == MODEL_TYPE

    def to_native(self, checkpoint: Checkpoint) -> Converted:
        source = checkpoint.path / CONFIG_FILE
        hf = hf_settings(checkpoint.config, source)
        config = encoder_config(hf, source)
        tensors = dict(checkpoint.tensors)
        registers = tensors.get("embeddings.register_tokens")
        if registers is not None and registers.ndim == 3 and registers.shape[1] == 0:
            del tensors["embeddings.register_tokens"]  # transformers keeps an empty one
        check_block_count(config.depth, held_blocks(tensors, BLOCK_PATTERN), checkpoint.path,
                          CONFIG_FILE)
        names = key_map(hf)
        state = rename(tensors, names, config.depth, ignore=IGNORED, source=checkpoint.path)
        rules = []
        if added := zero_absent_biases(state, config, hf):
            rules.append(f"zero biases for the Linears the config builds without: "
                         f"{', '.join(added)}")
        fuse_qkv(state, config.depth, width=config.width, source=checkpoint.path,
                 origin=origins(tensors, names, config.depth))
        processor, processor_rules = image_processor(checkpoint.files.get(PREPROCESSOR_NAME),
                                                     config.image_size, checkpoint.path)
        rules += processor_rules
        augmentation = {key: hf[key] for key in ("pos_embed_shift", "pos_embed_jitter",
                                                 "pos_embed_rescale") if hf[key] is not None}
        rules.append(f"RoPE at DINOv3's patch centres in [-1, 1] (theta {config.rope_theta:g}); "
                     f"the training-only coordinate augmentation {augmentation} is not applied")
        return Converted(config=config, state=state,
                         pooler=NativePooler("cls", config.width, None, {}, {}),
                         processor=processor, rules=rules, source=checkpoint.path,
                         config_file=CONFIG_FILE)

    def write(self, encoder: nn.Module, destination: str | Path, *,
              pooler: nn.Module | None = None, processor: ImageProcessor | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
        """Writes a directory `DINOv3ViTModel.from_pretrained` and `AutoModel` read: config.json
        and the weights, and the processor as DINOv3's preprocessor_config.json.

        Raises:
            ValueError: naming every field DINOv3 cannot hold (see `WRITE_ARCHITECTURE`), a
                pooler with weights, or a processor it cannot express; nothing is written then.
        """
        hf, tensors = dinov3_config(encoder), dinov3_tensors(encoder)
        parameter_free(pooler, "DINOv3")
        settings = None
        if processor is not None:
            from vlm_vit.convert.hf_clip import preprocessor_config

            settings = {**preprocessor_config(processor),
                        "image_processor_type": "DINOv3ViTImageProcessorFast"}
        return write_hf_directory(destination, hf, tensors, settings, max_shard_size)


# -- writing ----------------------------------------------------------------------------------

# What a DINOv3 ViT fixes, in EncoderConfig fields; `write` refuses anything else.
WRITE_ARCHITECTURE = dict(class_token=True, pre_norm=False, final_norm=True, patch_bias=True,
                          norm="layernorm", mlp_norm=False, hybrid_layers=None, pos_embed="none",
                          rope_positions="centered", rope_frequencies="shared",
                          temporal_patch_size=None, window_size=None, patch_norm=False)


def bias_flags(state: dict[str, torch.Tensor], config: EncoderConfig) -> dict[str, bool]:
    """Each of DINOv3's bias switches: true where that bias is not zero in some block."""
    def nonzero(name: str, part: int | None = None) -> bool:
        for i in range(config.depth):
            tensor = state.get(f"blocks.{i}.{name}")
            if tensor is not None and bool((tensor if part is None
                                            else tensor.chunk(3)[part]).any()):
                return True
        return False
    fc1 = ("mlp.fc1_g.bias", "mlp.fc1_x.bias") if config.mlp == "swiglu" else ("mlp.fc1.bias",)
    return {"query_bias": nonzero("attn.qkv.bias", 0), "key_bias": nonzero("attn.qkv.bias", 1),
            "value_bias": nonzero("attn.qkv.bias", 2), "proj_bias": nonzero("attn.proj.bias"),
            "mlp_bias": any(nonzero(name) for name in (*fc1, "mlp.fc2.bias"))}


def dinov3_config(encoder: nn.Module) -> dict[str, Any]:
    """The `config.json` of a DINOv3ViTModel holding `encoder`.

    Raises:
        ValueError: naming every field DINOv3 cannot hold.
    """
    config = encoder.config
    problems = mismatches(config, WRITE_ARCHITECTURE, "DINOv3")
    if config.rope_theta is None:
        problems.insert(0, "rope_theta=None (DINOv3 needs 2D RoPE)")
    refuse(problems, "DINOv3")
    height, width = config.image_size
    return {
        "architectures": ["DINOv3ViTModel"], "model_type": MODEL_TYPE,
        "hidden_size": config.width, "intermediate_size": config.mlp_width,
        "num_hidden_layers": config.depth, "num_attention_heads": config.heads,
        "hidden_act": HF_ACTIVATIONS[config.act], "layer_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "image_size": height if height == width else [height, width],
        "patch_size": config.patch_size, "num_channels": config.in_channels,
        **bias_flags(detached(encoder), config),
        "layerscale_value": config.layer_scale_init or 1.0,
        "use_gated_mlp": config.mlp == "swiglu",
        "num_register_tokens": config.num_register_tokens,
        "pos_embed_shift": None, "pos_embed_jitter": None, "pos_embed_rescale": 2.0,
        "attention_dropout": 0.0, "drop_path_rate": 0.0, "initializer_range": 0.02,
        "apply_layernorm": True, "reshape_hidden_states": True,
        "dtype": str(encoder.cls_token.dtype).removeprefix("torch."),
    }


def dinov3_tensors(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """The encoder's weights under the names `save_pretrained` writes (a pure function):
    the biases `bias_flags` finds zero left out."""
    config = encoder.config
    state = detached(encoder)
    flags = bias_flags(state, config)
    split_qkv(state, config.depth)
    hf = {**HF_DEFAULTS, **flags, "use_gated_mlp": config.mlp == "swiglu"}
    for i in range(config.depth):
        for _, (ours, bias) in block_modules(hf).items():
            if not bias:
                state.pop(f"blocks.{i}.{ours}.bias", None)
        for name in (f"blocks.{i}.ls1.gamma", f"blocks.{i}.ls2.gamma"):
            state.setdefault(name, state["cls_token"].new_ones(config.width))  # LayerScale of one
    reference = state["cls_token"]
    state["mask_token"] = reference.new_zeros(1, 1, config.width)
    state.setdefault("reg_token", reference.new_zeros(1, 0, config.width))
    names = {ours: theirs for theirs, ours in key_map(hf, LAYER_PREFIXES[:1]).items()}
    names["mask_token"] = "embeddings.mask_token"
    return rename(state, names, config.depth, source="the encoder")


register_format(HfDinov3Format())
