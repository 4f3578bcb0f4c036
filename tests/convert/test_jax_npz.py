"""Google `.npz` files (the paper's layout and big_vision's) load to the same function as
timm's own npz loader gives."""

import re

import numpy as np
import pytest
import torch

from vlm_vit import ImageProcessor, load_encoder, load_processor, load_tower
from vlm_vit.convert import FORMATS, detect_format
from vlm_vit.io.loading import read_checkpoint

vision_transformer = pytest.importorskip("timm.models.vision_transformer")

WIDTH, DEPTH, HEADS, HEAD_DIM = 32, 2, 4, 8
# act_layer gelu_tanh: flax's nn.gelu, which the converter assumes (timm defaults to erf GELU).
BASE = dict(img_size=32, patch_size=8, embed_dim=WIDTH, depth=DEPTH, num_heads=HEADS,
            mlp_ratio=2.0, num_classes=0, act_layer="gelu_tanh")
# The paper's block submodule names -> big_vision's.
BIG_VISION_NAMES = {"MultiHeadDotProductAttention_1": "MultiHeadDotProductAttention_0",
                    "LayerNorm_2": "LayerNorm_1", "MlpBlock_3": "MlpBlock_0"}


def timm_model(**options):
    """A tiny timm ViT with every weight perturbed (so biases and norms are not trivial)."""
    torch.manual_seed(0)
    model = vision_transformer.VisionTransformer(**{**BASE, **options}).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model


def attention_arrays(prefix, q, k, v, proj_weight, proj_bias, qkv_bias):
    """PyTorch q/k/v/out Linear weights in flax's per-head layout."""
    arrays = {f"{prefix}out/kernel": proj_weight.T.reshape(HEADS, HEAD_DIM, WIDTH),
              f"{prefix}out/bias": proj_bias}
    for name, weight, bias in zip(("query", "key", "value"), (q, k, v), np.split(qkv_bias, 3),
                                  strict=True):
        arrays[f"{prefix}{name}/kernel"] = weight.T.reshape(WIDTH, HEADS, HEAD_DIM)
        arrays[f"{prefix}{name}/bias"] = bias.reshape(HEADS, HEAD_DIM)
    return arrays


def google_arrays(model, pre_logits=None):
    """A timm model's weights in the paper's npz layout (the inverse of timm's loader)."""
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    arrays = {
        "embedding/kernel": sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0),  # HWIO
        "embedding/bias": sd["patch_embed.proj.bias"],
        "Transformer/encoder_norm/scale": sd["norm.weight"],
        "Transformer/encoder_norm/bias": sd["norm.bias"],
    }
    if model.cls_token is not None:
        arrays["cls"] = sd["cls_token"]
        arrays["Transformer/posembed_input/pos_embedding"] = sd["pos_embed"]
    else:
        arrays["pos_embedding"] = sd["pos_embed"]  # only big_vision has no class token
    for i in range(DEPTH):
        block, ours = f"Transformer/encoderblock_{i}/", f"blocks.{i}."
        arrays.update(attention_arrays(
            block + "MultiHeadDotProductAttention_1/", *np.split(sd[ours + "attn.qkv.weight"], 3),
            sd[ours + "attn.proj.weight"], sd[ours + "attn.proj.bias"],
            sd[ours + "attn.qkv.bias"]))
        for flax, norm in (("LayerNorm_0", "norm1"), ("LayerNorm_2", "norm2")):
            arrays[f"{block}{flax}/scale"] = sd[f"{ours}{norm}.weight"]
            arrays[f"{block}{flax}/bias"] = sd[f"{ours}{norm}.bias"]
        for d in (0, 1):
            arrays[f"{block}MlpBlock_3/Dense_{d}/kernel"] = sd[f"{ours}mlp.fc{d + 1}.weight"].T
            arrays[f"{block}MlpBlock_3/Dense_{d}/bias"] = sd[f"{ours}mlp.fc{d + 1}.bias"]
    if pre_logits is not None:
        arrays["pre_logits/kernel"], arrays["pre_logits/bias"] = pre_logits
    arrays["head/kernel"] = np.zeros((WIDTH, 5), np.float32)  # a classifier, ignored
    arrays["head/bias"] = np.zeros(5, np.float32)
    return arrays


def big_vision_arrays(google, prefix="params/"):
    """The same weights as big_vision writes them with `scan=True`: renamed submodules,
    blocks stacked on a leading depth axis, the position table without a class entry."""
    arrays, stacked = {}, {}
    for name, array in google.items():
        match = re.fullmatch(r"Transformer/encoderblock_(\d+)/([^/]+)/(.*)", name)
        if match:
            index, module, leaf = match.groups()
            module = BIG_VISION_NAMES.get(module, module)
            stacked.setdefault(f"Transformer/encoderblock/{module}/{leaf}", {})[int(index)] = array
        else:
            arrays[name] = array
    arrays.update({name: np.stack([parts[i] for i in range(DEPTH)])
                   for name, parts in stacked.items()})
    if "cls" in arrays:  # big_vision adds positions, then prepends the class token
        table = arrays.pop("Transformer/posembed_input/pos_embedding")
        arrays["cls"] = arrays["cls"] + table[:, :1]
        arrays["pos_embedding"] = table[:, 1:]
    return {prefix + name: array for name, array in arrays.items()}


def map_head_arrays(model):
    """timm's AttentionPoolLatent as big_vision's MAPHead_0."""
    sd = {k: v.detach().numpy().copy() for k, v in model.attn_pool.state_dict().items()}
    key, value = np.split(sd["kv.weight"], 2)
    arrays = attention_arrays("MAPHead_0/MultiHeadDotProductAttention_0/", sd["q.weight"], key,
                              value, sd["proj.weight"], sd["proj.bias"],
                              np.concatenate([sd["q.bias"], sd["kv.bias"]]))
    arrays.update({"MAPHead_0/probe": sd["latent"],
                   "MAPHead_0/LayerNorm_0/scale": sd["norm.weight"],
                   "MAPHead_0/LayerNorm_0/bias": sd["norm.bias"]})
    for d in (0, 1):
        arrays[f"MAPHead_0/MlpBlock_0/Dense_{d}/kernel"] = sd[f"mlp.fc{d + 1}.weight"].T
        arrays[f"MAPHead_0/MlpBlock_0/Dense_{d}/bias"] = sd[f"mlp.fc{d + 1}.bias"]
    return arrays


def save(path, arrays):
    np.savez(path, **arrays)
    return path


def timm_from_npz(path, **options):
    """A fresh timm model filled by timm's own npz loader (`_load_weights`)."""
    model = vision_transformer.VisionTransformer(**{**BASE, **options}).eval()
    model.load_pretrained(str(path))
    return model


def timm_blocks(model, x):
    """Every block output of a timm model, all tokens, no final norm."""
    tokens = model.norm_pre(model._pos_embed(model.patch_embed(x)))
    outputs = []
    for block in model.blocks:
        tokens = block(tokens)
        outputs.append(tokens)
    return outputs


def pixels(size=(32, 32)):
    return torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(3))


def assert_same_function(ours, theirs, size=(32, 32)):
    x = pixels(size)
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        expected_blocks = timm_blocks(theirs, x)
        expected = theirs.forward_features(x)
    assert len(out.hidden_states) == len(expected_blocks) + 1
    for hidden, block in zip(out.hidden_states[1:], expected_blocks, strict=True):
        torch.testing.assert_close(hidden, block, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.tokens, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prefix", ["", "opt/target/"])
def test_google_layout_matches_timm_loader(tmp_path, prefix):
    model = timm_model()
    arrays = {prefix + k: v for k, v in google_arrays(model).items()}
    path = save(tmp_path / "ViT-tiny.npz", arrays)
    assert detect_format(read_checkpoint(path)).name == "jax_npz"
    ours = load_encoder(path).eval()
    assert (ours.config.heads, ours.config.depth, ours.config.mlp_width) == (HEADS, DEPTH, 64)
    assert (ours.config.act, ours.config.norm_eps) == ("gelu_tanh", 1e-6)
    assert_same_function(ours, timm_from_npz(path))
    # the export is the exact inverse of the conversion: the weights come back bit for bit
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], tensor, atol=0, rtol=0)


def test_detected_by_keys_not_extension(tmp_path):
    path = tmp_path / "weights.bin"
    with path.open("wb") as handle:
        np.savez(handle, **google_arrays(timm_model()))
    assert load_encoder(path).config.width == WIDTH
    assert "jax_npz" in FORMATS.names()


def test_exact_gelu_override_matches_default_timm(tmp_path):
    path = save(tmp_path / "w.npz", google_arrays(timm_model()))
    theirs = timm_from_npz(path, act_layer="gelu")
    assert_same_function(load_encoder(path, act="gelu").eval(), theirs)


def test_scanned_big_vision_layout_loads_to_the_same_encoder(tmp_path):
    google = google_arrays(timm_model())
    reference = load_encoder(save(tmp_path / "google.npz", google)).eval()
    path = save(tmp_path / "big_vision.npz", big_vision_arrays(google))
    ours = load_encoder(path).eval()
    x = pixels()
    with torch.no_grad():
        out, expected = ours(x, output_hidden_states=True), reference(x, output_hidden_states=True)
    for hidden, wanted in zip(out.hidden_states, expected.hidden_states, strict=True):
        torch.testing.assert_close(hidden, wanted, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.tokens, expected.tokens, atol=1e-5, rtol=1e-5)
    # timm reads big_vision files into a model whose class token has no position entry
    assert_same_function(ours, timm_from_npz(path, no_embed_class=True))


def test_map_head_becomes_attention_pool(tmp_path):
    model = timm_model(class_token=False, global_pool="map")
    arrays = big_vision_arrays({**google_arrays(model), **map_head_arrays(model)})
    path = save(tmp_path / "map.npz", arrays)
    theirs = timm_from_npz(path, class_token=False, global_pool="map")
    tower = load_tower(path).eval()
    assert not tower.encoder.config.class_token
    x = pixels()
    with torch.no_grad():
        expected = theirs.forward_head(theirs.forward_features(x))
        torch.testing.assert_close(tower(x), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(model.forward_head(model.forward_features(x)), expected,
                                   atol=1e-5, rtol=1e-5)


def test_tower_is_pre_logits_of_the_final_class_token(tmp_path):
    model = timm_model()
    generator = np.random.default_rng(0)
    kernel = generator.normal(size=(WIDTH, 24)).astype(np.float32) * 0.2
    bias = generator.normal(size=24).astype(np.float32) * 0.2
    path = save(tmp_path / "w.npz", google_arrays(model, pre_logits=(kernel, bias)))
    tower = load_tower(path).eval()
    x = pixels()
    with torch.no_grad():
        cls = timm_from_npz(path).forward_features(x)[:, 0].numpy()  # final-norm class token
        torch.testing.assert_close(tower(x), torch.from_numpy(np.tanh(cls @ kernel + bias)),
                                   atol=1e-4, rtol=1e-4)


def test_without_pre_logits_the_tower_is_the_class_token(tmp_path):
    path = save(tmp_path / "w.npz", google_arrays(timm_model()))
    x = pixels()
    with torch.no_grad():
        torch.testing.assert_close(load_tower(path).eval()(x),
                                   load_encoder(path).eval()(x).cls_token)


def test_position_table_resizes_like_timm_loader(tmp_path):
    """Bilinear without antialias, as timm resizes these tables (the Google code zooms
    bilinearly too)."""
    path = save(tmp_path / "w.npz", google_arrays(timm_model()))
    ours = load_encoder(path, image_size=48).eval()
    assert ours.config.pos_resize_mode == "bilinear"
    assert_same_function(ours, timm_from_npz(path, img_size=48), size=(48, 48))


def test_processor_is_inception_squash(tmp_path):
    path = save(tmp_path / "w.npz", google_arrays(timm_model()))
    assert load_processor(path) == ImageProcessor(size=(32, 32), resize_mode="squash",
                                                  resample="bilinear", mean=(0.5,) * 3,
                                                  std=(0.5,) * 3)


def test_object_array_npz_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "pickled.npz"
    np.savez(path, allow_pickle=True, **{"embedding/kernel": np.array([{"code": 1}],
                                                                      dtype=object)})
    with pytest.raises(ValueError, match=re.escape(str(path))) as error:
        load_encoder(path)
    assert "object arrays" in str(error.value).lower()


def test_hybrid_resnet_tensors_are_listed(tmp_path):
    arrays = {**google_arrays(timm_model()), "conv_root/kernel": np.zeros((7, 7, 3, 8))}
    with pytest.raises(ValueError, match="conv_root/kernel"):
        load_encoder(save(tmp_path / "hybrid.npz", arrays))
