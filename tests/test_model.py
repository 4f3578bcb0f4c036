import pytest
import torch
import torch.nn.functional as F

from vlm_vit import VisionEncoder, load_encoder
from vlm_vit.layers import resample_pos_embed

from .conftest import tiny_config


def images(batch=2, height=32, width=32, seed=1):
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


def test_patch_embedding_is_a_linear_map_of_flattened_patches(tiny_encoder):
    x = images()
    embedded, grid = tiny_encoder.patch_embed(x)
    p = tiny_encoder.config.patch_size
    # (B, C, rows, P, cols, P) -> (B, rows * cols, C * P * P), channel-major like the kernel
    patches = x.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(2, -1, 3 * p * p)
    weight = tiny_encoder.patch_embed.proj.weight.reshape(tiny_encoder.config.width, -1)
    expected = patches @ weight.T + tiny_encoder.patch_embed.proj.bias
    assert grid == (4, 4)
    torch.testing.assert_close(embedded, expected, atol=1e-5, rtol=1e-5)


def test_output_shapes_and_tokens_are_final_norm_of_last_hidden_state(tiny_encoder):
    out = tiny_encoder(images(), output_hidden_states=True)
    assert out.tokens.shape == (2, 17, 32) and out.patch_tokens.shape == (2, 16, 32)
    assert out.num_prefix_tokens == 1 and out.grid == (4, 4)
    assert len(out.hidden_states) == tiny_encoder.config.depth + 1
    torch.testing.assert_close(out.tokens, tiny_encoder.norm(out.hidden_states[-1]))
    torch.testing.assert_close(out.cls_token, out.tokens[:, 0])
    torch.testing.assert_close(out.patch_tokens, out.tokens[:, 1:])


def test_hidden_states_semantics(tiny_encoder):
    x = images()
    out = tiny_encoder(x, output_hidden_states=True)
    embeddings, _ = tiny_encoder.prepare_tokens(x)
    torch.testing.assert_close(out.hidden_states[0], embeddings)
    for index, block in enumerate(tiny_encoder.blocks, start=1):
        torch.testing.assert_close(out.hidden_states[index], block(out.hidden_states[index - 1])[0])


def test_hidden_state_zero_is_after_the_pre_norm():
    torch.manual_seed(0)
    model = VisionEncoder(tiny_config(pre_norm=True)).eval()
    x = images()
    out = model(x, output_hidden_states=True)
    torch.testing.assert_close(out.hidden_states[0], model.norm_pre(model.prepare_tokens(x)[0]))


def test_feature_layer_minus_two_runs_no_later_block(tiny_encoder):
    x = images()
    reference = tiny_encoder(x, output_hidden_states=True).hidden_states[-2]
    calls = []
    handles = [block.register_forward_hook(lambda m, i, o, n=n: calls.append(n))
               for n, block in enumerate(tiny_encoder.blocks)]
    out = tiny_encoder(x, feature_layers=[-2])
    for handle in handles:
        handle.remove()
    assert calls == [0, 1]  # block 2, the last, never ran
    assert torch.equal(out.features[0], reference)
    assert out.tokens is None and out.hidden_states is None


def test_feature_layers_in_the_order_asked(tiny_encoder):
    x = images()
    hidden = tiny_encoder(x, output_hidden_states=True).hidden_states
    out = tiny_encoder(x, feature_layers=[-1, 0, 2])
    assert [torch.equal(f, hidden[i])
            for f, i in zip(out.features, [-1, 0, 2], strict=True)] == [True] * 3
    assert out.tokens is not None  # the last layer was asked, so the run was complete


@pytest.mark.parametrize("layers", [[4], [-5]])
def test_feature_layer_out_of_range(tiny_encoder, layers):
    with pytest.raises(ValueError, match=f"feature layer {layers[0]} is out of range"):
        tiny_encoder(images(), feature_layers=layers)


def test_sdpa_equals_explicit_attention(tiny_encoder):
    x = images(height=40, width=24)
    fast = tiny_encoder(x, output_hidden_states=True)
    explicit = tiny_encoder(x, output_hidden_states=True, output_attentions=True)
    for a, b in zip(fast.hidden_states, explicit.hidden_states, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    maps = explicit.attentions
    assert len(maps) == 3 and maps[0].shape == (2, 4, 16, 16)
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(2, 4, 16))  # 5 x 3 patches + class


def test_resampling_to_the_same_grid_is_the_identity(tiny_encoder):
    table = tiny_encoder.pos_embed
    assert resample_pos_embed(table, (4, 4), (4, 4), num_prefix_tokens=1) is table
    assert tiny_encoder.position_table((4, 4)) is table


def test_non_square_grid_and_cached_table(tiny_encoder):
    with torch.no_grad():
        out = tiny_encoder(images(height=24, width=56))
        assert out.grid == (3, 7) and out.tokens.shape == (2, 22, 32)
        first = tiny_encoder.position_table((3, 7))
        assert tiny_encoder.position_table((3, 7)) is first  # cached per grid
        tiny_encoder.pos_embed.mul_(2.0)  # an in-place update invalidates the cache
        assert tiny_encoder.position_table((3, 7)) is not first


def test_resized_table_gets_gradients_when_training():
    model = VisionEncoder(tiny_config()).train()
    model(images(height=48, width=40)).tokens.sum().backward()
    assert model.pos_embed.grad is not None and model.pos_embed.grad.abs().sum() > 0


def test_resize_keeps_class_position_and_matches_interpolate():
    table = torch.randn(1, 1 + 4 * 4, 8)
    resized = resample_pos_embed(table, (4, 4), (6, 2), num_prefix_tokens=1)
    assert torch.equal(resized[:, :1], table[:, :1])
    grid = table[:, 1:].reshape(1, 4, 4, 8).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(6, 2), mode="bicubic", antialias=True)
    torch.testing.assert_close(resized[:, 1:], expected.permute(0, 2, 3, 1).reshape(1, 12, 8))


@pytest.mark.parametrize("shape, message", [
    ((2, 3, 30, 32), "30x32 is not a positive multiple of patch size 8"),
    ((2, 3, 32, 33), "32x33 is not a positive multiple of patch size 8"),
    ((3, 32, 32), r"pixel_values must be \[B, 3, H, W\]"),
    ((2, 1, 32, 32), r"pixel_values must be \[B, 3, H, W\]"),
])
def test_clear_errors_for_bad_pixels(tiny_encoder, shape, message):
    with pytest.raises(ValueError, match=message):
        tiny_encoder(torch.zeros(shape))


def test_no_class_token_and_registers():
    torch.manual_seed(0)
    model = VisionEncoder(tiny_config(class_token=False, num_register_tokens=2)).eval()
    out = model(images())
    assert out.cls_token is None and out.num_prefix_tokens == 2
    assert out.tokens.shape == (2, 18, 32) and out.patch_tokens.shape == (2, 16, 32)
    assert model.pos_embed.shape == (1, 16, 32)  # registers carry no position


def test_save_load_round_trip_is_bit_exact(tmp_path, tiny_encoder):
    tiny_encoder.save_pretrained(tmp_path / "enc")
    loaded = load_encoder(tmp_path / "enc").eval()
    assert loaded.config == tiny_encoder.config
    for name, tensor in tiny_encoder.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    x = images()
    assert torch.equal(loaded(x).tokens, tiny_encoder(x).tokens)
    assert sorted(p.name for p in (tmp_path / "enc").iterdir()) == [
        "README.md", "config.json", "manifest.json", "model.safetensors"]  # no temporary file


def test_load_with_new_image_size_resizes_the_table(tmp_path, tiny_encoder):
    tiny_encoder.save_pretrained(tmp_path)
    loaded = load_encoder(tmp_path, image_size=(48, 32))
    assert loaded.config.image_size == (48, 32) and loaded.pos_embed.shape == (1, 25, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.pos_embed, tiny_encoder.position_table((6, 4)))


def test_loading_errors_name_the_file(tmp_path, tiny_encoder):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_encoder(tmp_path / "nowhere")
    tiny_encoder.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="model.safetensors does not match its manifest"):
        load_encoder(tmp_path)
    with pytest.raises(ValueError, match="model.safetensors is too short|not a readable"):
        load_encoder(tmp_path, verify=False)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_encoder(tmp_path)


def test_mismatched_weights_are_all_listed(tmp_path, tiny_encoder):
    from vlm_vit.io.files import write_safetensors

    tiny_encoder.save_pretrained(tmp_path)
    state = dict(tiny_encoder.state_dict())
    state.pop("norm.weight")
    state["extra.weight"] = torch.zeros(1)
    # (a position table of the wrong length is refused earlier, against the config: see
    # tests/test_config_validation.py)
    state["blocks.0.attn.proj.bias"] = torch.zeros(5)
    write_safetensors(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as error:
        load_encoder(tmp_path, verify=False)  # the weights were changed on purpose
    message = str(error.value)
    assert "missing: norm.weight" in message and "unexpected: extra.weight" in message
    assert "blocks.0.attn.proj.bias (checkpoint [5], model [32])" in message


@pytest.mark.parametrize("mode, antialias", [("bilinear", True), ("bicubic", False)])
def test_resize_method_is_selectable(mode, antialias):
    model = VisionEncoder(tiny_config(pos_resize_mode=mode, pos_resize_antialias=antialias))
    with torch.no_grad():
        table = model.position_table((2, 3))  # shrinking, where antialias matters
        patches = model.pos_embed[:, 1:].reshape(1, 4, 4, 32).permute(0, 3, 1, 2)
        expected = F.interpolate(patches, size=(2, 3), mode=mode, antialias=antialias)
    torch.testing.assert_close(table[:, 1:], expected.permute(0, 2, 3, 1).reshape(1, 6, 32))


def test_token_count_follows_the_grid_for_any_size():
    hypothesis = pytest.importorskip("hypothesis")
    strategies = hypothesis.strategies
    model = VisionEncoder(tiny_config(num_register_tokens=1)).eval()

    @hypothesis.given(rows=strategies.integers(1, 7), cols=strategies.integers(1, 7),
                      batch=strategies.integers(1, 3))
    @hypothesis.settings(max_examples=25, deadline=None)
    def check(rows, cols, batch):
        with torch.no_grad():
            out = model(torch.zeros(batch, 3, 8 * rows, 8 * cols), feature_layers=[1])
        assert out.grid == (rows, cols)
        assert out.features[0].shape == (batch, 2 + rows * cols, 32)

    check()


def test_gradient_checkpointing_gives_the_same_gradients(tiny_encoder):
    x = images()
    tiny_encoder.train()
    tiny_encoder(x).tokens.square().sum().backward()
    plain = {n: p.grad.clone() for n, p in tiny_encoder.named_parameters()}
    tiny_encoder.zero_grad()
    tiny_encoder.gradient_checkpointing = True
    tiny_encoder(x).tokens.square().sum().backward()
    for name, param in tiny_encoder.named_parameters():
        torch.testing.assert_close(param.grad, plain[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(mask=torch.zeros(2, 15, dtype=torch.bool)), r"mask must be a bool tensor \[2, 16\]"),
    (dict(mask=torch.zeros(2, 16, dtype=torch.bool)), "needs a mask_token of width 32"),
    (dict(keep=torch.tensor([[0, 16], [1, 2]])), r"keep values must lie in \[0, 16\)"),
    (dict(source_index=torch.zeros(2, 16)), "source_index must be an integer tensor"),
])
def test_masking_arguments_are_checked(tiny_encoder, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_encoder(images(), **kwargs)


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_forward_hooks_on_attn_and_mlp_keep_what_they_saw(tiny_encoder, no_grad):
    """The residual adds write into neither sublayer's output: a hook's kept tensors equal
    a fresh recomputation from the hidden states after the forward."""
    kept: dict[tuple[int, str], torch.Tensor] = {}

    def keep(index, name):
        def hook(module, inputs, output):
            kept[index, name] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [getattr(block, name).register_forward_hook(keep(index, name))
               for index, block in enumerate(tiny_encoder.blocks) for name in ("attn", "mlp")]
    try:
        with no_grad():
            hidden = tiny_encoder(images(), output_hidden_states=True).hidden_states
            for index, block in enumerate(tiny_encoder.blocks):
                attended = block.attn(block.norm1(hidden[index]))[0]
                middle = hidden[index] + block.ls1(attended)
                torch.testing.assert_close(kept[index, "attn"], attended, rtol=0, atol=0)
                torch.testing.assert_close(kept[index, "mlp"], block.mlp(block.norm2(middle)),
                                           rtol=0, atol=0)
    finally:
        for handle in handles:
            handle.remove()
