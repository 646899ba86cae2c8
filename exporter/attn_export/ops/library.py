"""Loads the compiled extension, then registers the fake (meta) kernels and the autocast rules.

The order matters: registering fakes for operators whose schemas were never loaded fails with
an opaque error, so a missing build must be reported first, in words that say how to fix it.
Before that, the PyTorch that _C was compiled against (attn_export/_build_info.py, written by
setup.py) is compared with the running one: libtorch has no stable C++ ABI across minor
versions, and loading _C into another one fails with an undefined symbol that names neither.
"""
import importlib
import re
from typing import Optional

_loaded = False


class ExtensionNotBuiltError(ImportError):
    pass


class TorchMismatchError(ExtensionNotBuiltError):
    """The compiled operators were built for another PyTorch than the one installed."""


def _release(version: str) -> str:
    """"2.13" of "2.13.0+cpu"."""
    found = re.match(r"\d+\.\d+", version)
    return found.group(0) if found else version


def mismatch(built_torch: str, built_cuda: Optional[str], torch_version: str, torch_cuda: Optional[str]) -> Optional[str]:
    """Why a _C compiled against torch ``built_torch`` (CUDA ``built_cuda`` or None) cannot load
    into torch ``torch_version`` (``torch_cuda``), in one line; None when it can. A CPU build
    loads into a CUDA torch of the same minor version (its CPU kernels only); a CUDA build needs
    a torch with the same CUDA major version (it links libcudart.so.<major> and libc10_cuda)."""
    wheel = f"torch {built_torch}" + (f" (CUDA {built_cuda})" if built_cuda else "")
    have = f"torch {torch_version}" + (f" (CUDA {torch_cuda})" if torch_cuda else " (no CUDA)")
    if _release(built_torch) != _release(torch_version):
        fix = f"install torch=={_release(built_torch)}.* or an attn-export built for torch {_release(torch_version)}"
    elif built_cuda and not torch_cuda:
        fix = f"install a CUDA {built_cuda.split('.')[0]} build of torch {_release(built_torch)}, or the CPU build of attn-export"
    elif built_cuda and built_cuda.split(".")[0] != torch_cuda.split(".")[0]:
        fix = f"install a CUDA {built_cuda.split('.')[0]} build of torch {_release(built_torch)}, or an attn-export built for CUDA {torch_cuda}"
    else:
        return None
    return (f"attn_export's compiled operators were built against {wheel} but the installed PyTorch is {have}: "
            f"{fix} (or build from source against this torch: pip install --no-build-isolation .)")


def _check_build(torch) -> None:
    try:
        info = importlib.import_module("attn_export._build_info")
    except ImportError:
        return  # built before builds recorded their torch: nothing to compare, _C's import decides
    reason = mismatch(info.TORCH_VERSION, info.CUDA_VERSION, torch.__version__, torch.version.cuda)
    if reason:
        raise TorchMismatchError(reason)


def load_library() -> None:
    global _loaded
    if _loaded:
        return
    import torch  # loads libc10/libtorch (and libgomp), which _C links against without an rpath

    _check_build(torch)
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
