"""The bridge's inputs (issue 19, section 6): a malformed prompt, token id, batch or image list
is a ValueError naming the argument and the shape expected, never an error from deep inside
the LLM; a pickled weight file under `vlm-vit llm` is one line, exit 1."""

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE
from safetensors.torch import load_file

from vlm_vit.cli import main


def image():
    return np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)


@pytest.mark.parametrize("call", ["forward", "generate"])
def test_an_empty_prompt_names_it(mm, call):
    # this tokenizer adds no BOS to an empty text: nothing to condition on
    run = mm.generate if call == "generate" else mm
    with pytest.raises(ValueError, match=r"texts\[1\] is empty"):
        run(["a red square", ""])
    with pytest.raises(ValueError, match=r"texts\[0\] is empty"):
        mm([[]])


def test_an_empty_prompt_with_a_target_is_a_sequence(mm):
    assert mm([""], targets=["a red square"]).logits.shape[0] == 1


def test_a_token_id_past_the_vocabulary_names_it(mm):
    rows = mm.llm.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=rf"texts\[0\]\[1\] is token id {rows}, outside the "
                                         rf"vocabulary 0\.\.{rows - 1}"):
        mm([[1, rows]])
    with pytest.raises(ValueError, match=r"texts\[0\]\[0\] is token id -3"):
        mm([[-3, 5]])
    with pytest.raises(ValueError, match=r"texts\[0\]\[1\] is 2\.5, not a token id"):
        mm([[1, 2.5]])
    with pytest.raises(ValueError, match=rf"targets\[0\]\[0\] is token id {rows + 5}"):
        mm(["a red square"], targets=[[rows + 5]])
    ids = mm.tokenizer("a red square")["input_ids"]
    with pytest.raises(ValueError, match=rf"token_labels\[0\]\[0\] is token id {rows}"):
        mm([ids], token_labels=[[rows] + [-100] * (len(ids) - 1)])


def test_token_ids_as_a_tensor_are_read(mm):
    ids = mm.tokenizer("a red square")["input_ids"]
    torch.testing.assert_close(mm([torch.tensor(ids)]).logits, mm([ids]).logits)


def test_an_empty_batch_names_texts(mm):
    for run in (mm, mm.generate, mm.prepare):
        with pytest.raises(ValueError, match=r"texts is empty: give one prompt or more"):
            run([])


@pytest.mark.parametrize("images", [
    [image()],  # one array, not a list of the prompt's images
    [torch.zeros(3, IMAGE_SIZE, IMAGE_SIZE)],
    ["photo.png"],
])
def test_images_not_nested_per_prompt_name_the_entry(mm, images):
    with pytest.raises(ValueError, match=r"images\[0\] is a \w+, not a list of that prompt's "
                                         r"images: images takes one list per prompt"):
        mm(["<image> what is in the image"], images)


def test_images_not_a_list_at_all_is_named(mm):
    with pytest.raises(ValueError, match=r"images must be a list with one list of images per "
                                         r"prompt, got a ndarray"):
        mm(["<image> what is in the image"], image())


def test_nested_images_still_work(mm):
    assert mm(["<image> what is in the image", "a"], [[image()], None]).logits.shape[0] == 2


# -- the command line --------------------------------------------------------------------------


def pickled(folder, name, weights):
    """Replaces `folder`'s safetensors weights by a pickle that needs code to load."""
    tensors = load_file(folder / weights)
    (folder / weights).unlink()
    # A folder with no manifest (as another tool writes it): the pickle itself is refused.
    (folder / "manifest.json").unlink(missing_ok=True)
    torch.save({**tensors, "call": print}, folder / name)


@pytest.mark.parametrize("part, weights, name", [
    ("llm", "model.safetensors", "pytorch_model.bin"),
    ("llm_adapter", "adapter_model.safetensors", "adapter_model.bin"),
])
def test_generate_refuses_a_pickled_weight_file_in_one_line(mm, tmp_path, capsys, part,
                                                            weights, name):
    if part == "llm_adapter":
        mm.add_lora(r=2)
    saved = mm.save_pretrained(tmp_path / "model")
    pickled(saved / part, name, weights)
    capsys.readouterr()
    assert main(["llm", "generate", str(saved), "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("vlm-vit ")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert f"{part}/{name} is a pickle that needs arbitrary code" in lines[0]
