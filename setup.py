"""Builds attn_export._C, the C++ (and, where available, CUDA) operators.

The extension is compiled against the PyTorch that is already installed, so build without
isolation:  pip install --no-build-isolation -e .

A binary wheel (`make wheel`) is built the same way: it carries the compiled operators, a
Requires-Dist on the PyTorch minor version they were compiled against (libtorch has no stable
C++ ABI across minor versions) and attn_export/_build_info.py, which records that PyTorch so
that the package can refuse a different one with a readable message before loading _C.

Environment switches:
  ATTN_EXPORT_CUDA=0|1   force the CUDA kernels off/on (default: on when torch has CUDA and nvcc exists)
  ATTN_EXPORT_DEBUG=1    -O0 -g instead of -O3
  TORCH_CUDA_ARCH_LIST   with 9.0a in it, the Hopper (sm_90a) forward is built too; it needs the
                         CUTLASS/CuTe headers of the nvidia-cutlass package (CUTLASS_PIN; install
                         it with --no-deps: only its headers are read), or of
                         ATTN_EXPORT_CUTLASS_INCLUDE=<dir holding cute/ and cutlass/>
"""
import glob
import importlib.metadata
import importlib.util
import os
import re
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

# The runtime dependencies besides torch (pyproject.toml declares them dynamic: torch's pin is
# only known here, at build time).
DEPENDENCIES = [
    "numpy",
    "click>=8.1",
    "rich>=13",
    "onnx>=1.17",
    "onnxscript>=0.3",
    "onnxruntime>=1.20",
]


def _base_version():
    """The one version number, exporter/attn_export/_version.py (read as text: importing the
    package would load the compiled operators)."""
    text = open(os.path.join(ROOT, "exporter", "attn_export", "_version.py")).read()
    return re.search(r'^__version__\s*=\s*"([^"]+)"', text, re.M).group(1)


def _torch_release():
    """(major, minor) of the torch being compiled against."""
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    return int(major), int(minor)


def _variant(cuda):
    """The build's local version label: `cpu` or `cu130`, then the torch minor version, so that
    wheels of different builds have different names and a pipeline can pin the one it needs."""
    major, minor = _torch_release()
    device = "cu" + torch.version.cuda.replace(".", "") if cuda else "cpu"
    return f"{device}.torch{major}.{minor}"


def _flag(name):
    value = os.environ.get(name)
    return None if value is None else value not in ("0", "", "false", "no")


# The CUTLASS release the sm_90a kernels (csrc/kernels/cuda/hopper/) are written against: headers
# only, needed at build time only, and only when the arch list holds 9.0a.
CUTLASS_PIN = "4.2.0.0"


def _sm90a_requested():
    """Whether TORCH_CUDA_ARCH_LIST asks for sm_90a code (`8.0;9.0a`)."""
    archs = re.split(r"[;\s]+", os.environ.get("TORCH_CUDA_ARCH_LIST", ""))
    return any(a.split("+")[0] == "9.0a" for a in archs)


def _cutlass_include():
    """The folder holding cute/ and cutlass/: ATTN_EXPORT_CUTLASS_INCLUDE, else the nvidia-cutlass
    package's (cutlass_library/source/include, found without importing it) at CUTLASS_PIN."""
    given = os.environ.get("ATTN_EXPORT_CUTLASS_INCLUDE")
    if given:
        if not os.path.isdir(os.path.join(given, "cute")):
            sys.exit(f"ATTN_EXPORT_CUTLASS_INCLUDE={given} holds no cute/ folder (want CUTLASS's include/)")
        return given
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"TORCH_CUDA_ARCH_LIST holds 9.0a, which builds the Hopper kernels on CUTLASS/CuTe, and the\n"
                 f"nvidia-cutlass package was not found. Install it (headers only, build time only):\n"
                 f"    pip install --no-deps nvidia-cutlass=={CUTLASS_PIN}\n"
                 f"or set ATTN_EXPORT_CUTLASS_INCLUDE to a CUTLASS include/ folder, or drop 9.0a from the list.")
    found = importlib.metadata.version("nvidia-cutlass")
    if found != CUTLASS_PIN:
        sys.exit(f"nvidia-cutlass {found} is installed; the Hopper kernels are built and checked against "
                 f"{CUTLASS_PIN}: pip install --no-deps nvidia-cutlass=={CUTLASS_PIN}")
    return os.path.join(list(spec.submodule_search_locations)[0], "source", "include")


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
            + glob.glob(os.path.join(CSRC, "kernels", "cuda", "instantiations", "*.cu"))
            + glob.glob(os.path.join(CSRC, "ops", "cuda", "*.cu"))
            + glob.glob(os.path.join(CSRC, "ops", "cuda", "*.cpp"))
        )
        if cuda_sources:
            kwargs["sources"] += cuda_sources
            kwargs["extra_compile_args"]["nvcc"] = ["-O3", "-std=c++20", "--expt-relaxed-constexpr"]
            kwargs["define_macros"] = [("ATTN_EXPORT_WITH_CUDA", "1")]
            if _sm90a_requested():  # the instantiations/sm90_*.cu files compile to nothing otherwise
                kwargs["include_dirs"].append(_cutlass_include())
                kwargs["define_macros"].append(("ATTN_EXPORT_WITH_SM90", "1"))
            return cpp_extension.CUDAExtension(**kwargs), True
    return cpp_extension.CppExtension(**kwargs), False


def _build_info(cuda):
    """The text of attn_export/_build_info.py: what _C was compiled against. The package compares
    it with the running torch before it loads _C (attn_export/ops/library.py)."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") if cuda else None  # None: torch's default, the local GPU
    return (
        "# Generated by setup.py when attn_export._C is built; never edit it (rebuild instead).\n"
        '"""What attn_export._C was compiled against (read by attn_export.ops.library before loading it)."""\n'
        f"TORCH_VERSION = {torch.__version__!r}\n"
        f"CUDA_VERSION = {(torch.version.cuda if cuda else None)!r}\n"
        f"CUDA_ARCHS = {archs!r}\n"
        f"CXX11_ABI = {bool(torch._C._GLIBCXX_USE_CXX11_ABI)!r}\n"
    )


class BuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension, which also writes _build_info.py beside the built _C: into the
    build folder (what a wheel packs) and, for in-place and editable builds, into the source
    package (what the checkout imports). An editable build keeps its objects where a wheel build
    of the same checkout looks for them (build/temp.*; setuptools would use a temporary folder),
    so that `make test`'s wheel after `make install` recompiles nothing (ninja: ~2 minutes on 2 cores)."""

    def finalize_options(self):
        super().finalize_options()
        if getattr(self, "editable_mode", False):
            import sysconfig

            self.build_temp = os.path.join(ROOT, "build", f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")

    def run(self):
        super().run()
        text = _build_info(CUDA)
        targets = {os.path.join(self.build_lib, "attn_export")}
        if self.inplace or getattr(self, "editable_mode", False):
            targets.add(os.path.join(ROOT, "exporter", "attn_export"))
        for folder in targets:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "_build_info.py"), "w") as f:
                f.write(text)


EXTENSION, CUDA = extension()
TORCH_MAJOR, TORCH_MINOR = _torch_release()

setup(
    version=f"{_base_version()}+{_variant(CUDA)}",
    # Same minor version as the build: the C++ ABI of libtorch changes between minor versions,
    # and a mismatch fails at load time with an undefined symbol.
    install_requires=[f"torch=={TORCH_MAJOR}.{TORCH_MINOR}.*", *DEPENDENCIES],
    ext_modules=[EXTENSION],
    cmdclass={
        "build_ext": BuildExtension.with_options(no_python_abi_suffix=True),
    },
)
