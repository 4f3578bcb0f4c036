"""vlm-vit-llm: a vlm-vit `VisionTower` feeding a Hugging Face causal LM (LLaVA's design).

    from vlm_vit_llm import MultimodalLM
    mm = MultimodalLM(tower, llm, tokenizer)
    mm.generate(["<image>\\nDescribe the image."], [[image]])

The names below load on first use (PEP 562), so `vlm-vit --help`, which reads this
plugin's command table, starts without torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlm_vit_llm.batch_types import IGNORE_INDEX, MultimodalBatch, TiledImage, Video
    from vlm_vit_llm.llava import export_llava
    from vlm_vit_llm.model import MultimodalLM
    from vlm_vit_llm.video_processor import VideoProcessor

_PUBLIC = {"IGNORE_INDEX": "vlm_vit_llm.batch_types", "MultimodalBatch": "vlm_vit_llm.batch_types",
           "MultimodalLM": "vlm_vit_llm.model", "TiledImage": "vlm_vit_llm.batch_types",
           "Video": "vlm_vit_llm.batch_types", "VideoProcessor": "vlm_vit_llm.video_processor",
           "export_llava": "vlm_vit_llm.llava"}

__all__ = ["IGNORE_INDEX", "MultimodalBatch", "MultimodalLM", "TiledImage", "Video",
           "VideoProcessor", "export_llava"]
__version__ = "0.1.0"
assert sorted(__all__) == sorted(_PUBLIC)  # one list, checked at import


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'vlm_vit_llm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value
