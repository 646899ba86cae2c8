#!/usr/bin/env python
"""What running ONNX Runtime in a child process costs the parity gate.

The gate's ONNX Runtime backend loads the model in a child interpreter (worker.py) and sends
every case's inputs over a pipe. This times that backend (cold: a new child; warm: the worker
a previous gate left) against the same work done in this process (an InferenceSession, the
same cases), and a whole ``validate`` as shipped (the child starts first, so its start-up
overlaps PyTorch work) against ``validate`` with the old in-process backend, in this process
and in fresh processes as the CLI runs, side by side in rounds, on the bundled example model at
the gate's five shapes. Reports medians.

    python -m benchmarks.isolation [--rounds 7]
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
from attn_export.onnx import export_onnx
from attn_export.validation import OnnxRuntimeRunner, isolation, validate
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


def isolated(onnx_path, cases, cold: bool):
    if cold:  # no warm worker: the child's whole start-up (interpreter, ONNX Runtime import) is counted
        isolation._close_idle_workers()
    runner = OnnxRuntimeRunner(onnx_path)
    runner.load()
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


class InProcessOnnxRuntimeRunner(OnnxRuntimeRunner):
    """The gate's ONNX Runtime backend as it was before isolation: a session in this process."""

    def start(self) -> None:
        pass

    def load(self) -> None:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self._session = ort.InferenceSession(str(self.onnx_path), options, providers=self.providers)
        self._input_types = {v.name: _elem_type(v.type) for v in self._session.get_inputs()}

    def run(self, inputs):
        return [torch.from_numpy(np.asarray(o)) for o in self._session.run(None, feeds_for(self._input_types, inputs))]

    def close(self) -> None:
        self._session = None


def validate_in_process(model, path, inputs):
    from attn_export.validation import gate

    original = gate.OnnxRuntimeRunner
    gate.OnnxRuntimeRunner = InProcessOnnxRuntimeRunner
    try:
        return validate(model, path, inputs)
    finally:
        gate.OnnxRuntimeRunner = original


_COLD = """
import sys, time
sys.path.insert(0, {root!r})
start = time.perf_counter()
from benchmarks import isolation as b
from attn_export.examples import tiny_seq2seq
model = tiny_seq2seq()
(b.validate_in_process if {in_process!r} else b.validate)(model, {path!r}, model.example_inputs)
print(time.perf_counter() - start)
"""


def cold(path: Path, in_process: bool) -> float:
    """A fresh Python process, as the CLI runs: import, build the model, validate."""
    import subprocess
    import sys

    code = _COLD.format(root=str(Path(__file__).resolve().parents[1]), in_process=in_process, path=str(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


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
        times = {"in-process": [], "child process, cold start": [], "child process, warm worker": [],
                 "validate, ONNX Runtime in-process": [], "validate (as shipped)": []}
        for _ in range(args.rounds):
            for name, fn in (("in-process", lambda: in_process(path, cases)),
                             ("child process, cold start", lambda: isolated(path, cases, cold=True)),
                             ("child process, warm worker", lambda: isolated(path, cases, cold=False)),
                             ("validate, ONNX Runtime in-process", lambda: validate_in_process(model, path, inputs)),
                             ("validate (as shipped)", lambda: validate(model, path, inputs))):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
            for name, in_proc in (("fresh process: validate, ONNX Runtime in-process", True),
                                  ("fresh process: validate (as shipped)", False)):
                times.setdefault(name, []).append(cold(path, in_proc))
    print(f"CPU: {cpu_model()}, torch threads {torch.get_num_threads()}, "
          f"onnxruntime {ort.__version__}, {len(cases)} cases, {args.rounds} rounds")
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, value in med.items():
        print(f"  {name:50s} median {value * 1e3:8.1f} ms   (min {min(times[name]) * 1e3:8.1f} ms)")
    delta = med["child process, cold start"] - med["in-process"]
    print(f"  the backend alone, cold start, no overlap: {delta * 1e3:+.0f} ms")
    gate_delta = med["validate (as shipped)"] - med["validate, ONNX Runtime in-process"]
    print(f"  the whole gate, warm process: {gate_delta * 1e3:+.0f} ms = "
          f"{med['validate (as shipped)'] / med['validate, ONNX Runtime in-process']:.2f}x")
    a, b = med["fresh process: validate (as shipped)"], med["fresh process: validate, ONNX Runtime in-process"]
    print(f"  the whole gate, fresh process (the CLI): {(a - b) * 1e3:+.0f} ms = {a / b:.2f}x")


if __name__ == "__main__":
    main()
