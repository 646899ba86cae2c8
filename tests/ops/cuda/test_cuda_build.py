"""Compile checks of the CUDA kernels that need no GPU: csrc/kernels/ builds alone with nvcc
(no torch, no TensorRT) through csrc/CMakeLists.txt, the generated instantiation files are
current, and nothing under csrc/kernels/ includes a framework header."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

pytestmark = pytest.mark.slow  # make test-fast leaves it out

ROOT = pathlib.Path(__file__).resolve().parents[3]
KERNELS = ROOT / "csrc" / "kernels"


def _nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    default = pathlib.Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    return str(default) if default.exists() else None


def _ninja():
    """Ninja from PATH or beside this interpreter (make install puts it in .venv/bin)."""
    beside = pathlib.Path(sys.executable).parent / "ninja"
    return shutil.which("ninja") or (str(beside) if beside.exists() else None)


def test_kernels_include_no_framework_headers():
    banned = re.compile(r'#\s*include\s*[<"](torch/|ATen/|c10/|NvInfer|pybind11/|Python\.h)')
    offenders = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted(KERNELS.rglob("*")) if path.suffix in {".h", ".cuh", ".cu", ".cpp"}
        for n, line in enumerate(path.read_text().splitlines(), 1) if banned.search(line)
    ]
    assert not offenders, "framework headers under csrc/kernels/:\n" + "\n".join(offenders)


def test_generated_instantiations_are_current():
    script = KERNELS / "cuda" / "generate_kernels.py"
    spec = importlib.util.spec_from_file_location("generate_kernels", script)
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    expected = generate.all_files()
    folder = KERNELS / "cuda" / "instantiations"
    assert generate.OUT == folder
    for name, text in expected.items():
        path = folder / name
        assert path.exists() and path.read_text() == text, f"{name} differs from what {script.name} writes: rerun it"
    generated_on_disk = {p.name for p in (KERNELS / "cuda").rglob("*.cu") if "Auto-generated" in p.read_text()[:200]}
    assert generated_on_disk == set(expected), f"stale generated files: {sorted(generated_on_disk - set(expected))}"
    hand_written = {p.name for p in folder.iterdir()} - set(expected)
    assert not hand_written, f"{folder.name}/ holds only generated files; move these out: {sorted(hand_written)}"
    misplaced = {p.name for p in (KERNELS / "cuda").glob("*.cu") if "Auto-generated" in p.read_text()[:200]}
    assert not misplaced, f"generated files outside {folder.name}/: {sorted(misplaced)}"


# The architectures CI builds the kernels for, and the spill gate reads: sm_80 alone. sm_90 compiles
# the same source through the same `__CUDA_ARCH__ >= 800` branches at the same cost again (the
# whole build is the largest part of CI's time), and no flash kernel has spilled on sm_90 but not
# on sm_80 so far (docs/cuda.md). ATTN_EXPORT_CUDA_ARCHS="80;90" builds and gates both
# (docs/testing.md: before a release, and after a change of tiles).
CI_ARCHS = "80"
# The sm_80 flash instantiations CI compiles: 6 of the 60, every kernel (the forward packed and
# not, with its split-KV variants; the 128-row forward; the backward with its column split and the
# verified unsplit tiles), both element types of each, causal and not.
CI_FLASH_UNITS = (
    "flash_fwd_hdim64_fp16_causal.cu", "flash_fwd_hdim128_fp16.cu", "flash_fwd_hdim64_bf16_wide.cu",
    "flash_bwd_hdim64_fp16.cu", "flash_bwd_hdim128_bf16_unsplit_causal.cu", "flash_bwd_hdim128_fp16.cu",
)
# `make test-all` (exhaustive) also gates 15 of the 60: every head dim of the forward and the
# backward (a head dim is a tile choice of its own, kernel_traits.h). Compiling all 60 is minutes
# more (their split-KV kernels above all); ATTN_EXPORT_CUDA_UNITS=all compiles and gates every one
# (docs/testing.md: before a release, and after a change of tiles or of a kernel's code).
EVERY_HEAD_DIM_UNITS = (
    "flash_fwd_hdim32_fp16_wide_causal.cu", "flash_fwd_hdim32_bf16.cu", "flash_fwd_hdim64_fp16_causal.cu",
    "flash_fwd_hdim64_bf16_wide.cu", "flash_fwd_hdim96_bf16_causal.cu", "flash_fwd_hdim128_fp16.cu",
    "flash_fwd_hdim192_bf16_causal.cu", "flash_fwd_hdim256_fp16.cu",
    "flash_bwd_hdim32_bf16_causal.cu", "flash_bwd_hdim64_fp16.cu", "flash_bwd_hdim96_fp16_causal.cu",
    "flash_bwd_hdim128_bf16_unsplit_causal.cu", "flash_bwd_hdim128_fp16.cu", "flash_bwd_hdim192_fp16_causal.cu",
    "flash_bwd_hdim256_bf16.cu",
)
UNIT_SETS = {"ci": CI_FLASH_UNITS, "every-head-dim": EVERY_HEAD_DIM_UNITS}


def flash_units(unit_set: str = "ci") -> list:
    """The flash instantiations a build compiles: a set of UNIT_SETS (ATTN_EXPORT_CUDA_UNITS=all:
    every one)."""
    every = sorted((KERNELS / "cuda" / "instantiations").glob("flash_*.cu"))
    if os.environ.get("ATTN_EXPORT_CUDA_UNITS") == "all":
        return every
    return [u for u in every if u.name in UNIT_SETS[unit_set]]


@dataclass(frozen=True)
class KernelBuild:
    library: pathlib.Path
    log: str  # the build's output: ptxas's register report of every kernel (-Xptxas -v)
    archs: str
    units: tuple  # the flash instantiations it compiled (pathlib.Path)


@pytest.mark.parametrize("unit_set", list(UNIT_SETS))
def test_the_unit_sets_cover_every_kind_of_flash_unit(unit_set):
    """Each set names files that exist and, between them, both element types of the forward and
    the backward, causal and not, the 128-row forward, and the backward's split and verified
    unsplit tiles; the exhaustive set also every head dim of each."""
    every = {u.name for u in (KERNELS / "cuda" / "instantiations").glob("flash_*.cu")}
    chosen = set(UNIT_SETS[unit_set])
    assert chosen <= every, sorted(chosen - every)
    for kind in ("fwd", "bwd"):
        dims = {re.search(r"hdim(\d+)", u).group(1) for u in every if u.startswith(f"flash_{kind}_")}
        if unit_set == "every-head-dim":
            assert dims == {re.search(r"hdim(\d+)", u).group(1) for u in chosen if u.startswith(f"flash_{kind}_")}, kind
        for feature in ("_fp16", "_bf16", "_causal"):
            assert any(feature in u for u in chosen if u.startswith(f"flash_{kind}_")), (kind, feature)
        assert any("_causal" not in u for u in chosen if u.startswith(f"flash_{kind}_")), kind
    assert any("_wide" in u for u in chosen) and any("_unsplit" in u for u in chosen)
    assert any(u.startswith("flash_bwd_hdim128_") and "_unsplit" not in u for u in chosen)


@pytest.fixture(scope="module", params=[pytest.param("ci"),
                                        pytest.param("every-head-dim", marks=pytest.mark.exhaustive)])
def kernel_build(tmp_path_factory, request) -> KernelBuild:
    """`cmake -S csrc -B build -DCMAKE_CUDA_ARCHITECTURES=80 && cmake --build build`, the library a
    TensorRT plugin links, built once for this file with `-Xptxas -v`: the compile check and the
    spill gate read the same build."""
    ninja = _ninja()
    if _nvcc() is None or shutil.which("cmake") is None or ninja is None:
        pytest.skip("needs nvcc, cmake and ninja")
    archs = os.environ.get("ATTN_EXPORT_CUDA_ARCHS", CI_ARCHS)
    units = flash_units(request.param)
    env = dict(os.environ, CUDACXX=_nvcc())
    build = tmp_path_factory.mktemp("kernels") / "build"
    start = time.monotonic()
    # Ninja prints each command's output whole when it ends, so the parallel compilers' ptxas
    # reports do not interleave (make's would, and a spill could be read against another kernel).
    subprocess.run(["cmake", "-S", str(ROOT / "csrc"), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
                    f"-DCMAKE_CUDA_ARCHITECTURES={archs}", "-DCMAKE_CUDA_FLAGS=-Xptxas=-v",
                    "-DATTN_EXPORT_FLASH_UNITS=" + ";".join(u.name for u in units)],
                   check=True, env=env, capture_output=True, text=True)
    result = subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)], env=env,
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    print(f"built the kernels ({len(units)} flash units) for sm_{archs} in {time.monotonic() - start:.0f} s")
    return KernelBuild(build / "libattn_export_cuda_kernels.a", result.stdout + result.stderr, archs, tuple(units))


@pytest.mark.slow
def test_cmake_builds_the_kernels_without_torch(kernel_build):
    """csrc/CMakeLists.txt builds the kernels alone (nvcc and the CUDA runtime, no torch): the
    compile check CI runs on its GPU-less machine."""
    assert kernel_build.library.exists()
    assert ptxas_spills(kernel_build.log), "the build log has no ptxas report: -Xptxas -v did not reach nvcc"


# ---- Spill gate: the flash kernels keep their tiles in registers; a spill to local memory is a
# tile choice that no longer fits (kernel_traits.h) and costs speed no test here would see.
# The head-dim-128 backward on the tiles verified on a GPU at f427ebe (4 warps, no column split:
# kernel_traits.h kFlashBwdUnsplitHeadDim), which the default dispatch keeps: it spilled then
# (16 B stores, 32-96 B loads) and ran at the measured speed; it may spill up to that, no more.
VERIFIED_TILES = "FlashBwdTraitsILi128ELi1EE"
VERIFIED_TILES_SPILL_LIMIT = 96
_PTXAS_ENTRY = re.compile(
    r"Compiling entry function '(?P<name>[^']+)' for '(?P<arch>sm_\d+a?)'.*?"
    r"(?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads", re.S)


def ptxas_spills(ptxas_log: str) -> dict[tuple[str, str], tuple[int, int]]:
    """{(kernel, sm_XX): (spill store bytes, spill load bytes)} from nvcc -Xptxas -v's log."""
    return {(m["name"], m["arch"]): (int(m["stores"]), int(m["loads"])) for m in _PTXAS_ENTRY.finditer(ptxas_log)}


_PTXAS_STACK = re.compile(
    r"Compiling entry function '(?P<name>[^']+)' for '(?P<arch>sm_\d+a?)'.*?(?P<stack>\d+) bytes stack frame", re.S)


def ptxas_stack_frames(ptxas_log: str) -> dict[tuple[str, str], int]:
    """{(kernel, sm_XX): stack frame bytes} from nvcc -Xptxas -v's log."""
    return {(m["name"], m["arch"]): int(m["stack"]) for m in _PTXAS_STACK.finditer(ptxas_log)}


def test_ptxas_spills_are_parsed():
    log = ("ptxas info    : Compiling entry function '_Z3fooILi1EEvv' for 'sm_90'\n"
           "ptxas info    : Function properties for _Z3fooILi1EEvv\n"
           "    16 bytes stack frame, 16 bytes spill stores, 96 bytes spill loads\n"
           "ptxas info    : Compiling entry function '_Z3barv' for 'sm_80'\n"
           "ptxas info    : Function properties for _Z3barv\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    assert ptxas_spills(log) == {("_Z3fooILi1EEvv", "sm_90"): (16, 96), ("_Z3barv", "sm_80"): (0, 0)}
    assert ptxas_stack_frames(log) == {("_Z3fooILi1EEvv", "sm_90"): 16, ("_Z3barv", "sm_80"): 0}


def test_flash_kernels_do_not_spill(kernel_build):
    """Every flash instantiation built (instantiations/flash_*.cu: the forward packed and not, their
    split-KV variants and the combine kernel, the 128-row prefill forward, the backward) in the kernels' build with `-Xptxas -v`,
    for each architecture it targets (sm_80 in CI): no kernel may spill but the verified
    head-dim-128 backward tiles, up to their f427ebe spill."""
    units = kernel_build.units
    assert units
    archs = {f"sm_{a}" for a in kernel_build.archs.split(";")}
    # The flash units' kernels: everything but the CUDA-core path (generic_kernels.cu).
    spills = {key: n for key, n in ptxas_spills(kernel_build.log).items() if "generic_" not in key[0]}
    # One backward kernel per file; per forward file two (grouped query heads packed or not,
    # flash_fwd_kernel.cuh kPackGqa), each with its split-KV variant; one per 128-row forward
    # file (`_wide`: prefill only, neither packed nor split).
    forwards = len([u for u in units if u.name.startswith("flash_fwd_") and "_wide" not in u.name])
    kernels = {name for name, _ in spills if "flash_fwd_kernel" in name or "flash_bwd_kernel" in name}
    assert len(kernels) == len(units) + forwards, f"expected {len(units) + forwards} flash kernels, found {len(kernels)}"
    split = {name for name, _ in spills if "flash_fwd_split_kernel" in name}
    assert len(split) == 2 * forwards, f"found {len(split)} split-KV kernels"
    assert {arch for _, arch in spills} == archs
    allowed = {key: VERIFIED_TILES_SPILL_LIMIT if VERIFIED_TILES in key[0] else 0 for key in spills}
    verified = len([u for u in units if u.name.startswith("flash_bwd_hdim128_") and "_unsplit" in u.name])
    assert sum(VERIFIED_TILES in name for name, _ in spills) == verified * len(archs)
    spilling = [f"{name} on {arch}: {stores} bytes spill stores, {loads} bytes spill loads"
                for (name, arch), (stores, loads) in sorted(spills.items())
                if max(stores, loads) > allowed[(name, arch)]]
    assert not spilling, "flash kernels spill registers (choose smaller tiles in kernel_traits.h):\n" + "\n".join(spilling)


def test_flash_kernels_keep_their_arrays_in_registers(kernel_build):
    """No flash kernel (forward packed or not, split-KV or not, backward) has a stack frame but the
    verified head-dim-128 backward tiles, whose frame holds their allowed spills: a tile array the
    compiler failed to unroll over lands in local memory without a spill being reported (the
    split-KV kernels once did, with ten times the code and compile time of the others)."""
    frames = {key: n for key, n in ptxas_stack_frames(kernel_build.log).items()
              if ("flash_fwd_" in key[0] or "flash_bwd_kernel" in key[0]) and VERIFIED_TILES not in key[0]}
    assert any("flash_fwd_split_kernel" in name for name, _ in frames) and any("flash_bwd_" in n for n, _ in frames)
    on_stack = [f"{name} on {arch}: {n} bytes stack frame" for (name, arch), n in sorted(frames.items()) if n]
    assert not on_stack, "flash kernels keep arrays in local memory (an index the compiler could not fold):\n" + \
        "\n".join(on_stack)
