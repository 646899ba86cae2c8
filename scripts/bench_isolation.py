#!/usr/bin/env python
"""What running ONNX Runtime in a child process costs the parity gate (issue 18).

The gate's ONNX Runtime backend loads the model in a fresh interpreter (worker.py) and sends
every case's inputs over a pipe. This times that backend against the same work done in this
process (an InferenceSession, the same cases), side by side in rounds, on the bundled example
model at the gate's five shapes, and times a whole ``validate`` for scale. Reports medians.

    python scripts/bench_isolation.py [--rounds 7]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from attn_export import inputs as _inputs
from attn_export import shapes as _shapes
from attn_export.examples import tiny_seq2seq
from attn_export.onnx_export import export_onnx
from attn_export.validation import OnnxRuntimeRunner, validate
from attn_export.validation.runners import _elem_type, feeds_for


def gate_cases(onnx_path, inputs):
    import onnx

    model = onnx.load(str(onnx_path))
    axes = _shapes.graph_axes(model, list(inputs))
    sizes = _inputs.label_sizes(inputs, axes)
    return [inputs if not o else _inputs.resize(inputs, axes, {**sizes, **o})
            for _, o in _shapes.shape_cases(sizes, _shapes.label_kinds(axes))]


def in_process(onnx_path, cases):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    types = {v.name: _elem_type(v.type) for v in session.get_inputs()}
    for case in cases:
        [torch.from_numpy(np.asarray(o)) for o in session.run(None, feeds_for(types, case))]


def isolated(onnx_path, cases):
    runner = OnnxRuntimeRunner(onnx_path)
    runner.load()  # without start(): the child's whole start-up is counted
    try:
        for case in cases:
            runner.run(case)
    finally:
        runner.close()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    model = tiny_seq2seq()
    inputs = model.example_inputs
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        export_onnx(model, inputs, path)
        cases = gate_cases(path, inputs)
        times = {"in-process": [], "child process": [], "validate (whole gate)": []}
        for _ in range(args.rounds):
            for name, fn in (("in-process", lambda: in_process(path, cases)),
                             ("child process", lambda: isolated(path, cases)),
                             ("validate (whole gate)", lambda: validate(model, path, inputs))):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    print(f"CPU: {cpu_model()}, torch threads {torch.get_num_threads()}, "
          f"onnxruntime {ort.__version__}, {len(cases)} cases, {args.rounds} rounds")
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, value in med.items():
        print(f"  {name:24s} median {value * 1e3:8.1f} ms   (min {min(times[name]) * 1e3:8.1f} ms)")
    delta = med["child process"] - med["in-process"]
    print(f"  isolation costs {delta * 1e3:.0f} ms per validation = {100 * delta / med['validate (whole gate)']:.1f}% "
          "of the whole gate")


if __name__ == "__main__":
    main()
