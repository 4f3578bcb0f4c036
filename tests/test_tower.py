import pytest
import torch

from vlm_vit import VisionEncoder, VisionTower, available_poolers, build_pooler, load_encoder

from .conftest import tiny_config

ENCODERS = {
    "class-token": dict(),
    "no-class-token": dict(class_token=False),
    "class-and-registers": dict(num_register_tokens=3),
    "registers-only": dict(class_token=False, num_register_tokens=2),
}


OUT_DIM = 24  # what every pooler with weights is asked to return


def expected_width(name, feature_layer=None):
    """The width pooler `name` returns in `tower_for`: OUT_DIM, or the features' width for a
    pooler without weights (which refuses an out_dim, saying so)."""
    layers = len(feature_layer) if isinstance(feature_layer, list) else 1
    try:
        build_pooler(name, in_dim=32 * layers, out_dim=OUT_DIM)
    except ValueError as error:
        if "has no weights" not in str(error):  # a real construction error: not masked
            raise
        return 32 * layers
    return OUT_DIM


def tower_for(name, encoder_options, feature_layer=None):
    torch.manual_seed(0)
    encoder = VisionEncoder(tiny_config(**encoder_options)).eval()
    layers = len(feature_layer) if isinstance(feature_layer, list) else 1
    width = expected_width(name, feature_layer)
    pooler = build_pooler(name, in_dim=32 * layers,
                          **({"out_dim": width} if width == OUT_DIM else {}))
    needs_class = getattr(pooler, "requires_class_token", False)
    return VisionTower(encoder, pooler, feature_layer=feature_layer,
                       keep_prefix=needs_class).eval()


def scaled(size, tower):
    """`size` times the grid multiple the pooler needs (the patch merger's 2x2 windows)."""
    multiple = getattr(tower.pooler, "grid_multiple", 1)
    return (size[0] * multiple, size[1] * multiple)


@pytest.mark.parametrize("name", available_poolers())
@pytest.mark.parametrize("encoder", sorted(ENCODERS))
@pytest.mark.parametrize("size", [(32, 32), (24, 40)])
def test_token_count_equals_the_tensor(name, encoder, size):
    if not ENCODERS[encoder].get("class_token", True):
        try:
            tower = tower_for(name, ENCODERS[encoder])
        except ValueError as error:  # poolers that read the class token refuse at once
            assert "encoder has none" in str(error)
            return
    tower = tower_for(name, ENCODERS[encoder])
    size = scaled(size, tower)
    with torch.no_grad():
        out = tower(torch.randn(2, 3, *size))
    count = tower.num_image_tokens(size)
    width = expected_width(name)
    assert out.shape == ((2, width) if count is None else (2, count, width))


@pytest.mark.parametrize("name", available_poolers())
@pytest.mark.parametrize("encoder", sorted(ENCODERS))
@pytest.mark.parametrize("feature_layer", [None, [-2, -1]], ids=["final", "two-layers"])
def test_packed_images_pool_as_each_alone(name, encoder, feature_layer):
    try:
        tower = tower_for(name, ENCODERS[encoder], feature_layer=feature_layer)
    except ValueError as error:  # poolers that read the class token, on encoders without one
        assert "encoder has none" in str(error)
        return
    sizes = [scaled(size, tower) for size in [(32, 32), (24, 40), (48, 16), (8, 32)]]
    generator = torch.Generator().manual_seed(2)
    images = [torch.randn(3, h, w, generator=generator) for h, w in sizes]
    with torch.no_grad():
        packed = tower(images)
        assert isinstance(packed, list) and len(packed) == len(images)
        for image, size, out in zip(images, sizes, packed, strict=True):
            torch.testing.assert_close(out, tower(image[None])[0], atol=1e-5, rtol=1e-5)
            count = tower.num_image_tokens(size)
            assert out.shape[:-1] == (() if count is None else (count,))


def test_llava_selection_layer_minus_two_without_prefix():
    tower = tower_for("mlp2x_gelu", dict(num_register_tokens=1), feature_layer=-2)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        hidden = tower.encoder(x, output_hidden_states=True).hidden_states[-2]
        expected = tower.pooler(hidden[:, 2:], num_prefix_tokens=0, grid=(4, 4))
        out = tower(x)
    torch.testing.assert_close(out, expected)
    assert tower.num_image_tokens() == 16 and out.shape == (2, 16, 24)


def test_several_layers_are_concatenated_and_the_run_stops_early():
    tower = tower_for("all", {}, feature_layer=[1, -2])
    ran = []
    for index, block in enumerate(tower.encoder.blocks):
        block.register_forward_hook(lambda m, i, o, index=index: ran.append(index))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = tower(x)
    assert ran == [0, 1]  # layer -2 of 3 blocks is block 2's input: block 3 never runs
    assert tower.blocks_used == 2
    hidden = tower.encoder(x, output_hidden_states=True).hidden_states
    torch.testing.assert_close(out, torch.cat([hidden[1], hidden[2]], dim=-1)[:, 1:])
    assert tower.feature_dim == 64


def test_cls_needs_a_class_token_and_the_prefix():
    encoder = VisionEncoder(tiny_config(class_token=False))
    with pytest.raises(ValueError, match="encoder has none"):
        VisionTower(encoder, build_pooler("cls", in_dim=32), keep_prefix=True)
    with pytest.raises(ValueError, match=r"drops \(keep_prefix=False\).*keep_prefix=True"):
        VisionTower(VisionEncoder(tiny_config()), build_pooler("cls", in_dim=32))


def test_width_mismatch_and_bad_layer_are_caught_at_construction():
    encoder = VisionEncoder(tiny_config())
    with pytest.raises(ValueError, match="takes width 32, but the tower gives 64"):
        VisionTower(encoder, build_pooler("mean", in_dim=32), feature_layer=[-1, -2])
    with pytest.raises(ValueError, match="feature layer 7 is out of range"):
        VisionTower(encoder, build_pooler("mean", in_dim=32), feature_layer=7)


def test_save_load_round_trip_is_bit_exact(tmp_path):
    tower = tower_for("perceiver", dict(num_register_tokens=1), feature_layer=[-2, -1])
    tower.save_pretrained(tmp_path)
    loaded = VisionTower.from_pretrained(tmp_path).eval()
    for name, tensor in tower.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    x = torch.randn(2, 3, 32, 40)
    with torch.no_grad():
        assert torch.equal(loaded(x), tower(x))
    assert (loaded.feature_layer, loaded.keep_prefix) == ([-2, -1], False)
    encoder = load_encoder(tmp_path)  # a tower directory still loads as an encoder
    assert torch.equal(encoder.pos_embed, tower.encoder.pos_embed)


def test_saving_needs_a_pooler_built_by_name(tmp_path):
    tower = VisionTower(VisionEncoder(tiny_config()), torch.nn.Identity())
    with pytest.raises(ValueError, match="not built by vlm_vit.build_pooler"):
        tower.save_pretrained(tmp_path)


def test_an_encoder_directory_is_not_a_tower(tmp_path):
    VisionEncoder(tiny_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no 'tower' section"):
        VisionTower.from_pretrained(tmp_path)


def test_a_tower_keeps_its_processor_and_load_processor_refuses_a_silent_none(tmp_path):
    from vlm_vit import ImageProcessor, load_processor, load_tower

    processor = ImageProcessor.for_family("clip", size=32)
    tower = tower_for("mean", {})
    tower.processor = processor
    tower.save_pretrained(tmp_path / "with")
    assert VisionTower.from_pretrained(tmp_path / "with").processor == processor
    assert load_processor(tmp_path / "with") == processor
    assert load_tower(tmp_path / "with").processor == processor

    tower_for("mean", {}).save_pretrained(tmp_path / "without")
    with pytest.raises(ValueError, match="records no preprocessing"):
        load_processor(tmp_path / "without")
    assert load_processor(tmp_path / "without", required=False) is None


def test_load_tower_carries_the_checkpoint_s_processor(tmp_path):
    from vlm_vit import ImageProcessor, load_tower

    torch.manual_seed(0)
    VisionEncoder(tiny_config()).save_pretrained(tmp_path / "encoder")
    processor = ImageProcessor.for_family("inception", size=32)
    processor.save_pretrained(tmp_path / "encoder")
    tower = load_tower(tmp_path / "encoder", "mean")
    assert tower.processor == processor
    tower.save_pretrained(tmp_path / "tower")
    assert VisionTower.from_pretrained(tmp_path / "tower").processor == processor
