"""Builds attn_export._C, the C++ (and, where available, CUDA) operators.

The extension is compiled against the PyTorch that is already installed, so build without
isolation:  pip install --no-build-isolation -e .

Environment switches:
  ATTN_EXPORT_CUDA=0|1   force the CUDA kernels off/on (default: on when torch has CUDA and nvcc exists)
  ATTN_EXPORT_DEBUG=1    -O0 -g instead of -O3
"""
import glob
import os
import sys

from setuptools import setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - exercised by hand
    sys.exit(
        "attn-export compiles C++ operators against the installed PyTorch, and PyTorch was not found.\n"
        "Install PyTorch first, then build without build isolation:\n"
        "    pip install torch            # CPU: pip install torch --index-url https://download.pytorch.org/whl/cpu\n"
        "    pip install --no-build-isolation .\n"
    )

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("csrc")


def _flag(name):
    value = os.environ.get(name)
    return None if value is None else value not in ("0", "", "false", "no")


def _want_cuda():
    forced = _flag("ATTN_EXPORT_CUDA")
    available = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if forced and not available:
        sys.exit("ATTN_EXPORT_CUDA=1 but torch has no CUDA support or nvcc/CUDA_HOME was not found")
    return available if forced is None else forced


def extension():
    debug = bool(_flag("ATTN_EXPORT_DEBUG"))
    # -fno-trapping-math lets GCC if-convert and vectorize the masked softmax loops; the kernels
    # never rely on floating-point traps. -fopenmp: at::parallel_for (the CPU kernels' threads,
    # ops/cpu/runtime_aten.cpp) and `omp simd` loops.
    # -Wno-psabi: the 64-byte vector types of row_kernels.h never cross a non-inlined call.
    cxx = ["-std=c++20", "-fopenmp", "-fno-trapping-math", "-Wno-psabi", "-O0" if debug else "-O3", "-g" if debug else "-g0"]
    # Kernels (csrc/kernels/<device>/, no torch headers) and their bindings (csrc/ops/<device>/).
    sources = sorted(
        glob.glob(os.path.join(CSRC, "kernels", "cpu", "*.cpp"))
        + glob.glob(os.path.join(CSRC, "ops", "*.cpp"))
        + glob.glob(os.path.join(CSRC, "ops", "cpu", "*.cpp"))
        + glob.glob(os.path.join(CSRC, "ops", "autograd", "*.cpp"))
    )
    kwargs = dict(
        name="attn_export._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, CSRC)],
        extra_compile_args={"cxx": cxx},
        extra_link_args=["-fopenmp"],
        py_limited_api=False,
    )
    if _want_cuda():
        cuda_sources = sorted(
            glob.glob(os.path.join(CSRC, "kernels", "cuda", "*.cu"))
            + glob.glob(os.path.join(CSRC, "ops", "cuda", "*.cu"))
            + glob.glob(os.path.join(CSRC, "ops", "cuda", "*.cpp"))
        )
        if cuda_sources:
            kwargs["sources"] += cuda_sources
            kwargs["extra_compile_args"]["nvcc"] = ["-O3", "-std=c++20", "--expt-relaxed-constexpr"]
            kwargs["define_macros"] = [("ATTN_EXPORT_WITH_CUDA", "1")]
            return cpp_extension.CUDAExtension(**kwargs)
    return cpp_extension.CppExtension(**kwargs)


setup(
    ext_modules=[extension()],
    cmdclass={
        "build_ext": cpp_extension.BuildExtension.with_options(no_python_abi_suffix=True),
    },
)
