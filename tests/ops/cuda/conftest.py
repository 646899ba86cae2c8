"""Fixtures of the CUDA emulator's test files (tests/ops/cuda/test_cuda_*.py)."""
import zlib

import pytest

CONFIGURATIONS = ("late-sm90", "early-sm80")  # test_cuda_emulator.py's emu fixture


def pytest_collection_modifyitems(items):
    """CI runs each flash-kernel case of test_cuda_emulator.py under one of the emu fixture's two
    configurations, picked by a hash of the case, so that every test meets both; `make test-all`
    runs every case under both (exhaustive). A barrier missing between two warps fails some cases
    in one configuration and others in the other (docs/cuda.md, "Emulator"): half of them still
    run. The generic kernels' cases run once anyway (as late-sm90)."""
    from cuda_emulator.testing import runs_generic_kernels

    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or "emu" not in callspec.params or runs_generic_kernels(item.name, callspec.params):
            continue
        configuration = next(c for c in CONFIGURATIONS if c in callspec.id)
        case = item.nodeid.replace(configuration, "")
        if CONFIGURATIONS[zlib.crc32(case.encode()) % 2] != configuration:
            item.add_marker(pytest.mark.exhaustive)


@pytest.fixture(scope="module")
def emu_ops():
    """The emulated kernels (tests/ops/cuda/cuda_emulator), their preview switch and SM count restored
    when the module's tests are done."""
    from cuda_emulator.build import ops_restored_after

    yield from ops_restored_after()


@pytest.fixture
def preview(emu_ops):
    """The emulated kernels with the preview switch on; the SM count reset to the H200's after."""
    from cuda_emulator.build import H200_SMS

    emu_ops.set_preview(True)
    yield emu_ops
    emu_ops.set_sm_count(H200_SMS)
