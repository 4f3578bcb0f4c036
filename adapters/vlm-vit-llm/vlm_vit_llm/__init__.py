"""vlm-vit-llm: a vlm-vit `VisionTower` feeding a Hugging Face causal LM (LLaVA's design).

    from vlm_vit_llm import MultimodalLM
    mm = MultimodalLM(tower, llm, tokenizer)
    mm.generate(["<image>\\nDescribe the image."], [[image]])
"""

from vlm_vit_llm.llava import export_llava
from vlm_vit_llm.model import IGNORE_INDEX, MultimodalBatch, MultimodalLM, TiledImage

__all__ = ["IGNORE_INDEX", "MultimodalBatch", "MultimodalLM", "TiledImage", "export_llava"]
__version__ = "0.1.0"
