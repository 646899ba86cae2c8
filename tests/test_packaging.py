"""Packaging: the build explains itself when PyTorch is missing."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python_without_torch():
    """The interpreter this virtual environment was made from, when it has no torch of its own."""
    base = getattr(sys, "_base_executable", None)
    if not base or sys.prefix == sys.base_prefix:  # not in a virtual environment
        return None
    probe = subprocess.run([base, "-c", "import torch"], capture_output=True, cwd="/")
    return None if probe.returncode == 0 else base


def test_build_without_torch_says_what_to_install():
    python = _python_without_torch()
    if python is None:
        pytest.skip("no interpreter without torch on this machine")
    proc = subprocess.run([python, "setup.py", "--name"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0
    assert "PyTorch was not found" in proc.stderr
    assert "--no-build-isolation" in proc.stderr
