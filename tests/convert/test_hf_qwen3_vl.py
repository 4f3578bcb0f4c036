"""Hugging Face `Qwen3VLVisionModel` directories (Qwen3-VL's vision tower: a learned square
table resized bilinearly with the corners aligned plus 2D RoPE, LayerNorm blocks with a tanh
GELU, Conv3d patches with a bias, a 2x2 merger, DeepStack mergers) load to the same function
as transformers' own model, fed the same pixels: every hidden state within 1e-5 (theirs in
merge-window order, ours row-major) and the merger's output, at the native size, at a
non-square one and on two images in one packed call; each DeepStack merger's output is our
hidden state after its block through a `merged_norm` `patch_merger` pooler. Written back,
transformers loads the directory strictly and computes our outputs. Hostile configs are
refused by name before a model is built."""

import json

import pytest
import torch

from vlm_vit import EncoderConfig, VisionEncoder, load_encoder, load_tower
from vlm_vit.config import ConfigError
from vlm_vit.convert import FORMATS, detect_format
from vlm_vit.convert.hf_qwen3_vl import deepstack_taps
from vlm_vit.io.loading import read_checkpoint
from vlm_vit.layers.rope_2d import merge_window_order
from vlm_vit.poolers import build_pooler
from vlm_vit.taps import TappedTower
from vlm_vit.testing import perturbed

from .refusals import assert_refused_before_building
from .test_hf_qwen2_vl import MERGE, P, T, flattened

transformers = pytest.importorskip("transformers")

SIDE = 6  # the table's side: 36 entries, image_size 24 pixels
TINY = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=40, num_heads=4,
            patch_size=P, temporal_patch_size=T, spatial_merge_size=MERGE,
            num_position_embeddings=SIDE * SIDE, deepstack_visual_indexes=[0, 2])
# the native 6x6 grid, then 4x10 patches: the table shrunk in rows, stretched in columns
SIZES = [(SIDE * P, SIDE * P), (16, 40)]


def save_qwen3_vl(folder, **options):
    """A tiny `Qwen3VLVisionModel`, every weight perturbed, saved by `save_pretrained`."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    torch.manual_seed(0)
    model = perturbed(Qwen3VLVisionModel(Qwen3VLVisionConfig(**{**TINY, **options})))
    model.save_pretrained(folder)
    return folder, model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


def their_outputs(model, images):
    """transformers' outputs for `[C, H, W]` images, each repeated over the temporal patch."""
    parts = [flattened(image[:, None].expand(-1, T, -1, -1)) for image in images]
    patches = torch.cat([p for p, _ in parts])
    grid_thw = torch.cat([g for _, g in parts])
    with torch.no_grad():
        return model(patches, grid_thw=grid_thw, output_hidden_states=True)


def packed_order(grids):
    """Their token i, image after image in merge-window order, is our packed token order[i]."""
    order, offset = [], 0
    for grid in grids:
        order.append(merge_window_order(grid, MERGE) + offset)
        offset += grid[0] * grid[1]
    return torch.cat(order)


@pytest.mark.parametrize("size", SIZES)
def test_every_hidden_state_and_the_merger_match_on_an_image(saved, size):
    directory, model = saved
    assert detect_format(read_checkpoint(directory)).name == "hf_qwen3_vl"
    tower = load_tower(directory)
    ours = tower.encoder.eval()
    image = torch.randn(3, *size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = ours(image[None], output_hidden_states=True)
        pooled = tower.pooler(out.tokens, num_prefix_tokens=0, grid=out.grid)
    theirs = their_outputs(model, [image])
    order = merge_window_order(out.grid, MERGE)
    assert len(out.hidden_states) == len(theirs.hidden_states) == TINY["depth"] + 1
    for ours_state, their_state in zip(out.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(ours_state[0, order], their_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.tokens[0, order], theirs.last_hidden_state,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled[0], theirs.pooler_output, atol=1e-5, rtol=1e-5)


def test_two_images_in_one_call_match_their_packed_call(saved):
    directory, model = saved
    ours = load_encoder(directory).eval()
    generator = torch.Generator().manual_seed(4)
    images = [torch.randn(3, *size, generator=generator) for size in SIZES]
    with torch.no_grad():
        packed = ours(images, output_hidden_states=True)
    theirs = their_outputs(model, images)
    order = packed_order(packed.grids)
    for ours_state, their_state in zip(packed.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(ours_state[order], their_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("size", SIZES)
def test_each_deepstack_merger_is_a_tap_on_our_hidden_state(saved, size):
    directory, model = saved
    ours = load_encoder(directory).eval()
    taps = deepstack_taps(read_checkpoint(directory))
    assert [layer for layer, _ in taps.values()] == [1, 3]  # after blocks 0 and 2
    image = torch.randn(3, *size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = ours(image[None], output_hidden_states=True)
        tapped = [pooler(out.hidden_states[layer], num_prefix_tokens=0, grid=out.grid)[0]
                  for layer, pooler in taps.values()]
    theirs = their_outputs(model, [image]).deepstack_features
    assert len(tapped) == len(theirs) == 2
    for mine, expected in zip(tapped, theirs, strict=True):
        torch.testing.assert_close(mine, expected, atol=1e-5, rtol=1e-5)


def test_a_tapped_tower_gives_the_merger_and_deepstack_from_one_packed_run(saved):
    """`TappedTower(load_tower(dir), deepstack_taps(...))` on two images of other sizes:
    the merger's tokens and each DeepStack merger's equal transformers', image by image."""
    directory, model = saved
    tapped = TappedTower(load_tower(directory).eval(), deepstack_taps(read_checkpoint(directory)))
    images = [torch.randn(3, *size, generator=torch.Generator().manual_seed(7))
              for size in SIZES]
    with torch.no_grad():
        out = tapped(images)
    theirs = their_outputs(model, images)
    counts = [len(tokens) for tokens in out.tokens]
    assert counts == [tapped.num_tap_tokens("deepstack_0", size) for size in SIZES]
    torch.testing.assert_close(torch.cat(out.tokens), theirs.pooler_output, atol=1e-5, rtol=1e-5)
    for name, expected in zip(tapped.taps, theirs.deepstack_features, strict=True):
        torch.testing.assert_close(torch.cat(out.taps[name]), expected, atol=1e-5, rtol=1e-5)


def test_the_architecture_read(saved):
    directory, _ = saved
    config = load_encoder(directory).config
    assert (config.pos_embed, config.pos_resize_mode, config.pos_resize_antialias) == \
        ("learned", "bilinear_corners", False)
    assert (config.image_size, config.rope_theta, config.rope_frequencies) == \
        ((SIDE * P, SIDE * P), 10000.0, "shared")
    assert (config.norm, config.mlp, config.act, config.norm_eps) == \
        ("layernorm", "mlp", "gelu_tanh", 1e-6)
    assert config.patch_bias and config.temporal_patch_size == T
    assert not config.class_token and not config.final_norm
    tower = load_tower(directory)
    assert tower.pooler.pooler_spec["options"] == {"merge_size": MERGE}
    assert tower.pooler.out_dim == TINY["out_hidden_size"]
    processor = tower.processor
    assert (processor.patch_multiple, processor.mean) == (P * MERGE, (0.5, 0.5, 0.5))


def test_a_whole_qwen3_vl_model_reads_as_its_vision_tower(saved, tmp_path):
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        vision_config=TINY,
        text_config=dict(vocab_size=64, hidden_size=40, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=20, rope_parameters={"rope_type": "default",
                                                       "rope_theta": 10000.0,
                                                       "mrope_section": [4, 3, 3]}))
    whole = Qwen3VLForConditionalGeneration(config)
    whole.model.visual.load_state_dict(saved[1].state_dict())
    whole.save_pretrained(tmp_path)
    image = torch.randn(3, 16, 40, generator=torch.Generator().manual_seed(6))
    theirs, tower = their_outputs(saved[1], [image]), load_tower(tmp_path)
    with torch.no_grad():
        out = tower.encoder.eval()(image[None])
        pooled = tower.pooler(out.tokens, num_prefix_tokens=0, grid=out.grid)
    torch.testing.assert_close(out.tokens[0, merge_window_order(out.grid, MERGE)],
                               theirs.last_hidden_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled[0], theirs.pooler_output, atol=1e-5, rtol=1e-5)


def written(saved, destination, **options):
    """Our load of `saved`, written back by our writer; transformers' strict load of it."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    tower = load_tower(saved[0])
    FORMATS.get("hf_qwen3_vl").write(tower.encoder, destination, pooler=tower.pooler,
                                     processor=tower.processor, **options)
    again, info = Qwen3VLVisionModel.from_pretrained(destination, output_loading_info=True)
    assert all(not keys for keys in info.values()), info
    return tower, again.eval()


def test_written_back_transformers_loads_it_strictly(saved, tmp_path):
    tower, again = written(saved, tmp_path / "written")
    assert again.config.deepstack_visual_indexes == []
    preprocessor = json.loads((tmp_path / "written" / "preprocessor_config.json").read_text())
    assert (preprocessor["patch_size"], preprocessor["image_mean"]) == (P, [0.5, 0.5, 0.5])
    for size in SIZES:
        image = torch.randn(3, *size, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            out = tower.encoder.eval()(image[None])
            pooled = tower.pooler(out.tokens, num_prefix_tokens=0, grid=out.grid)
        theirs = their_outputs(again, [image])
        torch.testing.assert_close(theirs.last_hidden_state,
                                   out.tokens[0, merge_window_order(out.grid, MERGE)],
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(theirs.pooler_output, pooled[0], atol=1e-5, rtol=1e-5)


def test_written_back_with_the_deepstack_taps(saved, tmp_path):
    taps = deepstack_taps(read_checkpoint(saved[0]))
    tower, again = written(saved, tmp_path / "written", deepstack=taps)
    assert again.config.deepstack_visual_indexes == [0, 2]
    image = torch.randn(3, 16, 40, generator=torch.Generator().manual_seed(8))
    theirs = their_outputs(again, [image]).deepstack_features
    with torch.no_grad():
        out = tower.encoder.eval()(image[None], output_hidden_states=True)
        for (layer, pooler), expected in zip(taps.values(), theirs, strict=True):
            mine = pooler(out.hidden_states[layer], num_prefix_tokens=0, grid=out.grid)[0]
            torch.testing.assert_close(expected, mine, atol=1e-5, rtol=1e-5)


def test_the_writer_refuses_what_qwen3_vl_cannot_hold_by_name(saved, tmp_path):
    qwen3 = FORMATS.get("hf_qwen3_vl")
    plain = VisionEncoder(EncoderConfig(image_size=32, patch_size=8, width=32, depth=1,
                                        heads=4, mlp_width=64))
    merger = build_pooler("patch_merger", in_dim=32, out_dim=40)
    with pytest.raises(ValueError, match=r"Qwen3-VL .*temporal_patch_size=None.*rope_theta=None"
                                         r".*pos_resize_mode='bicubic'"):
        qwen3.write(plain, tmp_path / "out", pooler=merger)
    oblong = load_encoder(saved[0])
    oblong.resize_image((SIDE * P, 2 * SIDE * P))
    with pytest.raises(ValueError, match=r"position table is a square grid, this one 6x12"):
        qwen3.write(oblong, tmp_path / "out", pooler=merger)
    ours = load_encoder(saved[0])
    with pytest.raises(ValueError, match="always ends in its merger"):
        qwen3.write(ours, tmp_path / "out")
    with pytest.raises(ValueError, match=r"DeepStack tap 'deepstack_0': Qwen3-VL norms the "
                                         r"concatenated window"):
        qwen3.write(ours, tmp_path / "out", pooler=merger, deepstack={"deepstack_0": (1, merger)})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hidden_size", 0, "hidden_size"),
    ("depth", 10**9, "depth"),
    ("num_heads", 3, "width 32 is not divisible by heads 3"),
    ("intermediate_size", 10**9, "intermediate_size"),
    ("num_position_embeddings", 35, "num_position_embeddings"),
    ("num_position_embeddings", 10**12, "num_position_embeddings"),
    ("spatial_merge_size", 0, "spatial_merge_size"),
    ("deepstack_visual_indexes", [0, 7], "deepstack_visual_indexes"),
    ("hidden_act", "relu", "hidden_act 'relu'"),
    ("rope_parameters", {"rope_type": "default"}, "is not axial 2D RoPE"),
])
def test_hostile_configs_are_refused_before_a_model_is_built(tmp_path, monkeypatch, key, value,
                                                             named):
    folder, _ = save_qwen3_vl(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    assert_refused_before_building(folder, monkeypatch, named)


def test_a_table_that_is_not_square_is_refused_by_name():
    from vlm_vit.convert.hf_qwen3_vl import encoder_config

    with pytest.raises(ConfigError, match=r"config.json: num_position_embeddings must be a "
                                          r"positive square int"):
        encoder_config({**TINY, "num_position_embeddings": 40})
