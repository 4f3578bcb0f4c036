"""Model names: Hugging Face Hub repositories and open_clip pretrained tags, offline-first.

Every loader and command takes a name wherever it takes a path. The rule:

1. A path that exists is that path.
2. `hf-hub:org/name` is always a Hub repository (as timm and open_clip spell it).
3. `MODEL/TAG` that open_clip's pretrained table lists (`ViT-B-32/laion2b_s34b_b79k`,
   `ViT-L-14-336/openai`) is the Hub copy that table names, with open_clip's weights.
4. Any other `org/name` is a Hub repository (`openai/clip-vit-large-patch14-336`,
   `timm/vit_base_patch16_224.augreg2_in21k_ft_in1k`).

Commands that also take a variant name (`vlm-vit info vit-b/16`) check their variants
between 1 and 2, so `vit-b/16` keeps its meaning and `hf-hub:vit-b/16` means the Hub.

`org/name@revision` pins a branch, tag or commit. Files come through `huggingface_hub`
into its cache (`HF_HOME`, `HF_HUB_CACHE`), safetensors and JSON only unless a repository
has no safetensors, so pickles are fetched only where nothing else exists (and are still
read with `weights_only=True`). With `HF_HUB_OFFLINE=1`, or when the Hub cannot be reached,
the cached snapshot is used; a name that is not cached fails at once with a message saying
how to fetch it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

HUB_PREFIX = "hf-hub:"
# What the checkpoint formats read: configs (config.json, preprocessor_config.json,
# open_clip_config.json, the shard index) and safetensors weights.
FORMAT_PATTERNS = ("*.json", "*.safetensors")
# Fetched only when a repository has no safetensors; read with weights_only=True.
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.npz")
# What transformers needs for a causal LM and its tokenizer.
LLM_PATTERNS = (*FORMAT_PATTERNS, "*.model", "*.txt", "*.tiktoken", "*.jinja")
OPEN_CLIP_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class NotCachedError(FileNotFoundError):
    """A Hub name that is neither cached nor reachable.

    Attributes:
        problem: what is missing and why, without advice.
        fetch: how to fetch it (the commands to run).
    """

    def __init__(self, problem: str, fetch: str) -> None:
        super().__init__(f"{problem}; to fetch it, {fetch}")
        self.problem, self.fetch = problem, fetch


class Location(NamedTuple):
    """Where a name's files are.

    Attributes:
        directory: a local directory (or file) to read.
        weight_files: the weight file names to prefer in it, in order; None: the readers'
            default order.
        repo_id: the Hub repository, when it came from one.
        format: the checkpoint format the name implies (open_clip's pairs: "open_clip",
            whatever else the repository holds), or None to detect it.
    """

    directory: Path
    weight_files: tuple[str, ...] | None = None
    repo_id: str | None = None
    format: str | None = None


def cache_dir() -> Path:
    """The Hub cache in use now: `HF_HUB_CACHE`, else `HF_HOME/hub`, else the default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    """Whether `HF_HUB_OFFLINE` is set (read now, not when huggingface_hub was imported)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def split_revision(name: str) -> tuple[str, str | None]:
    """`org/name@revision` as (`org/name`, `revision`); no `@`: (name, None)."""
    base, at, revision = name.partition("@")
    return (base, revision) if at and revision else (name, None)


def open_clip_repo(name: str) -> str | None:
    """The Hub repository open_clip's pretrained table names for `MODEL/TAG`, or None when
    open_clip is not installed or does not list the pair.

    Raises:
        FileNotFoundError: when open_clip lists the pair at a URL only, with no Hub copy.
    """
    model, _, tag = name.partition("/")
    if not tag:
        return None
    try:
        from open_clip import pretrained
    except ImportError:
        return None
    if (model, tag) not in set(pretrained.list_pretrained()):
        return None
    settings = pretrained.get_pretrained_cfg(model, tag)
    repo = (settings.get("hf_hub") or "").strip("/")
    if not repo:
        raise FileNotFoundError(f"open_clip lists {name} only at {settings.get('url')!r}, not "
                                f"on the Hugging Face Hub; download it with open_clip and load "
                                f"the file")
    return repo


def locate(name: str | Path | Location, revision: str | None = None, *,
           patterns: tuple[str, ...] = FORMAT_PATTERNS) -> Location:
    """Where the files of a path or model name are (see the module docstring for the rule).

    Args:
        name: a path, `hf-hub:org/name`, `org/name[@revision]` or open_clip's `MODEL/TAG`
            (a `Location` is returned as it is).
        revision: a branch, tag or commit (overrides one in `name`).
        patterns: the files to fetch from a repository.

    Raises:
        FileNotFoundError: for a path that does not exist and is no Hub name.
        NotCachedError: for a name neither cached nor reachable, saying how to fetch it.
    """
    if isinstance(name, Location):
        return name
    if not Path(name).exists():  # a save killed mid-swap leaves it missing: put it back
        from vlm_vit.io.files import recover_directory

        recover_directory(name)
    if isinstance(name, Path) or Path(name).exists():
        path = Path(name)
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        return Location(path)
    text = str(name)
    forced = text.startswith(HUB_PREFIX)
    text, pinned = split_revision(text.removeprefix(HUB_PREFIX))
    revision = revision or pinned
    weight_files = fmt = None
    repo_id = None if forced else open_clip_repo(text)
    if repo_id is not None:
        weight_files, fmt = OPEN_CLIP_FILES, "open_clip"
        patterns = ("open_clip_config.json", OPEN_CLIP_FILES[0])
    else:
        repo_id = text
    if not _REPO_ID.match(repo_id):
        raise FileNotFoundError(f"{name} does not exist (and is not a Hugging Face Hub name "
                                f"like org/name)")
    directory = fetch(repo_id, revision, patterns=patterns, shown=str(name))
    if not _has_weights(directory, weight_files):
        # No safetensors: the repository's other weight files (never run: weights_only).
        extra = (OPEN_CLIP_FILES[1],) if weight_files else PICKLE_PATTERNS
        directory = fetch(repo_id, revision, patterns=(*patterns, *extra), shown=str(name))
    return Location(directory, weight_files, repo_id, fmt)


def resolve(name: str | Path, revision: str | None = None) -> Path:
    """The local directory (or file) of a path or model name (see `locate`)."""
    return locate(name, revision).directory


def _has_weights(directory: Path, weight_files: tuple[str, ...] | None) -> bool:
    if weight_files is not None:
        return any((directory / name).is_file() for name in weight_files)
    return any(directory.glob("*.safetensors"))


def fetch(repo_id: str, revision: str | None = None, *,
          patterns: tuple[str, ...] = FORMAT_PATTERNS, shown: str | None = None) -> Path:
    """A repository's snapshot directory in the cache, downloading what is missing unless
    offline; the cached snapshot when offline or the Hub cannot be reached.

    Raises:
        NotCachedError: naming the repository, the cache and how to fetch it.
        ImportError: without huggingface_hub (`pip install 'vlm-vit[hub]'`).
    """
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as error:
        raise ImportError(f"{shown or repo_id} is a Hugging Face Hub name, which needs "
                          f"huggingface_hub: pip install 'vlm-vit[hub]'") from error
    cache = cache_dir()
    shown = shown or repo_id
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                          allow_patterns=list(patterns),
                                          local_files_only=offline()))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        at = f" at revision {revision!r}" if revision else ""
        if offline():
            reason, how = "HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE and run"
        else:
            first = (str(error).splitlines() or [type(error).__name__])[0][:160]
            reason, how = f"the Hub could not give it: {first}", "run"
        hf_revision = f" --revision {revision}" if revision else ""
        raise NotCachedError(f"{shown} is not a local path, and {repo_id}{at} is not in the "
                             f"Hugging Face cache at {cache} ({reason})",
                             f"{how} `vlm-vit download {shown}` or "
                             f"`hf download {repo_id}{hf_revision}`") from error
    check_snapshot(snapshot)
    return snapshot


def check_snapshot(snapshot: Path) -> None:
    """Refuses a cached snapshot with a file that resolves outside it and its repository's
    `blobs/` (a link planted in the cache would otherwise be read as the model's weights).

    Raises:
        ValueError: naming the file and where it leads.
    """
    from vlm_vit.io.files import resolves_inside
    from vlm_vit.io.weights import allowed_roots

    roots = allowed_roots(snapshot)
    for path in snapshot.rglob("*"):
        if not resolves_inside(path, *roots):
            raise ValueError(f"{path} in the Hugging Face cache is a link to "
                             f"{os.path.realpath(path)}, outside its repository's blobs/; "
                             f"refused")


def push_to_hub(directory: str | Path, repo_id: str, *, private: bool | None = None,
                commit_message: str = "Upload with vlm-vit", **kwargs) -> str:
    """Uploads a saved directory (encoder, tower or multimodal model) to a Hub repository,
    creating it if needed; returns the commit URL. `kwargs` go to `upload_folder`.

    Raises:
        FileNotFoundError: when `directory` holds no `config.json` or multimodal config.
    """
    from huggingface_hub import create_repo, upload_folder

    directory = Path(directory)
    if not any((directory / name).is_file()
               for name in ("config.json", "multimodal_config.json")):
        raise FileNotFoundError(f"{directory} is not a saved vlm-vit model (no config.json); "
                                f"save_pretrained it first")
    from vlm_vit.io.card import CARD_NAME, PLACEHOLDER

    card = directory / CARD_NAME
    if card.is_file() and PLACEHOLDER in (text := card.read_text()):  # our card: name the repo
        from vlm_vit.io.files import atomic_write

        with atomic_write(card, "w") as handle:
            handle.write(text.replace(PLACEHOLDER, repo_id))
    create_repo(repo_id, private=private, exist_ok=True)
    return str(upload_folder(repo_id=repo_id, folder_path=str(directory),
                             commit_message=commit_message, **kwargs))
