"""The Hopper GPU tests' quick tier (`-m sm90_quick`, gpu_check.sh's sm90quick step) on the CPU:
it selects exactly the cases each module's SM90_QUICK lists, and at least one case of every test
function of the two files, so a new test cannot drop out of the first GPU call silently."""
from __future__ import annotations

import collections
import inspect
import pathlib
import subprocess
import sys

import test_cuda_sm90
import test_cuda_sm90_bwd

ROOT = pathlib.Path(__file__).resolve().parents[3]
MODULES = (test_cuda_sm90, test_cuda_sm90_bwd)
# The estimate in docs/testing.md ("The next GPU session, call by call") counts these cases.
MOST_CASES = 60


def _quick_ids() -> list[str]:
    files = [str(pathlib.Path(m.__file__).relative_to(ROOT)) for m in MODULES]
    ran = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "sm90_quick", *files], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    return [line for line in ran.stdout.splitlines() if "::test_" in line]


def test_quick_tier_selects_each_listed_case_once_and_every_test_function():
    # (module, test function) of each selected case
    selected = collections.Counter((pathlib.Path(line.split("::")[0]).stem, line.split("::")[1].split("[")[0])
                                   for line in _quick_ids())
    for module in MODULES:
        listed = collections.Counter(name for name, _ in module.SM90_QUICK)
        functions = {name for name, f in inspect.getmembers(module, inspect.isfunction)
                     if name.startswith("test_") and f.__module__ == module.__name__}
        assert functions, module.__name__
        missing = sorted(functions - set(listed))
        assert not missing, f"{module.__name__}: no SM90_QUICK case for {missing}: add one (tests/conftest.py)"
        unknown = sorted(set(listed) - functions)
        assert not unknown, f"{module.__name__}: SM90_QUICK names no test {unknown}"
        for name, count in listed.items():
            # one collected case per entry: an entry that matches none (a parameter value renamed)
            # or several (too few parameters given) shows here
            got = selected[module.__name__, name]
            assert got == count, f"{module.__name__}::{name}: {count} SM90_QUICK entries select {got} cases"
    assert sum(selected.values()) <= MOST_CASES, "the quick tier grew past its time estimate: re-estimate it"
