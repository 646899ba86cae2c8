#!/usr/bin/env python
"""The CPU benchmark of docs/benchmarks.md; same as `attn-export bench`, with the same options.

    python scripts/bench_cpu.py --shapes all --rounds 7 --markdown docs/bench_cpu.md
"""
from attn_export.cli.bench import bench

if __name__ == "__main__":
    bench(prog_name="bench_cpu.py")
