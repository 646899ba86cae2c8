"""Builds the SIMT-emulated kernels (simt_emulator.h) into a CPU torch extension.

    from cuda_emulator.build import load
    emu = load()          # registers torch.ops.attn_export_emu.*

The kernel sources are compiled as C++ by the host compiler: a few unity files, each including
a share of csrc/kernels/cuda/*.cu and instantiations/*.cu after simt_emulator.h. The extension's name carries a hash
of every source it is built from, so an edit anywhere rebuilds it.

    ATTN_EXPORT_EMU_TSAN=1     build with ThreadSanitizer (data races between emulated threads
                               = missing __syncthreads); run under
                               LD_PRELOAD=$(gcc -print-file-name=libtsan.so) (tsan_check.py, make tsan)

Every unit is compiled with -fsanitize=alignment: a misaligned typed load or store in a kernel
calls the handler in emulator_runtime.cpp, which fails the launch as a GPU would (no sanitizer
runtime is linked for it). It more than doubles the build's time (the flash forward's unit: 125
instead of 50 s of a core), so `make test` (CI) builds without it:

    ATTN_EXPORT_EMU_ALIGNMENT=0  no -fsanitize=alignment; cp.async and ldmatrix still check their
                                 addresses (simt_emulator.h), plain typed loads and stores do not
                                 (`make test-all` and a plain pytest run build with it)
"""
from __future__ import annotations

import glob
import hashlib
import os
import pathlib
import shutil
import sys
import sysconfig
import time

import torch
import torch.utils.cpp_extension

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[3]
CSRC = ROOT / "csrc"
KERNELS = CSRC / "kernels" / "cuda"


def alignment_checked() -> bool:
    """Whether the build checks every typed load and store's alignment (-fsanitize=alignment)."""
    return os.environ.get("ATTN_EXPORT_EMU_ALIGNMENT", "1") != "0"


def cuda_include_dir() -> pathlib.Path | None:
    """A directory holding cuda_fp16.h / cuda_runtime_api.h: a CUDA toolkit or pip's nvidia headers."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(pathlib.Path(os.environ[var]) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(pathlib.Path(nvcc).resolve().parent.parent / "include")
    candidates.append(pathlib.Path("/usr/local/cuda/include"))
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    candidates += [pathlib.Path(p) for p in sorted(glob.glob(str(site / "nvidia" / "*" / "include")))]
    for c in candidates:
        if (c / "cuda_fp16.h").exists() and (c / "cuda_runtime_api.h").exists():
            return c
    return None


def _build_hash(files) -> str:
    """Of every input: the sources, this script, the torch and Python it builds against (an
    extension built for another torch must never be loaded), and the sanitizer switch."""
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    h.update(pathlib.Path(__file__).read_bytes())
    h.update(f"{torch.__version__} {sys.version} {torch.utils.cpp_extension.__file__}".encode())
    h.update(os.environ.get("ATTN_EXPORT_EMU_TSAN", "").encode())
    h.update(f"alignment={alignment_checked()}".encode())
    return h.hexdigest()[:12]


def _clear_stale_lock(build_dir: pathlib.Path, max_age_s: float = 1800) -> None:
    """torch's build lock outlives a build that was killed, and then blocks every later load."""
    lock = build_dir / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > max_age_s:
        lock.unlink(missing_ok=True)


def _unity_file(unit: pathlib.Path, includes) -> str:
    """Writes `unit` including each of `includes` (only when its text changes: ninja rebuilds on
    a newer file) and returns its path."""
    text = "".join(f'#include "{f}"\n' for f in includes)
    if not unit.exists() or unit.read_text() != text:
        unit.write_text(text)
    return str(unit)


def load(verbose: bool = False):
    from torch.utils import cpp_extension

    include = cuda_include_dir()
    if include is None:
        raise RuntimeError("no CUDA headers (cuda_fp16.h) found: set CUDA_HOME")
    kernel_units = sorted(KERNELS.glob("*.cu")) + sorted((KERNELS / "instantiations").glob("*.cu"))
    inputs = (
        kernel_units
        + sorted(KERNELS.glob("*.cuh"))
        + sorted(KERNELS.glob("*.h"))
        + sorted(HERE.glob("*.h"))
        + sorted(HERE.glob("*.cpp"))
        + [CSRC / "attention_params.h", CSRC / "ops" / "attention_binding.h", CSRC / "ops" / "attention_binding.cpp",
           CSRC / "ops" / "verified_inputs.h", CSRC / "ops" / "verified_inputs.cpp"]
    )
    name = f"attn_export_emu_{_build_hash(inputs)}"
    build_dir = pathlib.Path(os.environ.get("ATTN_EXPORT_EMU_BUILD", pathlib.Path.home() / ".cache" / "attn_export_emu")) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build_dir)

    # Unity files: the generic kernels, the flash forward, the flash backward, the dispatch; and
    # the host files that include torch's headers, parsed once instead of five times (~20 instead
    # of ~60 s of a core; the extension's own build compiles csrc/ops/*.cpp one by one).
    groups = {
        "generic": [f for f in kernel_units if f.name.startswith("generic_")],
        "flash_fwd": [f for f in kernel_units if f.name.startswith("flash_fwd_")],
        "flash_bwd": [f for f in kernel_units if f.name.startswith("flash_bwd_")],
        "dispatch": [f for f in kernel_units if not f.name.startswith(("generic_", "flash_"))],
    }
    torch_host = [HERE / f for f in ("emulator_ops.cpp", "emulator_selftest.cpp", "guarded_memory.cpp")] + \
        [CSRC / "ops" / "attention_binding.cpp", CSRC / "ops" / "verified_inputs.cpp"]
    sources = []
    for group, files in groups.items():
        sources.append(_unity_file(build_dir / f"emulated_{group}.cpp", ["simt_emulator.h", *files]))
    sources.append(_unity_file(build_dir / "emulator_host.cpp", torch_host))
    sources.append(str(HERE / "emulator_runtime.cpp"))

    # -O1: the build is the emulator tests' largest cost, and -O2 doubles the flash forward's unit
    # (~90 instead of ~50 s of a core) without making the emulated kernels measurably faster.
    cflags = [
        "-std=c++20", "-O1", "-g0", "-pthread", "-fno-strict-aliasing",
        "-DATTN_EXPORT_SIMT_EMULATOR", "-Wno-attributes", "-Wno-unknown-pragmas",
    ] + (["-fsanitize=alignment"] if alignment_checked() else [])
    # -Bsymbolic: the CUDA runtime functions emulator_runtime.cpp defines must bind to those
    # definitions even when a CUDA build of torch has already loaded the real libcudart.
    ldflags = ["-pthread", "-Wl,-Bsymbolic"]
    if os.environ.get("ATTN_EXPORT_EMU_TSAN"):
        cflags += ["-fsanitize=thread", "-O1"]
        ldflags += ["-fsanitize=thread"]
    cpp_extension.load(
        name=name,
        sources=sources,
        extra_include_paths=[str(HERE), str(CSRC), str(include)],
        extra_cflags=cflags,
        extra_ldflags=ldflags,
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=verbose,
    )
    return torch.ops.attn_export_emu


H200_SMS = 132  # the multiprocessor count the emulated device reports unless a test sets another


def ops_restored_after():
    """A fixture body: the emulator's ops, and afterwards its preview switch as it was and its
    multiprocessor count back at an H200's, for the tests that change them."""
    ops = load()
    before = ops.preview_enabled()
    yield ops
    ops.set_preview(before)
    ops.set_sm_count(H200_SMS)
