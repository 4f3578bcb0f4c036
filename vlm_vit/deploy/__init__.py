"""Deployment: `torch.export` and ONNX programs with a dynamic size, int8, and their checks
(`export`); the runners and output staging (`export_runtime`); ExecuTorch programs
(`executorch`); the fixed-capacity budget program (`budget_export`).

Its modules load on first use (`vlm_vit.deploy.export` as an attribute imports it), as the
top-level package's names do; no sub-module is imported here.
"""

from vlm_vit.optional import lazy_submodules

__getattr__ = lazy_submodules(__name__, ("export", "export_runtime", "executorch",
                                         "budget_export"))
