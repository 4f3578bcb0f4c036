"""Model names, offline: a Hugging Face cache laid out as huggingface_hub writes it, holding
tiny checkpoints saved by transformers, timm and open_clip, loads by name exactly as by path;
revisions pin snapshots; what is not cached fails clearly; shards stay inside the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vlm_vit import load_encoder, load_processor, load_tower
from vlm_vit.cli import main
from vlm_vit.config import EncoderConfig
from vlm_vit.io import hub
from vlm_vit.io.card import CARD_NAME
from vlm_vit.io.files import write_safetensors
from vlm_vit.io.weights import SHARD_INDEX, parse_size, read_sharded
from vlm_vit.model import VisionEncoder
from vlm_vit.testing import offline_hub_cache, perturbed, put_in_hub_cache

huggingface_hub = pytest.importorskip("huggingface_hub")
transformers = pytest.importorskip("transformers")

TINY_VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=64, image_size=32, patch_size=8)


def put_in_cache(cache: Path, repo_id: str, source: Path, revision: str = "main",
                 commit: str | None = None) -> Path:
    """`put_in_hub_cache`, checked against huggingface_hub's own reading of the layout."""
    snapshot = put_in_hub_cache(cache, repo_id, source, revision, commit)
    found = huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                              local_files_only=True)
    assert Path(found) == snapshot
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache in use, offline."""
    return offline_hub_cache(tmp_path / "hf_home", monkeypatch)



def save_clip(folder: Path, **options) -> Path:
    model = perturbed(transformers.CLIPVisionModel(
        transformers.CLIPVisionConfig(**{**TINY_VISION, **options})))
    model.save_pretrained(folder)
    transformers.CLIPImageProcessor(size={"shortest_edge": 32},
                                    crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def save_siglip(folder: Path) -> Path:
    perturbed(transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**TINY_VISION))
               ).save_pretrained(folder)
    return folder


def save_vit(folder: Path) -> Path:
    perturbed(transformers.ViTModel(transformers.ViTConfig(**TINY_VISION))
               ).save_pretrained(folder)
    return folder


def save_vit_mae(folder: Path) -> Path:
    perturbed(transformers.ViTMAEModel(transformers.ViTMAEConfig(**TINY_VISION))
               ).save_pretrained(folder)
    return folder


def save_timm(folder: Path) -> Path:
    """timm's own Hub layout (`save_for_hf`): config.json with the architecture and
    model_args, model.safetensors."""
    timm = pytest.importorskip("timm")
    from timm.models import _hub as timm_hub

    torch.manual_seed(0)  # create_model for the pretrained_cfg save_for_hf writes; no download
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                              patch_size=8, embed_dim=64, depth=2, num_heads=4,
                              num_classes=0).eval()
    timm_hub.save_for_hf(model, str(folder), model_args={"num_heads": 4, "img_size": [32, 32]},
                         safe_serialization=True)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    return folder


def save_open_clip(folder: Path) -> Path:
    """open_clip's Hub layout: open_clip_config.json and open_clip_model.safetensors."""
    model_module = pytest.importorskip("open_clip.model")
    vision_cfg = dict(layers=2, width=64, head_width=32, patch_size=8, image_size=32)
    text_cfg = dict(context_length=8, vocab_size=100, width=32, heads=2, layers=1)
    torch.manual_seed(0)
    model = model_module.CLIP(embed_dim=16, vision_cfg=model_module.CLIPVisionCfg(**vision_cfg),
                              text_cfg=model_module.CLIPTextCfg(**text_cfg), quick_gelu=True)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(perturbed(model).state_dict(), folder / "open_clip_model.safetensors")
    (folder / "open_clip_config.json").write_text(json.dumps({
        "model_cfg": {"embed_dim": 16, "quick_gelu": True, "vision_cfg": vision_cfg,
                      "text_cfg": text_cfg}, "preprocess_cfg": {}}))
    return folder


FAMILIES = {"hf-clip": ("openai/clip-tiny-patch8", save_clip),
            "hf-siglip": ("google/siglip-tiny", save_siglip),
            "hf-vit": ("google/vit-tiny", save_vit),
            "hf-vit-mae": ("facebook/vit-mae-tiny", save_vit_mae),
            "timm": ("timm/vit_tiny_patch8_32.test", save_timm),
            "open_clip": ("laion/open-clip-tiny", save_open_clip)}


def same_outputs(a: VisionEncoder, b: VisionEncoder) -> None:
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    assert a.config == b.config
    with torch.no_grad():
        assert torch.equal(a.eval()(x).tokens, b.eval()(x).tokens)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_name_loads_as_its_path_does(tmp_path, cache, family):
    repo_id, save = FAMILIES[family]
    source = save(tmp_path / family)
    snapshot = put_in_cache(cache, repo_id, source)
    for name in (repo_id, f"hf-hub:{repo_id}", f"{repo_id}@main"):
        same_outputs(load_encoder(name), load_encoder(snapshot))
    assert load_processor(repo_id) == load_processor(snapshot)
    tower, by_path = load_tower(repo_id), load_tower(snapshot)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(tower.eval()(x), by_path.eval()(x))


def test_a_pinned_revision_picks_its_snapshot(tmp_path, cache):
    old = put_in_cache(cache, "org/clip", save_clip(tmp_path / "v1"), revision="v1")
    new = put_in_cache(cache, "org/clip", save_clip(tmp_path / "main", hidden_act="gelu"))
    assert old != new
    assert load_encoder("org/clip").config.act == "gelu"
    assert load_encoder("org/clip@v1").config.act == "quick_gelu"
    assert load_encoder(f"org/clip@{old.name}").config.act == "quick_gelu"  # a commit
    assert hub.resolve("org/clip", revision="v1") == old


def test_a_name_that_is_not_cached_says_where_it_looked_and_how_to_fetch_it(cache):
    with pytest.raises(hub.NotCachedError) as caught:
        load_encoder("openai/clip-vit-large-patch14-336")
    message = str(caught.value)
    for part in ("openai/clip-vit-large-patch14-336 is not a local path", str(cache),
                 "HF_HUB_OFFLINE is set", "vlm-vit download openai/clip-vit-large-patch14-336",
                 "`hf download openai/clip-vit-large-patch14-336`"):
        assert part in message
    assert "huggingface-cli" not in message  # huggingface_hub 1.0 and later have `hf` only
    assert isinstance(caught.value, FileNotFoundError)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_encoder("/no/such/dir")  # a path, not a name


def test_open_clip_pairs_map_through_open_clip_s_table(tmp_path, cache):
    """`ViT-B-32/laion2b_s34b_b79k` is the Hub copy open_clip names, read with open_clip's
    weights even where the repository also holds a transformers model.safetensors."""
    pretrained = pytest.importorskip("open_clip.pretrained")
    repo = pretrained.get_pretrained_cfg("ViT-B-32", "laion2b_s34b_b79k")["hf_hub"].strip("/")
    source = save_open_clip(tmp_path / "pair")
    save_clip(tmp_path / "decoy")  # what transformers reads in the same repository
    for name in ("config.json", "model.safetensors"):
        (source / name).write_bytes((tmp_path / "decoy" / name).read_bytes())
    put_in_cache(cache, repo, source)
    assert hub.locate("ViT-B-32/laion2b_s34b_b79k").weight_files == hub.OPEN_CLIP_FILES
    encoder = load_encoder("ViT-B-32/laion2b_s34b_b79k")
    same_outputs(encoder, load_encoder(tmp_path / "pair" / "open_clip_model.safetensors",
                                       act="quick_gelu", heads=2))
    assert encoder.config.width == 64  # open_clip's, not the decoy CLIP's 32
    assert load_encoder(repo).config.width == 32  # the plain name: transformers' files


def test_a_variant_name_keeps_its_meaning_and_hf_hub_means_the_hub(tmp_path, cache, capsys):
    put_in_cache(cache, "vit-b/16", save_clip(tmp_path / "collide"))
    assert main(["info", "vit-b/16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["width"] == 768  # the variant
    assert main(["info", "hf-hub:vit-b/16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["width"] == 32  # the cached model


def test_commands_take_names(tmp_path, cache, capsys):
    from PIL import Image

    put_in_cache(cache, "org/clip", save_clip(tmp_path / "clip"))
    assert main(["download", "org/clip"]) == 0
    directory, fmt = capsys.readouterr().out.strip().split("\t")
    assert fmt == "hf_clip" and Path(directory).parent.parent.name == "models--org--clip"
    Image.new("RGB", (40, 32), (200, 10, 10)).save(tmp_path / "red.png")
    out = tmp_path / "tokens.safetensors"
    assert main(["encode", "org/clip", str(tmp_path / "red.png"), "-o", str(out),
                 "--quiet"]) == 0
    assert out.is_file()
    assert main(["convert", "org/clip", str(tmp_path / "native"), "--to", "native"]) == 0
    same_outputs(load_encoder(tmp_path / "native"), load_encoder("org/clip"))
    capsys.readouterr()
    assert main(["info", "org/missing"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "org/missing is not a local path" in err[0]


# -- shards -------------------------------------------------------------------------------


def tiny_encoder() -> VisionEncoder:
    torch.manual_seed(0)
    return VisionEncoder(EncoderConfig(image_size=32, patch_size=8, width=32, depth=3, heads=4,
                                       mlp_width=64))


def test_save_pretrained_shards_and_loads_back_bit_exactly(tmp_path):
    encoder = tiny_encoder()
    encoder.save_pretrained(tmp_path / "one")
    encoder.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "sharded" / "model.safetensors").exists()
    index = json.loads((tmp_path / "sharded" / SHARD_INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in encoder.state_dict().values())
    for loaded in (VisionEncoder.from_pretrained(tmp_path / "sharded"),
                   load_encoder(tmp_path / "sharded")):
        for name, tensor in encoder.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name
    # Saving again unsharded removes the shards and the index, and the other way round.
    encoder.save_pretrained(tmp_path / "sharded")
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == \
        sorted(p.name for p in (tmp_path / "one").iterdir())


def test_a_sharded_hf_clip_loads_in_transformers_and_by_name(tmp_path, cache, capsys):
    put_in_cache(cache, "org/clip", save_clip(tmp_path / "clip"))
    assert main(["convert", "org/clip", str(tmp_path / "out"), "--to", "hf-clip",
                 "--max-shard-size", "30KB"]) == 0
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    theirs = transformers.CLIPVisionModel.from_pretrained(tmp_path / "out").eval()
    original = transformers.CLIPVisionModel.from_pretrained(tmp_path / "clip").eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(theirs(x).last_hidden_state, original(x).last_hidden_state)
    put_in_cache(cache, "org/clip-sharded", tmp_path / "out")
    same_outputs(load_encoder("org/clip-sharded"), load_encoder("org/clip"))
    assert main(["convert", "org/clip", str(tmp_path / "t"), "--to", "timm",
                 "--max-shard-size", "1MB"]) == 1
    assert "timm is read from one weight file" in capsys.readouterr().err


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../x",
                                   "C:\\x.safetensors", ""])
def test_a_shard_outside_the_checkpoint_is_refused(tmp_path, shard):
    encoder = tiny_encoder()
    encoder.save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    write_safetensors(encoder.state_dict(), tmp_path / "outside.safetensors")
    index_path = tmp_path / "ckpt" / SHARD_INDEX
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="outside|must be a file name"):
        read_sharded(tmp_path / "ckpt")
    with pytest.raises(ValueError):
        load_encoder(tmp_path / "ckpt")


def test_an_index_naming_a_tensor_its_shard_lacks_is_refused(tmp_path):
    tiny_encoder().save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    index_path = tmp_path / "ckpt" / SHARD_INDEX
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost.weight"] = next(iter(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="does not hold them: ghost.weight"):
        read_sharded(tmp_path / "ckpt")


@pytest.mark.parametrize(("size", "expected"), [("5GB", 5 * 10**9), ("500MB", 5 * 10**8),
                                                ("2GiB", 2 * 2**30), (1234, 1234),
                                                ("1.5KB", 1500)])
def test_sizes_parse_as_transformers_spells_them(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["five", "5XB", 0, "-1MB"])
def test_bad_sizes_are_refused(size):
    with pytest.raises(ValueError, match="shard size"):
        parse_size(size)


# -- model cards and pushing -----------------------------------------------------------


def test_saved_models_carry_a_model_card_and_keep_the_user_s(tmp_path):
    import vlm_vit

    vlm_vit.VisionEncoder(EncoderConfig.from_name("vit-ti/16", image_size=32)).save_pretrained(
        tmp_path / "enc")
    card = (tmp_path / "enc" / CARD_NAME).read_text()
    header = card.split("---")[1]
    assert 'library_name: "vlm-vit"' in header and '- "vision-transformer"' in header
    assert "| variant | vit-ti/16 |" in card and "| image size | 32 x 32 |" in card
    assert 'vlm_vit.load_encoder("ORG/NAME")' in card
    tower = vlm_vit.VisionTower(tiny_encoder(), vlm_vit.build_pooler("mlp2x_gelu", in_dim=32,
                                                                     out_dim=48),
                                feature_layer=-2)
    (tmp_path / "tower").mkdir()
    (tmp_path / "tower" / CARD_NAME).write_text("my own card\n")
    tower.save_pretrained(tmp_path / "tower")
    assert (tmp_path / "tower" / CARD_NAME).read_text() == "my own card\n"
    tower.save_pretrained(tmp_path / "tower2")
    card = (tmp_path / "tower2" / CARD_NAME).read_text()
    assert "| pooler | mlp2x_gelu |" in card and "| feature layer | -2 |" in card


def test_push_to_hub_uploads_the_folder_and_names_the_repo_in_its_card(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(huggingface_hub, "create_repo",
                        lambda repo_id, **kwargs: calls.append(("create", repo_id, kwargs)))
    monkeypatch.setattr(huggingface_hub, "upload_folder",
                        lambda **kwargs: calls.append(("upload", kwargs)) or "https://x/commit")
    tiny_encoder().save_pretrained(tmp_path / "enc")
    assert hub.push_to_hub(tmp_path / "enc", "me/tiny", private=True) == "https://x/commit"
    assert calls[0] == ("create", "me/tiny", {"private": True, "exist_ok": True})
    assert calls[1][1]["repo_id"] == "me/tiny"
    assert calls[1][1]["folder_path"] == str(tmp_path / "enc")
    assert 'load_encoder("me/tiny")' in (tmp_path / "enc" / CARD_NAME).read_text()
    with pytest.raises(FileNotFoundError, match="not a saved vlm-vit model"):
        hub.push_to_hub(tmp_path, "me/nothing")


def test_a_snapshot_file_linked_outside_the_cache_is_refused(tmp_path, cache, capsys):
    """A link planted in `snapshots/<commit>/` that leads out of the repository's `blobs/`
    is never read as the model's weights (issue 26, 2)."""
    snapshot = put_in_cache(cache, "org/clip", save_clip(tmp_path / "clip"))
    weights = snapshot / "model.safetensors"
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(weights.read_bytes())
    weights.unlink()
    weights.symlink_to(outside)
    assert main(["info", "org/clip"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "outside its repository's blobs/" in err[-1]
    with pytest.raises(ValueError, match="model.safetensors in the Hugging Face cache"):
        load_encoder("org/clip")


def test_a_failed_download_does_not_advise_running_itself(cache, capsys):
    """Issue 27, 9: `vlm-vit download X` that cannot fetch X says why and what to change,
    not "run `vlm-vit download X`"."""
    assert main(["download", "org/missing", "--revision", "v2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "org/missing at revision 'v2' is not in the" in err[0]
    assert "unset HF_HUB_OFFLINE and run it again" in err[0]
    advice = err[0].split("vlm-vit download: error: ", 1)[1]
    assert "vlm-vit download" not in advice and "hf download" not in advice
