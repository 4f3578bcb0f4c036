"""File I/O and integrity: atomic writes and directories, bounded JSON and weight-file readers
(`files`, `tensor_files`), sha256 manifests and sidecars (`integrity`), weight shards
(`weights`), the native directory (`native`), Hub names and the offline cache (`hub`), loading
any checkpoint (`loading`) and model cards (`card`).

Its modules load on first use (`vlm_vit.io.files` as an attribute imports it), as the
top-level package's names do; no sub-module is imported here.
"""

from vlm_vit.optional import lazy_submodules

__getattr__ = lazy_submodules(__name__, ("files", "tensor_files", "integrity", "weights",
                                         "native", "hub", "loading", "card"))
