"""Loads the compiled extension, then registers the fake (meta) kernels and the autocast rules.

The order matters: registering fakes for operators whose schemas were never loaded fails with
an opaque error, so a missing build must be reported first, in words that say how to fix it.
"""
import importlib

_loaded = False


class ExtensionNotBuiltError(ImportError):
    pass


def load_library() -> None:
    global _loaded
    if _loaded:
        return
    import torch  # noqa: F401  (loads libc10/libtorch, which _C links against without an rpath)

    try:
        importlib.import_module("attn_export._C")
    except ImportError as exc:
        raise ExtensionNotBuiltError(
            "attn_export's compiled operators (attn_export._C) are missing or failed to load: "
            f"{exc}\nBuild them against the installed PyTorch with "
            "`pip install --no-build-isolation -e .` (or run `make test`, which does it)."
        ) from exc
    # The CPU GEMM library (ATTN_EXPORT_GEMM, else chosen for this CPU), before any op runs.
    importlib.import_module("attn_export.ops.gemm").configure()
    importlib.import_module("attn_export.ops.fake")
    importlib.import_module("attn_export.ops.autocast").register()
    _loaded = True
