"""`vlm-vit llm merge --out` (issue 40): never inside MODEL, never a user's own folder, never
through a link; MODEL and the folder are left as they were."""

import pytest
from test_llm_merge import lora_model, one_error_line  # noqa: F401 (a fixture)

from vlm_vit.cli import main


def snapshot(folder):
    return {path.relative_to(folder): path.read_bytes()
            for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("case", ["inside MODEL", "user folder", "link"])
def test_merge_refuses_an_output_it_would_destroy(lora_model, tmp_path, capsys, case):  # noqa: F811
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "labels.json").write_text("[]")
    (tmp_path / "link").symlink_to(mine)
    out, expected = {
        "inside MODEL": (lora_model / "tower", "is inside the model folder"),
        "user folder": (mine, "holds files but no model"),
        "link": (tmp_path / "link", "is a symbolic link"),
    }[case]
    model_before, mine_before = snapshot(lora_model), snapshot(mine)
    assert main(["llm", "merge", str(lora_model), "--out", str(out)]) == 1
    assert expected in one_error_line(capsys)
    assert snapshot(lora_model) == model_before and snapshot(mine) == mine_before
