import sys
from pathlib import Path

# The benchmarks are a package of the checkout (benchmarks/), not of the install: importable from
# these tests however pytest was started.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
