"""The benchmarks' C probes (benchmarks/csrc/) live outside the shipped library: attn_export._C
exports none of their entry points, and the probes, built on demand, run the very _C the process
loaded (one copy: its thread pool, its GEMM backend in force)."""
import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from attn_export import _C
from attn_export.ops import gemm
from benchmarks import probes

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_library_exports_no_probe():
    names = probes.exported_names()
    assert {"attn_export_fma_peak_gflops", "attn_export_project_f32"} <= set(names)
    shipped = ctypes.CDLL(_C.__file__)
    assert [name for name in names if hasattr(shipped, name)] == []


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_every_c_entry_point_of_the_shipped_library_serves_the_package_or_its_tests():
    """A C entry point of _C that only a benchmark reads belongs in benchmarks/csrc/."""
    symbols = subprocess.run(["nm", "-D", "--defined-only", _C.__file__], capture_output=True, text=True,
                             check=True).stdout
    exported = set(re.findall(r"\s(attn_export_\w+)$", symbols, re.M))
    assert "attn_export_gemm_set" in exported  # the product's GEMM switch (attn_export/ops/gemm.py)
    readers = "".join(path.read_text() for folder in ("exporter", "tests/ops")
                      for path in (ROOT / folder).rglob("*.py"))
    assert sorted(name for name in exported if name not in readers) == []
    assert not re.search(r"fma_peak|project_f32", symbols)


def test_the_probes_run_the_loaded_extension():
    lib = probes.library()
    maps = Path("/proc/self/maps").read_text()
    assert len({line.split()[-1] for line in maps.splitlines() if line.endswith("/_C.so")}) == 1
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=generator) for shape in ((37, 24), (40, 24), (40,)))
    expected = torch.addmm(bias.double(), x.double(), weight.double().t()).float()
    before = gemm.gemm_backend()
    try:
        for backend in ("aten", "microkernel"):
            if gemm.available_backends()[backend]:
                continue
            gemm.set_gemm_backend(backend)
            out = torch.full((37, 40), float("nan"))
            lib.attn_export_project_f32(37, 40, 24, x.data_ptr(), weight.data_ptr(), bias.data_ptr(), out.data_ptr())
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    finally:
        gemm.set_gemm_backend("auto" if not before.forced else before.name)
