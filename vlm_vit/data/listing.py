"""Image folders listed: the files read as images (`IMAGE_SUFFIXES`), every image under a
folder (`image_files`), and a folder of one sub-folder per class (`class_folders`). Nothing
here decodes an image."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# File suffixes read as images when a folder is searched.
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp",
                            ".ppm", ".pgm", ".pbm"})


def image_files(folder: str | Path) -> list[Path]:
    """Every image file under `folder`, recursively, sorted; hidden entries (`.x`, such as
    macOS's `._photo.jpg`) are skipped. Empty when there is none."""
    folder = Path(folder)
    return sorted(
        p for p in folder.rglob("*")
        if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def class_folders(root: str | Path) -> tuple[list[Path], list[int], list[str]]:
    """The images of a folder with one sub-folder per class (searched recursively).

    Hidden entries are skipped; files directly in `root` are ignored (a warning says so).

    Returns:
        The image files (by class, then path), their class indices, and the sorted class
        names.

    Raises:
        FileNotFoundError, NotADirectoryError: for a missing `root` or a file.
        ValueError: for fewer than 2 class folders, or a class folder without images.
    """
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"data folder {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"data folder {root} is not a folder")
    entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    loose = [p for p in entries if p.is_file()]
    if loose:
        logger.warning("ignoring %d files directly in %s: images must sit in one folder per "
                       "class", len(loose), root)
    classes = [p.name for p in entries if p.is_dir()]
    if len(classes) < 2:
        raise ValueError(f"data folder {root} needs one sub-folder per class and at least 2 "
                         f"classes; found {len(classes)} ({', '.join(classes) or 'none'})")
    files: list[Path] = []
    labels: list[int] = []
    for index, name in enumerate(classes):
        found = image_files(root / name)
        if not found:
            raise ValueError(f"class folder {root / name} holds no image files "
                             f"({', '.join(sorted(IMAGE_SUFFIXES))})")
        files.extend(found)
        labels.extend([index] * len(found))
    return files, labels, classes
