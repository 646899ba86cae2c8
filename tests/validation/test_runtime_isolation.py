"""A runtime that crashes or hangs must not take the parity gate with it.

ONNX Runtime runs in a child process (attn_export.validation.isolation): a segfault while it
loads or runs a model, or a hang past the time limit, is a failed case naming the runtime, the
step, the signal or timeout and the optimization level, with exit 1 and the reports written,
plus a diagnosis of the optimization levels that do load the model.

The crash used here is real: ONNX Runtime 1.32 (CPU) segfaults at ORT_ENABLE_ALL on a graph
input that feeds Transpose(perm=[1, 0, 2]) -> an fp16 MatMul with a constant weight
(docs/onnx_node.md). attn-export's own sequence-first translation used to write that pattern,
and user models write it too; the exporter now never does (``test_export_never_writes_...``),
so the crashing file here is written by hand. ``test_the_two_node_reproduction_still_crashes``
notices when ONNX Runtime fixes the bug.
"""
import json
import os
import signal
import sys
import xml.etree.ElementTree as ET

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from attn_export.validation import OnnxRuntimeRunner, RunnerError, validate
from attn_export.validation.isolation import RuntimeCrash, WorkerProcess
from helpers import run

ORT_LEVELS_THAT_LOAD = ["ORT_ENABLE_EXTENDED", "ORT_ENABLE_BASIC", "ORT_DISABLE_ALL"]


def fixture_weight() -> np.ndarray:
    return (np.arange(64 * 192, dtype=np.float32).reshape(64, 192) % 7 / 7 - 0.5).astype(np.float16)


def transpose_matmul_graph(path) -> None:
    """The smallest graph found that segfaults ONNX Runtime 1.32 at ORT_ENABLE_ALL:
    x: float16[seq, batch, 64] (graph input) -> Transpose([1, 0, 2]) -> MatMul(., W fp16 [64, 192])."""
    w = numpy_helper.from_array(fixture_weight(), "W")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["seq", "batch", 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", "seq", 192])
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]), helper.make_node("MatMul", ["t", "W"], ["y"])]
    graph = helper.make_graph(nodes, "ort_transpose_input_matmul_fp16", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))


class TransposeMatMul(nn.Module):
    """What transpose_matmul_graph computes, in PyTorch: the original model of that file."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.from_numpy(fixture_weight().astype(np.float32)))

    def forward(self, x):
        return x.transpose(0, 1) @ self.w


class TransposeLinear(nn.Module):
    """A user's model with the same pattern (no attention layer: attn-export exports it as it is)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.proj(x.transpose(0, 1))


def build_transpose_matmul():
    return TransposeMatMul()


def _load(path, level="ORT_ENABLE_ALL", timeout_s=120.0):
    worker = WorkerProcess(timeout_s)
    try:
        return worker.load("onnxruntime", optimization_level=level, path=str(path), providers=["CPUExecutionProvider"])
    finally:
        worker.close()


def test_the_two_node_reproduction_still_crashes(tmp_path):
    """Notices an ONNX Runtime that fixed the bug (then the exporter's workaround, projecting
    before the transpose, is no longer needed for it)."""
    path = tmp_path / "repro.onnx"
    transpose_matmul_graph(path)
    for level in ORT_LEVELS_THAT_LOAD:
        assert _load(path, level)["outputs"] == ["y"]
    try:
        _load(path)
    except RuntimeCrash as exc:
        assert exc.info.kind == "signal" and exc.info.step == "load"
        assert exc.info.optimization_level == "ORT_ENABLE_ALL"
        return
    pytest.skip(f"onnxruntime {onnxruntime.__version__} no longer crashes on the issue-18 reproduction: "
                "note it in docs/onnx_node.md")


def test_a_signal_is_reported_with_its_name_and_the_next_case_gets_a_fresh_process(tmp_path):
    path = tmp_path / "ok.onnx"
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    model = helper.make_model(helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    onnx.save(model, str(path))
    runner = OnnxRuntimeRunner(path)
    runner.load()
    try:
        feeds = {"x": torch.arange(3.0)}
        assert torch.equal(runner.run(feeds)[0], -feeds["x"])
        worker = runner._worker
        os.kill(worker._proc.pid, signal.SIGSEGV)
        worker._proc.wait()
        with pytest.raises(RuntimeCrash, match=r"onnxruntime crashed \(SIGSEGV\) while running the model"):
            worker.run({"x": feeds["x"].numpy()})
        assert torch.equal(runner.run(feeds)[0], -feeds["x"])  # a fresh process
    finally:
        runner.close()


def test_a_hang_past_the_limit_is_a_timeout(tmp_path):
    """A child that cannot even start within the limit stands in for a hang."""
    from attn_export.validation import isolation

    path = tmp_path / "repro.onnx"
    transpose_matmul_graph(path)
    isolation._close_idle_workers()  # no warm worker: a fresh interpreter takes far more than 1 ms
    runner = OnnxRuntimeRunner(path, optimization_level="ORT_DISABLE_ALL", timeout_s=0.001)
    with pytest.raises(RunnerError) as err:
        runner.load()
    assert err.value.step == "load" and err.value.crash.kind == "timeout"
    assert "onnxruntime timed out after 0.001 s while loading the model" in str(err.value)
    assert not runner._worker  # nothing left running


def test_a_healthy_worker_serves_the_next_gate_and_a_crashed_one_does_not(tmp_path):
    from attn_export.validation import isolation

    path = tmp_path / "repro.onnx"
    transpose_matmul_graph(path)
    first = OnnxRuntimeRunner(path, optimization_level="ORT_ENABLE_EXTENDED")
    first.load()
    pid = first._worker._proc.pid
    first.close()
    second = OnnxRuntimeRunner(path, optimization_level="ORT_ENABLE_ALL")
    with pytest.raises(RunnerError) as err:
        second.load()  # the same process, which this model then crashes
    assert err.value.crash.detail == "SIGSEGV"
    third = OnnxRuntimeRunner(path, optimization_level="ORT_DISABLE_ALL")
    third.load()
    try:
        assert third._worker._proc.pid != pid  # the crashed process was not kept
    finally:
        third.close()
    assert isolation._IDLE["onnxruntime"].alive


def test_an_ordinary_load_error_stays_an_error_message(tmp_path):
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"not onnx")
    with pytest.raises(RunnerError, match="ONNX Runtime cannot load the model") as err:
        OnnxRuntimeRunner(path).load()
    assert err.value.crash is None


def test_export_never_writes_the_crashing_pattern(tmp_path):
    """The exporter moves such a projection before the transpose: the file loads at
    ONNX Runtime's default level and validates."""
    from attn_export.onnx import export_onnx

    torch.manual_seed(0)
    model = TransposeLinear()
    inputs = {"x": torch.randn(5, 2, 64)}
    path = tmp_path / "m.onnx"
    result = export_onnx(model, inputs, path, dtype="fp16", dynamic_axes={"x": {0: "seq", 1: "batch"}}, replace=False)
    assert any("before the transpose" in note for note in result.notes)
    graph = onnx.load(str(path)).graph
    assert not [n for n in graph.node if n.op_type == "Transpose" and n.input[0] == "x"]
    assert _load(path)["outputs"] == ["output"]
    report = validate(model, path, inputs)
    assert report.passed, report.failures
    assert not report.diagnosis


def test_validate_turns_the_crash_into_a_failed_case_with_a_diagnosis(tmp_path):
    model = TransposeMatMul()
    inputs = {"x": torch.randn(5, 2, 64)}
    path = tmp_path / "repro.onnx"
    transpose_matmul_graph(path)
    report = validate(model, path, inputs)
    assert not report.passed
    crashed = [c for c in report.cases if c.crash]
    assert len(crashed) == 1 and crashed[0].backend == "onnxruntime" and crashed[0].status == "error"
    assert crashed[0].crash == {**crashed[0].crash, "runtime": "onnxruntime", "step": "load", "kind": "signal",
                                "detail": "SIGSEGV", "optimization_level": "ORT_ENABLE_ALL"}
    assert report.diagnosis["working_levels"] == ORT_LEVELS_THAT_LOAD
    assert "graph_optimization_level = ORT_ENABLE_EXTENDED" in report.diagnosis["summary"]
    assert any(c.backend == "pytorch-replaced" and c.status == "passed" for c in report.cases)


@pytest.mark.slow  # a console-script run; in process: test_validate_turns_the_crash_into_a_failed_case_with_a_diagnosis
def test_cli_exits_1_with_reports_when_onnxruntime_crashes(tmp_path):
    path = tmp_path / "repro.onnx"
    transpose_matmul_graph(path)
    proc = run("validate", "--model", "test_runtime_isolation:build_transpose_matmul", path,
               "--input", "x:5x2x64", "--json", tmp_path / "r.json", "--junit", tmp_path / "r.xml", cwd=tmp_path,
               env={"PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "FAILED: all / onnxruntime / *: onnxruntime crashed (SIGSEGV) while loading the model" in proc.stderr
    assert "at optimization level ORT_ENABLE_ALL" in proc.stderr
    assert "loads and runs the model at ORT_ENABLE_EXTENDED" in proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] is False and report["diagnosis"]["levels"]["ORT_ENABLE_BASIC"] == "ok"
    assert report["environment"]["onnxruntime_optimization_level"] == "ORT_ENABLE_ALL"
    junit = ET.parse(tmp_path / "r.xml").getroot()
    errors = junit.findall(".//testcase[@classname='attn_export.validate.onnxruntime']/error")
    assert errors and "SIGSEGV" in errors[0].get("message")


@pytest.mark.slow  # an end-to-end fp16 console-script run; the pattern: test_export_never_writes_the_crashing_pattern
def test_the_reported_model_converts_and_validates(tmp_path):
    """The reproduction of a crash as first reported: a sequence-first fp16 encoder with a key-padding
    mask used to segfault ONNX Runtime at its default level (exit 139, no report)."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=False), 2,
                                  enable_nested_tensor=False).eval()
    torch.save(model, tmp_path / "enc.pt")
    proc = run(tmp_path / "enc.pt", "--to", "onnx", "--input", "src:17x2x64",
               "--input", "src_key_padding_mask:2x17:bool", "--dynamic", "src:0=seq", "--dynamic", "src:1=batch",
               "--dynamic", "src_key_padding_mask:0=batch", "--dynamic", "src_key_padding_mask:1=seq",
               "--dtype", "fp16", "--json", tmp_path / "r.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    ran = [c for c in report["cases"] if c["backend"] == "onnxruntime"]
    assert len(ran) == 5 and all(c["status"] == "passed" for c in ran)
    assert _load(tmp_path / "enc.onnx")["outputs"] == ["output"]


def test_a_warm_worker_resolves_relative_paths_from_the_callers_directory(tmp_path, monkeypatch):
    """The kept worker was started elsewhere: a relative ONNX path must still mean the
    caller's file."""
    from attn_export.validation import isolation

    isolation.prestart("onnxruntime")  # started in this directory ...
    (tmp_path / "d").mkdir()
    transpose_matmul_graph(tmp_path / "d" / "rel.onnx")
    monkeypatch.chdir(tmp_path / "d")  # ... used from another
    runner = OnnxRuntimeRunner("rel.onnx", optimization_level="ORT_DISABLE_ALL")
    runner.load()
    try:
        assert runner.run({"x": torch.zeros(3, 2, 64)})[0].shape == (2, 3, 192)
    finally:
        runner.close()
