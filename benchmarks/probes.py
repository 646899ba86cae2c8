"""The benchmarks' own C entry points (benchmarks/csrc/), built on first use beside the installed
``attn_export._C`` and linked against it, so that they measure the very kernels and GEMM switch
the package runs while the shipped library carries no measurement code
(tests/benchmarks/test_probes.py checks both).

    lib = probes.library()          # ctypes.CDLL; compiled once into torch's extension cache
    lib.attn_export_fma_peak_gflops(threads, seconds)
    lib.attn_export_project_f32(m, n, k, x, weight, bias, out)

The cache is torch.utils.cpp_extension's (``TORCH_EXTENSIONS_DIR``, by default
~/.cache/torch_extensions); a change of these sources or of the headers they include rebuilds it.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "benchmarks" / "csrc").glob("*.cpp"))


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """The probes, compiled if needed (~20 s the first time) and loaded, with their ctypes signatures."""
    from torch.utils import cpp_extension

    from attn_export import _C

    package = os.path.dirname(os.path.abspath(_C.__file__))
    path = cpp_extension.load(
        name="attn_export_benchmark_probes",
        sources=[str(source) for source in SOURCES],
        extra_include_paths=[str(ROOT / "csrc")],
        extra_cflags=["-O3", "-std=c++20"],
        # Linked against the loaded _C by its file: the dynamic loader binds to the copy already
        # in the process (its thread pool, its GEMM backend in force), not a second one.
        extra_ldflags=[f"-L{package}", f"-l:{os.path.basename(_C.__file__)}", f"-Wl,-rpath,{package}"],
        is_python_module=False,
    )
    lib = ctypes.CDLL(path)
    lib.attn_export_fma_peak_gflops.restype = ctypes.c_double
    lib.attn_export_fma_peak_gflops.argtypes = [ctypes.c_int64, ctypes.c_double]
    lib.attn_export_project_f32.restype = None
    lib.attn_export_project_f32.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4
    return lib


def exported_names() -> list[str]:
    """The C names the probe sources export (read from the sources, for the test that _C has none)."""
    import re

    pattern = re.compile(r'visibility\("default"\)\)\)[^(]*?\b(attn_export_\w+)\s*\(')
    return sorted({name for source in SOURCES for name in pattern.findall(source.read_text())})
