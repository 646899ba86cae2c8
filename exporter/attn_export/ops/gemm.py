"""Which library runs the CPU layer's GEMMs, chosen once per process (csrc/kernels/cpu/gemm_backend.h).

    >>> attn_export.gemm_backend()
    GemmChoice(name='openblas', microkernel='avx2', forced=False, reason='AMD CPU: ...')

Backends: ``aten`` (the BLAS PyTorch was built with: MKL on x86 wheels), ``openblas`` (the
``scipy-openblas32`` wheel, ``pip install attn-export[openblas]``), ``microkernel`` (the
project's register-tiled float32 kernels for every product they cover, ``aten`` for the rest).
Under a library, float32 products small enough for the micro-kernels still go to them when the
CPU has AVX-512 or AVX2+FMA (a library call costs microseconds of dispatch there), unless the
backend was forced: ``ATTN_EXPORT_GEMM=aten|openblas|microkernel`` runs that one for every
product it covers, ``ATTN_EXPORT_GEMM=auto`` (or unset) chooses.

The automatic choice: on AMD CPUs, OpenBLAS when the wheel is installed, else PyTorch's BLAS;
elsewhere PyTorch's BLAS; the micro-kernels take the small float32 products either way. MKL,
which PyTorch's x86 wheels link, runs its generic code paths on AMD CPUs (on a Zen 4 machine,
2048x256x768 at ~101 GFLOP/s against OpenBLAS's ~210); on the Zen 3 machine of
docs/benchmarks.md OpenBLAS ran 17 of 21 projection shapes faster than MKL, by up to 1.8x (MKL
led on few-token products, 32-64 rows). It runs single-threaded inside at::parallel_for's
tasks, never on its own thread pool, which fought ATen's (1.7 GFLOP/s at 128x384x128 before
that). The choice is a rule, not a measurement, so that two runs on one machine compute the
same sums in the same order.

OpenBLAS is loaded with dlopen from the path the ``scipy_openblas32`` module gives: the build
needs neither its headers nor its library, and a machine without the wheel runs on ``aten``.
"""
from __future__ import annotations

import ctypes
import os
from typing import NamedTuple

BACKENDS = ("aten", "openblas", "microkernel")
ENV_VAR = "ATTN_EXPORT_GEMM"
_ISA_NAMES = {0: None, 1: "avx2", 2: "avx512"}
_VENDORS = {1: "AMD", 2: "Intel"}


class GemmBackendError(RuntimeError):
    pass


class GemmChoice(NamedTuple):
    name: str                # the library in force: aten | openblas | microkernel
    microkernel: str | None  # the micro-kernels' ISA (avx512 | avx2) when they take small float32 products
    forced: bool             # named by ATTN_EXPORT_GEMM / set_gemm_backend, not chosen for this CPU
    reason: str              # why this backend runs


_choice: GemmChoice | None = None


def _lib() -> ctypes.CDLL:
    from attn_export import _C

    lib = ctypes.CDLL(_C.__file__)
    lib.attn_export_gemm_load_openblas.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
    lib.attn_export_gemm_openblas_config.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.attn_export_gemm_set.argtypes = [ctypes.c_int, ctypes.c_int]
    return lib


def _openblas_path() -> tuple[str | None, str]:
    """The OpenBLAS shared library of the scipy-openblas32 wheel, or None and why not."""
    try:
        import scipy_openblas32
    except ImportError:
        return None, "the scipy-openblas32 wheel is not installed (pip install 'attn-export[openblas]')"
    path = os.path.join(scipy_openblas32.get_lib_dir(), scipy_openblas32.get_library(fullname=True))
    return path, ""


def _load_openblas(lib: ctypes.CDLL) -> str:
    """Loads OpenBLAS into the extension; returns "" or why it is unavailable."""
    path, why = _openblas_path()
    if path is None:
        return why
    error = ctypes.create_string_buffer(1024)
    if lib.attn_export_gemm_load_openblas(path.encode(), error, len(error)) != 0:
        return error.value.decode(errors="replace")
    return ""


def available_backends() -> dict[str, str]:
    """Each backend -> "" when it can run here, else why not."""
    lib = _lib()
    return {
        "aten": "",
        "openblas": _load_openblas(lib),
        "microkernel": "" if lib.attn_export_linear_kernel_isa() else _why_no_microkernels(),
    }


def _why_no_microkernels() -> str:
    if os.environ.get("ATTN_EXPORT_CPU_ISA") == "generic":
        return "ATTN_EXPORT_CPU_ISA=generic keeps the CPU kernels to baseline x86-64 (unset it to use them)"
    return "the CPU has neither AVX-512 nor AVX2 with FMA"


def openblas_config() -> str:
    """OpenBLAS's own description (version, kernel set picked for this CPU); "" when not loaded."""
    buffer = ctypes.create_string_buffer(512)
    _lib().attn_export_gemm_openblas_config(buffer, len(buffer))
    return buffer.value.decode(errors="replace")


def _unavailable(name: str, why: str) -> GemmBackendError:
    return GemmBackendError(
        f"{ENV_VAR}={name}: the {name} GEMM backend is not available here: {why}. "
        f"Choose one of {', '.join(BACKENDS)} or auto (unset {ENV_VAR}), or install what it needs."
    )


def _auto(lib: ctypes.CDLL, available: dict[str, str]) -> tuple[str, str]:
    vendor = _VENDORS.get(lib.attn_export_cpu_vendor(), "non-AMD")
    if vendor != "AMD":
        return "aten", f"{vendor} CPU: PyTorch's BLAS"
    why_not_openblas = available["openblas"]  # "" when it can run
    if why_not_openblas:
        return "aten", f"AMD CPU: PyTorch's BLAS (OpenBLAS would be faster, but {why_not_openblas})"
    return "openblas", "AMD CPU: OpenBLAS (faster than the MKL PyTorch links, which runs generic code on AMD)"


def set_gemm_backend(name: str = "auto") -> GemmChoice:
    """Puts a GEMM backend in force for this process: one of BACKENDS (forced: it runs every
    product it covers) or "auto" (chosen for this CPU). Raises GemmBackendError naming the
    choices when the name is unknown or the backend cannot run here."""
    global _choice
    requested = name.strip().lower()
    if requested not in BACKENDS + ("auto",):
        raise GemmBackendError(
            f"{ENV_VAR}={name!r} is not a GEMM backend: choose one of {', '.join(BACKENDS)} or auto "
            f"(or unset {ENV_VAR})."
        )
    lib = _lib()
    available = available_backends()
    isa = _ISA_NAMES[lib.attn_export_linear_kernel_isa()]
    if requested == "auto":
        chosen, reason = _auto(lib, available)
        forced = False
    else:
        if available[requested] != "":
            raise _unavailable(requested, available[requested])
        chosen, reason, forced = requested, "forced (set_gemm_backend / " + ENV_VAR + ")", True
    microkernels = isa is not None and (not forced or chosen == "microkernel")
    if lib.attn_export_gemm_set(BACKENDS.index(chosen), int(microkernels)) != 0:
        raise _unavailable(chosen, "OpenBLAS was not loaded")
    if isa is not None and not forced:  # the limit depends on the library now in force
        reason += (f"; float32 products of up to 2^{lib.attn_export_linear_kernel_max_work_log2()} "
                   f"multiply-adds on the {isa} micro-kernels")
    _choice = GemmChoice(chosen, isa if microkernels else None, forced, reason)
    return _choice


def gemm_backend() -> GemmChoice:
    """The GEMM backend in force, the micro-kernels' ISA where they run, and why."""
    return _choice if _choice is not None else configure()


def configure() -> GemmChoice:
    """The choice at import: ATTN_EXPORT_GEMM, else auto."""
    return set_gemm_backend(os.environ.get(ENV_VAR, "auto") or "auto")
