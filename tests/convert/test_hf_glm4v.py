"""Hugging Face `Glm4vVisionModel` directories (GLM-4V's vision tower: Conv3d patches with a
bias and an RMSNorm, a learned square table read by `grid_sample` bicubically plus 2D RoPE,
RMSNorm blocks with a bias-free SwiGLU as wide as the output, a final RMSNorm, a Conv2d
downsample and a SwiGLU merger) load to the same function as transformers' own model, fed the
same pixels: every hidden state within 1e-5 (theirs in merge-window order, ours row-major),
the downsample's and the merger's outputs, at the native size, at a non-square one and on two
images in one packed call. Written back, transformers loads the directory strictly and
computes our outputs. Hostile configs are refused by name before a model is built."""

import json

import pytest
import torch

from vlm_vit import EncoderConfig, VisionEncoder, load_encoder, load_tower
from vlm_vit.convert import FORMATS, detect_format
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.layers.rope_2d import merge_window_order
from vlm_vit.poolers import build_pooler
from vlm_vit.testing import perturbed

from .refusals import assert_refused_before_building
from .test_hf_qwen2_vl import MERGE, P, T, flattened
from .test_hf_qwen3_vl import packed_order

transformers = pytest.importorskip("transformers")

SIDE = 6  # the table's side: 36 entries, image_size 24 pixels
TINY = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=40, num_heads=4,
            patch_size=P, temporal_patch_size=T, spatial_merge_size=MERGE,
            image_size=SIDE * P)
# the native 6x6 grid, then 4x10 patches: the table shrunk in rows, stretched in columns
SIZES = [(SIDE * P, SIDE * P), (16, 40)]


def save_glm4v(folder, **options):
    """A tiny `Glm4vVisionModel`, every weight perturbed (the downsample and merger more, so
    their output is not near zero), saved by `save_pretrained`."""
    from transformers.models.glm4v.configuration_glm4v import Glm4vVisionConfig
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

    torch.manual_seed(0)
    model = perturbed(Glm4vVisionModel(Glm4vVisionConfig(**{**TINY, **options})))
    perturbed(model.merger, scale=0.3, seed=1)
    perturbed(model.downsample, scale=0.3, seed=2)
    model.save_pretrained(folder)
    return folder, model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_glm4v(tmp_path_factory.mktemp("glm4v"))


def their_outputs(model, images):
    """transformers' outputs for `[C, H, W]` images, each repeated over the temporal patch,
    with `states`: the embeddings, every block's output and `post_layernorm`'s (transformers
    returns the downsample's as its last hidden state)."""
    parts = [flattened(image[:, None].expand(-1, T, -1, -1)) for image in images]
    patches = torch.cat([p for p, _ in parts])
    grid_thw = torch.cat([g for _, g in parts])
    states = {}
    hooks = [module.register_forward_hook(
        lambda _, args, output, index=index: states.__setitem__(index, output))
        for index, module in enumerate([*model.blocks, model.post_layernorm], start=1)]
    try:
        with torch.no_grad():
            out = model(patches, grid_thw=grid_thw, output_hidden_states=True)
    finally:
        for hook in hooks:
            hook.remove()
    out.states = [out.hidden_states[0], *(states[i] for i in sorted(states))]
    return out


def downsampled(pooler, tokens, grid):
    """Our pooler's downsample alone: `[N, D]` row-major tokens to `[M, out]`."""
    image = tokens.transpose(0, 1).reshape(1, -1, *grid)
    return pooler.downsample(image).flatten(2)[0].transpose(0, 1)


@pytest.mark.parametrize("size", SIZES)
def test_every_hidden_state_and_the_merger_match_on_an_image(saved, size):
    directory, model = saved
    assert detect_format(read_checkpoint(directory)).name == "hf_glm4v"
    tower = load_tower(directory)
    ours = tower.encoder.eval()
    image = torch.randn(3, *size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = ours(image[None], output_hidden_states=True)
        pooled = tower.pooler(out.tokens, num_prefix_tokens=0, grid=out.grid)
        down = downsampled(tower.pooler, out.tokens[0], out.grid)
    theirs = their_outputs(model, [image])
    order = merge_window_order(out.grid, MERGE)
    assert len(out.hidden_states) == TINY["depth"] + 1 == len(theirs.states) - 1
    for ours_state, their_state in zip([*out.hidden_states, out.tokens], theirs.states,
                                       strict=True):
        torch.testing.assert_close(ours_state[0, order], their_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(down, theirs.last_hidden_state, atol=1e-5, rtol=1e-5)
    assert theirs.pooler_output.abs().max() > 0.1  # the merger's output is not trivial
    torch.testing.assert_close(pooled[0], theirs.pooler_output, atol=1e-5, rtol=1e-5)


def test_two_images_in_one_call_match_their_packed_call(saved):
    directory, model = saved
    tower = load_tower(directory).eval()
    generator = torch.Generator().manual_seed(4)
    images = [torch.randn(3, *size, generator=generator) for size in SIZES]
    with torch.no_grad():
        packed = tower.encoder(images, output_hidden_states=True)
        pooled = tower(images)
    theirs = their_outputs(model, images)
    order = packed_order(packed.grids)
    for ours_state, their_state in zip([*packed.hidden_states, packed.tokens], theirs.states,
                                       strict=True):
        torch.testing.assert_close(ours_state[order], their_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(pooled), theirs.pooler_output, atol=1e-5, rtol=1e-5)


def test_a_qkv_bias_reads_too(tmp_path):
    directory, model = save_glm4v(tmp_path, attention_bias=True)
    ours = load_encoder(directory).eval()
    assert ours.config.qkv_bias
    image = torch.randn(3, 16, 40, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = ours(image[None])
    torch.testing.assert_close(out.tokens[0, merge_window_order(out.grid, MERGE)],
                               their_outputs(model, [image]).states[-1], atol=1e-5, rtol=1e-5)


def test_the_architecture_read(saved):
    directory, _ = saved
    config = load_encoder(directory).config
    assert (config.pos_embed, config.pos_resize_mode) == ("learned", "bicubic_grid_sample")
    assert (config.image_size, config.rope_theta, config.rope_frequencies) == \
        ((SIDE * P, SIDE * P), 10000.0, "shared")
    assert (config.norm, config.mlp, config.act, config.norm_eps) == \
        ("rmsnorm", "swiglu", "silu", 1e-5)
    assert (config.mlp_width, config.qkv_bias) == (TINY["out_hidden_size"], False)
    assert config.patch_bias and config.patch_norm and config.temporal_patch_size == T
    assert config.final_norm and not config.class_token
    tower = load_tower(directory)
    assert tower.pooler.pooler_spec["options"] == {"merge_size": MERGE, "hidden_dim": 48}
    assert tower.pooler.out_dim == TINY["out_hidden_size"]
    processor = tower.processor
    assert (processor.patch_multiple, processor.mean) == (P * MERGE, (0.48145466, 0.4578275,
                                                                      0.40821073))
    assert (processor.min_output_pixels, processor.max_output_pixels) == (6272, 5_880_000)


def test_a_whole_glm4v_model_reads_as_its_vision_tower(saved, tmp_path):
    from transformers.models.glm4v.configuration_glm4v import Glm4vConfig
    from transformers.models.glm4v.modeling_glm4v import Glm4vForConditionalGeneration

    config = Glm4vConfig(
        vision_config=TINY,
        text_config=dict(vocab_size=64, hidden_size=40, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 5],
                                          "partial_rotary_factor": 1.0}))
    whole = Glm4vForConditionalGeneration(config)
    whole.model.visual.load_state_dict(saved[1].state_dict())
    whole.save_pretrained(tmp_path)
    assert detect_format(read_checkpoint(tmp_path)).name == "hf_glm4v"
    image = torch.randn(3, 16, 40, generator=torch.Generator().manual_seed(6))
    theirs, tower = their_outputs(saved[1], [image]), load_tower(tmp_path)
    with torch.no_grad():
        out = tower.encoder.eval()(image[None])
        pooled = tower.pooler(out.tokens, num_prefix_tokens=0, grid=out.grid)
    torch.testing.assert_close(out.tokens[0, merge_window_order(out.grid, MERGE)],
                               theirs.states[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled[0], theirs.pooler_output, atol=1e-5, rtol=1e-5)


def written(saved, destination):
    """Our load of `saved`, written back by our writer; transformers' strict load of it."""
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

    tower = load_tower(saved[0])
    FORMATS.get("hf_glm4v").write(tower.encoder, destination, pooler=tower.pooler,
                                  processor=tower.processor)
    again, info = Glm4vVisionModel.from_pretrained(destination, output_loading_info=True)
    assert all(not keys for keys in info.values()), info
    return tower, again.eval()


def test_written_back_transformers_loads_it_strictly(saved, tmp_path):
    tower, again = written(saved, tmp_path / "written")
    preprocessor = json.loads((tmp_path / "written" / "preprocessor_config.json").read_text())
    assert preprocessor["image_processor_type"] == "Glm4vImageProcessor"
    assert preprocessor["size"] == {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 15000}
    assert (preprocessor["patch_size"], preprocessor["merge_size"]) == (P, MERGE)
    for size in SIZES:
        image = torch.randn(3, *size, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            out = tower.encoder.eval()(image[None])
            pooled = tower.pooler(out.tokens, num_prefix_tokens=0, grid=out.grid)
        theirs = their_outputs(again, [image])
        torch.testing.assert_close(theirs.states[-1],
                                   out.tokens[0, merge_window_order(out.grid, MERGE)],
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(theirs.pooler_output, pooled[0], atol=1e-5, rtol=1e-5)


def test_the_writer_refuses_what_glm4v_cannot_hold_by_name(saved, tmp_path):
    glm4v = FORMATS.get("hf_glm4v")
    plain = VisionEncoder(EncoderConfig(image_size=32, patch_size=8, width=32, depth=1,
                                        heads=4, mlp_width=64))
    merger = build_pooler("conv_merger", in_dim=32, out_dim=40)
    with pytest.raises(ValueError, match=r"GLM-4V .*temporal_patch_size=None.*rope_theta=None"
                                         r".*patch_norm=False.*pos_resize_mode='bicubic'"
                                         r".*norm='layernorm'.*mlp='mlp'"):
        glm4v.write(plain, tmp_path / "out", pooler=merger)
    oblong = load_encoder(saved[0])
    oblong.resize_image((SIDE * P, 2 * SIDE * P))
    with pytest.raises(ValueError, match=r"position table is a square grid, this one 6x12"):
        glm4v.write(oblong, tmp_path / "out", pooler=merger)
    ours = load_encoder(saved[0])
    with pytest.raises(ValueError, match="always ends in its downsample and merger"):
        glm4v.write(ours, tmp_path / "out")
    with pytest.raises(ValueError, match="not 'patch_merger'"):
        glm4v.write(ours, tmp_path / "out",
                    pooler=build_pooler("patch_merger", in_dim=32, out_dim=40))
    with pytest.raises(ValueError, match=r"conv_merger in_dim 32 and out_dim 48"):
        glm4v.write(ours, tmp_path / "out",
                    pooler=build_pooler("conv_merger", in_dim=32, out_dim=48))
    with torch.no_grad():
        ours.blocks[1].attn.proj.bias[0] = 0.5
    with pytest.raises(ValueError, match=r"blocks.1.attn.proj.bias is not zero"):
        glm4v.write(ours, tmp_path / "out", pooler=merger)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hidden_size", 0, "hidden_size"),
    ("depth", 10**9, "depth"),
    ("num_heads", 3, "width 32 is not divisible by heads 3"),
    ("out_hidden_size", 10**9, "out_hidden_size"),
    ("intermediate_size", 10**9, "intermediate_size"),
    ("intermediate_size", 64, "intermediate_size 64 and out_hidden_size 40, but the merger's"),
    ("image_size", 10**12, "image_size"),
    ("image_size", [24, 24], "image_size"),
    ("patch_size", 48, "image_size"),
    ("spatial_merge_size", 0, "spatial_merge_size"),
    ("rms_norm_eps", -1, "rms_norm_eps"),
    ("attention_bias", "yes", "attention_bias"),
    ("head_dim", 4, "head_dim 4 is not hidden_size 32 / num_heads 4"),
    ("hidden_act", "gelu", "act"),
    ("hidden_act", "relu", "hidden_act 'relu'"),
    ("rope_parameters", {"rope_type": "default"}, "is not axial 2D RoPE"),
])
def test_hostile_configs_are_refused_before_a_model_is_built(tmp_path, monkeypatch, key, value,
                                                             named):
    folder, _ = save_glm4v(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    assert_refused_before_building(folder, monkeypatch, named)
