"""The benchmarks of docs/benchmarks.md: tooling of the checkout, not part of the package.
Run from the repository root (``python -m benchmarks.run --help``, ``make bench``); results
go to benchmarks/results/."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict:
    """The environment of a measuring child process (``python -m benchmarks.X``): this checkout
    importable wherever the parent was started."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
