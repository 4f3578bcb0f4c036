"""The plugin takes model names where it takes folders: `--tower`, `--llm`, MODEL and
`MultimodalLM.from_pretrained`, from a Hugging Face cache, offline; and its saved models
carry a model card."""

import torch
from conftest import photos
from test_llm_cli import train_args

from vlm_vit.cli import main
from vlm_vit.testing import offline_hub_cache, put_in_hub_cache
from vlm_vit_llm import MultimodalLM


def test_train_generate_and_load_by_name(parts, tmp_path, monkeypatch, capsys):  # noqa: F811
    cache = offline_hub_cache(tmp_path / "hf_home", monkeypatch)
    put_in_hub_cache(cache, "org/tiny-clip", parts / "encoder")
    put_in_hub_cache(cache, "org/tiny-llm", parts / "llm")
    assert main(train_args(parts, "--tower", "org/tiny-clip", "--llm", "org/tiny-llm",
                           "--out", str(parts / "s1"))) == 0
    saved = parts / "s1" / "model"
    card = (saved / "README.md").read_text()
    assert 'library_name: "vlm-vit"' in card and "MultimodalLM.from_pretrained" in card
    put_in_hub_cache(cache, "me/tiny-llava", saved)
    capsys.readouterr()
    assert main(["llm", "generate", "me/tiny-llava", "--image", str(parts / "data" / "0.png"),
                 "--max-new-tokens", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1

    by_name = MultimodalLM.from_pretrained("me/tiny-llava").eval()
    by_path = MultimodalLM.from_pretrained(saved).eval()
    image = photos(1)
    with torch.no_grad():
        assert torch.equal(by_name(["<image> a"], [image]).logits,
                           by_path(["<image> a"], [image]).logits)
    capsys.readouterr()
    assert main(["llm", "generate", "me/missing", "--image", str(parts / "data" / "0.png")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MODEL: me/missing is not a local path" in err[0]
