"""The README and the pages under docs/ tell the truth (issue 41): every relative link resolves
inside the repository (issue 27, 9), every Python code block runs, every `vlm-vit` line names
a command and flags that exist, every variant name is a variant, and the site builds with
`mkdocs build --strict` (a broken link, or a documented name without a docstring, fails).

A block that names a released model runs on a tiny stand-in: `EncoderConfig.from_name` builds
the variant with 2 blocks (random init), and each file or folder a block reads is made in the
block's working directory first (`FIXTURES`). A block that cannot run here is preceded by
`<!-- not run: REASON -->`.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "CHANGELOG.md", *REPO.glob("docs/*.md"),
                *REPO.glob("adapters/*/README.md")])
DOCS = [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))]  # the pages whose code runs
# A markdown link's target, or a path in backticks that climbs out of its folder.
LINK = re.compile(r"\]\(([^)\s#]+)[^)]*\)")
CLIMB = re.compile(r"`((?:\.\./)+[^`\s]*)`")
# A fenced block, with the line before it (where a `<!-- not run: ... -->` marker goes).
FENCE = re.compile(r"(?:^(?P<before>[^\n]*)\n)?^```(?P<lang>\w*)\n(?P<body>.*?)^```$",
                   re.M | re.S)
NOT_RUN = re.compile(r"<!-- not run: (?P<reason>\S.*?) -->")
MAX_SKIPPED = 4  # blocks marked not run, over every page: keep them few


def ids(page: Path) -> str:
    return str(page.relative_to(REPO))


def blocks(page: Path, languages: set[str]) -> list[tuple[str, str | None]]:
    """Each code block of `page` in one of `languages`: (its text, the not-run reason)."""
    found = []
    for match in FENCE.finditer(page.read_text()):
        if match["lang"] in languages:
            marker = NOT_RUN.search(match["before"] or "")
            found.append((match["body"], marker["reason"] if marker else None))
    return found


@pytest.mark.parametrize("page", PAGES, ids=ids)
def test_every_relative_reference_resolves_inside_the_repository(page):
    text = page.read_text()
    targets = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    for target in targets:
        resolved = (page.parent / target).resolve()
        assert resolved.is_relative_to(REPO), f"{page.name} links outside: {target}"
        assert resolved.exists(), f"{page.name} links a missing file: {target}"
    for target in CLIMB.findall(text):  # read from the page's folder or the repository's root
        for base in {page.parent, REPO}:
            assert (base / target).resolve().is_relative_to(REPO), \
                f"{page.name} names a path outside the repository: {target}"


# --- Python blocks --------------------------------------------------------------------------

def _image(path: Path, height: int, width: int) -> None:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(len(path.name)).integers(0, 256, (height, width, 3))
    Image.fromarray(pixels.astype("uint8")).save(path)


def _tiny_encoder(path: Path) -> None:
    import vlm_vit

    config = vlm_vit.EncoderConfig.from_name("clip-vit-b/16", depth=1, width=64, heads=2,
                                             mlp_width=128)
    vlm_vit.VisionEncoder(config).save_pretrained(path)


def _tiny_clip_checkpoint(path: Path) -> None:
    """A Hugging Face `CLIPModel` folder (vision tower, projection, processor), 1 block."""
    transformers = pytest.importorskip("transformers")
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=16)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision,
                                     projection_dim=32)
    transformers.CLIPModel(config).save_pretrained(path)
    transformers.CLIPImageProcessor(size={"shortest_edge": 32},
                                    crop_size={"height": 32, "width": 32}).save_pretrained(path)


# What a block reads, made in its working directory before the page runs: name -> maker.
FIXTURES = {
    "cat.jpg": lambda p: _image(p, 300, 400),
    "dog.png": lambda p: _image(p, 400, 300),
    "portrait.jpg": lambda p: _image(p, 280, 168),
    "panorama.jpg": lambda p: _image(p, 140, 448),
    "photo.jpg": lambda p: _image(p, 950, 1256),  # (950, 1256): the size the AnyRes block counts
    "clip-dir": _tiny_clip_checkpoint,
    "openai/clip-vit-large-patch14-336": _tiny_encoder,  # an existing path wins over a Hub name
}


@pytest.fixture
def tiny_variants(monkeypatch):
    """`EncoderConfig.from_name` builds every named variant with 2 blocks."""
    from vlm_vit.config import EncoderConfig

    original = EncoderConfig.from_name.__func__

    def from_name(cls, name, **overrides):
        overrides.setdefault("depth", 2)
        return original(cls, name, **overrides)

    monkeypatch.setattr(EncoderConfig, "from_name", classmethod(from_name))


PYTHON_PAGES = [page for page in DOCS if blocks(page, {"python"})]


@pytest.mark.slow
@pytest.mark.parametrize("page", PYTHON_PAGES, ids=ids)
def test_every_python_block_runs(page, tiny_variants, tmp_path, monkeypatch):
    """A page's blocks run in order in one namespace, as a reader would paste them."""
    pytest.importorskip("torchvision")  # the processor's resizes
    monkeypatch.chdir(tmp_path)
    text = page.read_text()
    for name, make in FIXTURES.items():
        if re.search(rf"[\"'`]{re.escape(name)}[\"'`]", text):
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            make(tmp_path / name)
    namespace: dict = {"__name__": "__docs__"}
    for number, (code, reason) in enumerate(blocks(page, {"python"}), 1):
        if reason:
            continue
        try:
            exec(compile(code, f"{ids(page)}, python block {number}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{ids(page)}, python block {number} failed:\n{code}") \
                from error


def test_blocks_marked_not_run_are_few_and_say_why():
    skipped = [(ids(page), reason) for page in DOCS
               for _, reason in blocks(page, {"python", "bash", ""}) if reason]
    assert len(skipped) <= MAX_SKIPPED, skipped


# --- command lines --------------------------------------------------------------------------

def command_lines(page: Path) -> list[str]:
    """Every `vlm-vit ...` or `torchrun ... -m vlm_vit.cli ...` line of the page's shell
    blocks, continuation lines joined."""
    lines = []
    for code, reason in blocks(page, {"bash", "sh", ""}):
        if reason:
            continue
        for line in code.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("vlm-vit ") or "-m vlm_vit.cli " in line:
                lines.append(line)
    return lines


def command_of(line: str) -> tuple[list[str], list[str]]:
    """The (sub)command path and the flags a command line uses."""
    words = shlex.split(line.replace("$'", "'"), comments=True)
    if "vlm-vit" in words:
        words = words[words.index("vlm-vit") + 1:]
    else:
        words = words[words.index("vlm_vit.cli") + 1:]
    path = words[:2] if words[0] == "llm" else words[:1]
    flags = [word.split("=")[0] for word in words
             if re.fullmatch(r"--?[a-z][\w-]*(=.*)?", word)]
    return path, flags


@cache
def help_text(path: tuple[str, ...]) -> str:
    done = subprocess.run([sys.executable, "-m", "vlm_vit.cli", *path, "--help"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, f"vlm-vit {' '.join(path)} --help: {done.stderr[-2000:]}"
    return done.stdout


CLI_LINES = [(page, line) for page in DOCS for line in command_lines(page)]


@pytest.mark.parametrize("page, line", CLI_LINES,
                         ids=[f"{ids(page)}: {line[:60]}" for page, line in CLI_LINES])
def test_every_command_line_names_a_command_and_its_flags(page, line):
    path, flags = command_of(line)
    text = help_text(tuple(path))
    for flag in flags:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), \
            f"{ids(page)}: `vlm-vit {' '.join(path)}` has no {flag}: {line}"


# --- names ----------------------------------------------------------------------------------

VARIANT = re.compile(r"`((?:clip-)?vit-[a-z]+/\d+(?:-\d+)?|r50\+vit-[a-z]/\d+)`")


@pytest.mark.parametrize("page", DOCS, ids=ids)
def test_every_variant_name_in_backticks_is_a_variant(page):
    from vlm_vit.config import available_variants

    unknown = sorted(set(VARIANT.findall(page.read_text())) - set(available_variants()))
    assert not unknown, f"{ids(page)} names variants that do not exist: {unknown}"


# --- the site -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None
                    or importlib.util.find_spec("mkdocstrings") is None,
                    reason="mkdocs and mkdocstrings[python] are not installed (pip install "
                    "-e '.[dev]')")
def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    warnings = [line for line in done.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert done.returncode == 0, "\n".join(warnings) or done.stderr[-3000:]
