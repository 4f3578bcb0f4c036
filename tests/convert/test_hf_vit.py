"""Hugging Face ViT directories load to the same function as transformers' own ViTModel."""

import json

import numpy as np
import pytest
import torch

from vlm_vit import ImageProcessor, load_encoder, load_processor, load_tower
from vlm_vit.convert import detect_format
from vlm_vit.convert.timm import build_timm_model
from vlm_vit.io.files import write_safetensors
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.testing import perturbed

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            image_size=32, patch_size=8)



def hf_model(cls_name="ViTModel", **options):
    torch.manual_seed(0)
    config = transformers.ViTConfig(**{**TINY, **options})
    return perturbed(getattr(transformers, cls_name)(config))


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    """A saved ViTModel (with its pooler) and the model itself."""
    directory = tmp_path_factory.mktemp("vit")
    model = hf_model()
    model.save_pretrained(directory)
    return directory, model


def pixels(size=(32, 32)):
    return torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(3))


def assert_close(actual, expected, tolerance=1e-4):
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)


def test_every_hidden_state_and_the_tokens_match(vit_dir):
    directory, model = vit_dir
    assert detect_format(read_checkpoint(directory)).name == "hf_vit"
    ours = load_encoder(directory).eval()
    assert ours.config.norm_eps == 1e-12  # as the config says, not our 1e-6 default
    x = pixels()
    with torch.no_grad():
        out = ours(x, output_hidden_states=True)
        theirs = model(x, output_hidden_states=True)
        # transformers' convention: index 0 the embeddings, the last without the final norm
        embeddings = model.embeddings(x)
        final_norm = model.layernorm(theirs.hidden_states[-1])
    assert len(theirs.hidden_states) == TINY["num_hidden_layers"] + 1
    assert_close(theirs.hidden_states[0], embeddings, 0)
    assert_close(final_norm, theirs.last_hidden_state, 0)
    assert not torch.allclose(theirs.hidden_states[-1], theirs.last_hidden_state, atol=1e-2)
    for hidden, expected in zip(out.hidden_states, theirs.hidden_states, strict=True):
        assert_close(hidden, expected)
    assert_close(out.tokens, theirs.last_hidden_state)  # ViT's last_hidden_state is normed


def test_tower_is_the_hf_pooler(vit_dir):
    directory, model = vit_dir
    tower = load_tower(directory).eval()
    x = pixels()
    with torch.no_grad():
        assert_close(tower(x), model(x).pooler_output)


def test_image_classification_model_drops_prefix_and_classifier(tmp_path):
    model = hf_model("ViTForImageClassification", num_labels=5)
    model.save_pretrained(tmp_path)
    ours = load_encoder(tmp_path).eval()
    x = pixels()
    with torch.no_grad():
        theirs = model.vit(x, output_hidden_states=True)
        out = ours(x, output_hidden_states=True)
        for hidden, expected in zip(out.hidden_states, theirs.hidden_states, strict=True):
            assert_close(hidden, expected)
        assert_close(out.tokens, theirs.last_hidden_state)
        # no ViTPooler here: the checkpoint's own pooling is the final-norm class token
        assert_close(load_tower(tmp_path).eval()(x), theirs.last_hidden_state[:, 0])


def test_non_square_images(vit_dir):
    """At 32 x 48 the position table is resized as HF's interpolate_pos_encoding does (bicubic,
    no antialias); timm's dynamic_img_size antialiases, so it is matched with that override."""
    directory, model = vit_dir
    x = pixels((32, 48))
    encoder = load_encoder(directory).eval()
    timm_like = load_encoder(directory, pos_resize_antialias=True).eval()
    theirs = build_timm_model(timm_like.config, dynamic_img_size=True).eval()
    theirs.load_state_dict(timm_like.state_dict())
    with torch.no_grad():
        assert_close(encoder(x).tokens,
                     model(x, interpolate_pos_encoding=True).last_hidden_state)
        assert_close(timm_like(x).tokens, theirs.forward_features(x))


def test_preprocessor_config_is_read(vit_dir, tmp_path):
    directory, _ = vit_dir
    # without preprocessor_config.json: ViTImageProcessor's defaults at the model's size
    expected = ImageProcessor(size=(32, 32), resize_mode="squash", resample="bilinear",
                              mean=(0.5,) * 3, std=(0.5,) * 3, crop_rounding="floor")
    assert load_processor(directory) == expected
    hf_processor = transformers.ViTImageProcessor(size={"height": 32, "width": 48}, resample=3,
                                                  image_mean=[0.4, 0.5, 0.6])
    hf_processor.save_pretrained(tmp_path)
    hf_model().save_pretrained(tmp_path)
    ours = load_processor(tmp_path)
    assert ours == ImageProcessor(size=(32, 48), resize_mode="squash", resample="bicubic",
                                  mean=(0.4, 0.5, 0.6), std=(0.5,) * 3, crop_rounding="floor")
    image = (np.random.default_rng(0).random((50, 70, 3)) * 255).astype(np.uint8)
    if hasattr(transformers, "ViTImageProcessorPil"):  # transformers 5: resizes with PIL,
        pil = transformers.ViTImageProcessorPil(  # as ours does: equal (measured 0.0)
            size={"height": 32, "width": 48}, resample=3, image_mean=[0.4, 0.5, 0.6])
        torch.testing.assert_close(ours(image), pil(image, return_tensors="pt")["pixel_values"],
                                   atol=1e-6, rtol=0)
    # The default one resizes with torchvision, whose bicubic rounds some pixels to the
    # neighbouring uint8 level (measured: max 0.0078 = 1/255/std, mean 4.8e-5).
    difference = (ours(image) - hf_processor(image, return_tensors="pt")["pixel_values"]).abs()
    assert difference.max() <= 1 / 255 / 0.5 + 1e-5 and difference.mean() < 1e-3


def test_transformers5_module_names(tmp_path):
    """A state_dict() saved by hand uses transformers 5's module names (layers.N.mlp.fc1...)."""
    model = hf_model()
    model.config.save_pretrained(tmp_path)
    write_safetensors(model.state_dict(), tmp_path / "model.safetensors")
    x = pixels()
    with torch.no_grad():
        assert_close(load_encoder(tmp_path).eval()(x).tokens, model(x).last_hidden_state)


@pytest.mark.parametrize("hidden_act, ours", [("gelu_new", "gelu_tanh"),
                                              ("gelu_pytorch_tanh", "gelu_tanh"),
                                              ("quick_gelu", "quick_gelu")])
def test_activations(tmp_path, hidden_act, ours):
    model = hf_model(hidden_act=hidden_act)
    model.save_pretrained(tmp_path)
    encoder = load_encoder(tmp_path).eval()
    assert encoder.config.act == ours
    x = pixels()
    with torch.no_grad():
        assert_close(encoder(x).tokens, model(x).last_hidden_state)


def test_unknown_activation_is_refused(vit_dir, tmp_path):
    directory, _ = vit_dir
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "relu"}))
    (tmp_path / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        load_encoder(tmp_path)


def test_weights_without_config_say_what_is_missing(vit_dir):
    directory, _ = vit_dir
    with pytest.raises(ValueError, match="no config.json"):
        load_encoder(directory / "model.safetensors")


@pytest.mark.parametrize("cls_name", ["ViTMAEModel", "ViTMAEForPreTraining"])
def test_vit_mae_encoder_matches_transformers_unmasked(tmp_path, cls_name):
    """facebook/vit-mae-*: ViTMAE's encoder, every patch kept in order (mask_ratio 0 and
    ascending noise), is ours; the pretraining decoder is dropped."""
    config = transformers.ViTMAEConfig(**TINY, mask_ratio=0.0, decoder_hidden_size=16,
                                       decoder_num_hidden_layers=1,
                                       decoder_num_attention_heads=2,
                                       decoder_intermediate_size=32)
    torch.manual_seed(0)
    model = perturbed(getattr(transformers, cls_name)(config))
    model.save_pretrained(tmp_path)
    ours = load_encoder(tmp_path).eval()
    vit = model.vit if cls_name == "ViTMAEForPreTraining" else model
    x = pixels()
    noise = torch.arange(16, dtype=torch.float32).expand(x.shape[0], 16)  # keeps the order
    with torch.no_grad():
        expected = vit(x, noise=noise, output_hidden_states=True)
        out = ours(x, output_hidden_states=True)
    assert_close(out.tokens, expected.last_hidden_state)
    for index in (0, 1, 2):
        assert_close(out.hidden_states[index], expected.hidden_states[index])
