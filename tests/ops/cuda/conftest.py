"""Fixtures of the CUDA emulator's test files (tests/ops/cuda/test_cuda_*.py)."""
import pytest


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
