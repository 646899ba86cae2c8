"""The validation engine: passes the honest export, FAILS a corrupted one, reports what failed,
and its tolerances, NaN rule, dynamic-axis check, JSON and JUnit behave as documented."""
import json
import math
import xml.etree.ElementTree as ET

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from attn_export.errors import InputError
from attn_export.inputs import padding_mask, resize
from attn_export.onnx import export_onnx
from attn_export.validation import compare, shape_cases, tolerance, validate
from attn_export.validation.runners import OnnxRuntimeRunner

FP32_EPS = 2.0 ** -23


def documented_rtol(model, shapes):
    """docs/validation.md, written independently of the gate: rtol = 8 * eps(fp32) * sqrt(K), K
    the widest contraction (Linear in_features, LayerNorm size) or the longest sequence."""
    widths = [m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
    widths += [m.normalized_shape[0] for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    widths += [shape[1] for shape in shapes.values() if len(shape) >= 2]
    return 8.0 * FP32_EPS * math.sqrt(max(widths))


@pytest.fixture(scope="module")
def honest_report(small_seq2seq, exported_seq2seq):
    return validate(small_seq2seq, exported_seq2seq.path, small_seq2seq.example_inputs)


def largest_initializer(model):
    return max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))


def corrupt(src, dst, how):
    model = onnx.load(str(src))
    init = largest_initializer(model)
    values = numpy_helper.to_array(init).copy()
    if how == "perturb":
        values += 1e-3 * values.std() * np.random.default_rng(0).standard_normal(values.shape).astype(values.dtype)
    elif how == "nan":
        values.flat[0] = np.nan
    init.CopyFrom(numpy_helper.from_array(values, init.name))
    onnx.save(model, str(dst))
    return init.name


def test_honest_export_passes_every_case(honest_report):
    report = honest_report
    assert report.passed, report.failures
    cases = {(c.case, c.backend) for c in report.cases}
    for case in ("example", "batch=1", "seq=1", "seq=odd", "seq=long"):
        for backend in ("pytorch-replaced", "onnxruntime"):
            assert (case, backend) in cases
    assert all(c.status == "passed" and c.max_abs_err <= c.atol for c in report.cases)
    # Independent lengths get different sizes; odd and long really are odd/long.
    odd = next(c for c in report.cases if c.case == "seq=odd")
    assert odd.shapes["src"][1] % 2 == 1 and odd.shapes["src"][1] != odd.shapes["tgt"][1]
    long = next(c for c in report.cases if c.case == "seq=long")
    assert long.shapes["src"][1] > 16
    assert {c.name for c in report.checks} >= {"dynamic axes", "attention function"}


def test_the_tolerance_has_the_documented_size_and_honest_errors_pass_with_margin(small_seq2seq, honest_report):
    for case in honest_report.cases:
        assert case.rtol == pytest.approx(documented_rtol(small_seq2seq, case.shapes), rel=1e-9), case
        assert case.max_rel_err <= case.rtol / 4, case  # measured here: ~50x below


def test_an_output_off_by_twice_the_tolerance_fails(small_seq2seq, exported_seq2seq, monkeypatch):
    """ONNX Runtime's outputs moved by 2x the documented tolerance at one element: every case
    fails (a factor 8 -> 64 would pass it); the PyTorch side, untouched, passes."""
    ort_run = OnnxRuntimeRunner.run

    def off_by_twice(self, inputs):
        outputs = [o.clone() for o in ort_run(self, inputs)]
        rtol = documented_rtol(small_seq2seq, {n: list(t.shape) for n, t in inputs.items()})
        for out in outputs:
            out.view(-1)[0] += 2.0 * rtol * float(out.abs().max())
        return outputs

    monkeypatch.setattr(OnnxRuntimeRunner, "run", off_by_twice)
    report = validate(small_seq2seq, exported_seq2seq.path, small_seq2seq.example_inputs)
    ort_cases = [c for c in report.cases if c.backend == "onnxruntime"]
    assert len(ort_cases) == 5 and all(c.status == "failed" for c in ort_cases)
    assert all(1.8 * c.rtol < c.max_rel_err < 2.2 * c.rtol for c in ort_cases)
    assert all(c.passed for c in report.cases if c.backend == "pytorch-replaced")
    assert not report.passed


@pytest.mark.parametrize("how", ["perturb", "nan"])
def test_corrupted_onnx_fails_and_says_where(small_seq2seq, exported_seq2seq, tmp_path, how):
    bad = tmp_path / f"{how}.onnx"
    corrupt(exported_seq2seq.path, bad, how)
    report = validate(small_seq2seq, bad, small_seq2seq.example_inputs)
    assert not report.passed
    ort_cases = [c for c in report.cases if c.backend == "onnxruntime"]
    assert ort_cases and all(c.status == "failed" for c in ort_cases)
    # The PyTorch side is untouched by the corruption and still passes.
    assert all(c.passed for c in report.cases if c.backend == "pytorch-replaced")
    if how == "nan":
        assert all(c.nan_mismatch > 0 for c in ort_cases)
        assert "NaN" in ort_cases[0].message
    else:
        assert all(c.max_rel_err > c.rtol for c in ort_cases)
    assert any("onnxruntime" in line for line in report.failures)


def test_json_report_has_the_documented_fields(honest_report):
    data = json.loads(honest_report.to_json())
    assert data["passed"] is True
    for key in ("torch", "onnx", "onnxruntime", "seed", "python"):
        assert key in data["environment"]
    case = data["cases"][0]
    for key in ("case", "backend", "output", "shapes", "max_abs_err", "max_rel_err", "atol", "rtol", "passed"):
        assert key in case
    assert data["tolerance"]["factor"] > 0 and "sqrt(K)" in data["tolerance"]["rule"]


def test_default_provider_is_the_cpu_and_the_report_says_so(honest_report):
    (entry,) = honest_report.environment["onnxruntime_execution_providers"]
    assert entry["backend"] == "onnxruntime" and entry["device"] == "cpu"
    assert entry["session_has"] == ["CPUExecutionProvider"] and entry["precision"] == "model dtype"
    assert honest_report.tolerance["compute_precision"] == {}
    # The CPU provider is judged by float32's eps, like the PyTorch rows.
    ort_rtol = {c.rtol for c in honest_report.cases if c.backend == "onnxruntime" and c.case == "example"}
    assert ort_rtol == {c.rtol for c in honest_report.cases if c.backend == "pytorch-replaced" and c.case == "example"}


def test_junit_xml_counts_cases_and_failures(small_seq2seq, exported_seq2seq, honest_report, tmp_path):
    root = ET.fromstring(honest_report.to_junit_xml().split("\n", 1)[1])
    suite = root.find("testsuite")
    assert int(suite.get("tests")) == len(honest_report.cases) + len(honest_report.checks)
    assert suite.get("failures") == "0" and suite.get("errors") == "0"
    bad = tmp_path / "bad.onnx"
    corrupt(exported_seq2seq.path, bad, "perturb")
    failing = validate(small_seq2seq, bad, small_seq2seq.example_inputs)
    suite = ET.fromstring(failing.to_junit_xml().split("\n", 1)[1]).find("testsuite")
    assert int(suite.get("failures")) == sum(1 for c in failing.cases if c.status == "failed") > 0
    assert suite.find("testcase/failure") is not None


def test_axes_declared_dynamic_but_static_in_the_graph_fail(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    inputs = {"src": torch.randn(2, 5, 16)}
    path = export_onnx(model, inputs, tmp_path / "static.onnx", dynamic_axes={}).path
    report = validate(model, path, inputs)  # the file's own metadata says: static on purpose
    assert report.passed and [c.case for c in report.cases] == ["example", "example"]
    report = validate(model, path, inputs, dynamic_axes={"src": {0: "batch", 1: "seq"}})
    check = next(c for c in report.checks if c.name == "dynamic axes")
    assert not report.passed and not check.passed and "src:0" in check.message and "src:1" in check.message


def test_missing_function_fails(small_seq2seq, exported_seq2seq, tmp_path):
    model = onnx.load(str(exported_seq2seq.path))
    del model.functions[:]
    bad = tmp_path / "nofunc.onnx"
    onnx.save(model, str(bad))
    report = validate(small_seq2seq, bad, small_seq2seq.example_inputs)
    assert not report.passed
    assert not next(c for c in report.checks if c.name == "attention function").passed
    assert all(c.status == "error" for c in report.cases if c.backend == "onnxruntime")


def test_inputs_the_model_rejects_are_an_input_error(small_seq2seq, exported_seq2seq):
    inputs = dict(small_seq2seq.example_inputs)
    inputs["src"] = torch.randn(2, 16, 5)  # wrong feature width
    with pytest.raises(InputError, match="rejected the example inputs"):
        validate(small_seq2seq, exported_seq2seq.path, inputs)
    with pytest.raises(InputError, match="no such file"):
        validate(small_seq2seq, "/nonexistent.onnx", small_seq2seq.example_inputs)


def test_compare_rules():
    ref = torch.tensor([1.0, -2.0, 0.5, float("nan")], dtype=torch.float64)
    ok = compare(ref + 1e-7, ref, rtol=1e-6)
    assert ok["passed"] and ok["max_abs_err"] == pytest.approx(1e-7, rel=0.1)
    assert not compare(ref + 1e-4, ref, rtol=1e-6)["passed"]
    nan_here = ref.clone()
    nan_here[0] = float("nan")
    result = compare(nan_here, ref, rtol=1.0)
    assert not result["passed"] and result["nan_mismatch"] == 1
    assert compare(torch.zeros(3), torch.zeros(2), 1.0)["passed"] is False
    assert compare(torch.tensor([1, 2]), torch.tensor([1, 3]), 0.0)["passed"] is False
    assert compare(torch.tensor([1, 2]), torch.tensor([1, 2]), 0.0)["passed"] is True


def test_tolerance_scales_with_dtype_and_reduction_length():
    fp32, fp16 = tolerance(torch.float32, 64), tolerance(torch.float16, 64)
    assert fp16 / fp32 == pytest.approx(torch.finfo(torch.float16).eps / torch.finfo(torch.float32).eps)
    assert tolerance(torch.float32, 256) / fp32 == pytest.approx(2.0)
    assert 1e-6 < fp32 < 1e-4


def test_shape_cases_cover_batch_one_seq_one_odd_and_long():
    cases = dict(shape_cases({"batch": 4, "seq": 7, "tgt_seq": 12}, {"batch": "batch", "seq": "seq", "tgt_seq": "seq"}))
    assert cases["batch=1"] == {"batch": 1}
    assert cases["seq=1"] == {"seq": 1, "tgt_seq": 1}
    assert cases["seq=odd"]["seq"] % 2 == 1 and cases["seq=odd"]["seq"] != 7
    assert cases["seq=odd"]["seq"] != cases["seq=odd"]["tgt_seq"]
    assert min(cases["seq=long"].values()) > 12


def test_generated_inputs_follow_the_example():
    gen_inputs = {
        "x": torch.randn(2, 6, 4) * 3 + 10,
        "ids": torch.randint(5, 9, (2, 6)),
        "pad": torch.tensor([[False] * 6, [False] * 4 + [True] * 2]),
        "keep": torch.tensor([[True] * 6, [True] * 3 + [False] * 3]),
    }
    axes = {n: {0: "batch", 1: "seq"} for n in gen_inputs}
    out = resize(gen_inputs, axes, {"batch": 5, "seq": 11}, seed=0)
    assert out["x"].shape == (5, 11, 4) and 5 < float(out["x"].mean()) < 15
    assert out["ids"].shape == (5, 11) and int(out["ids"].min()) >= 5 and int(out["ids"].max()) <= 8
    assert out["ids"].dtype == torch.int64
    # padding convention (true = padding) and valid convention (true = keep) are kept,
    # and every row keeps at least one visible key
    assert (~out["pad"]).any(-1).all() and out["pad"].any()
    assert out["keep"].any(-1).all() and (~out["keep"]).any()
    assert not out["pad"][:, 0].any() and out["keep"][:, 0].all()
    same = resize(gen_inputs, axes, {"batch": 2, "seq": 6})
    assert all(same[n] is gen_inputs[n] for n in gen_inputs)


def test_padding_mask_always_leaves_one_visible_key():
    gen = torch.Generator().manual_seed(0)
    for length in (1, 2, 17):
        mask = padding_mask((64, length), gen)
        assert (~mask).any(-1).all()
        assert not mask[0].any()  # one full row


def test_report_json_stays_valid_with_infinite_errors(honest_report):
    import copy

    report = copy.deepcopy(honest_report)
    report.cases[0].max_rel_err = math.inf
    data = json.loads(report.to_json())
    assert data["cases"][0]["max_rel_err"] == "inf"


def test_a_float64_model_is_validated_against_a_float32_reference(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval().double()
    inputs = {"src": torch.randn(2, 5, 16, dtype=torch.float64)}
    with pytest.raises(InputError, match="float64"):
        export_onnx(model, inputs, tmp_path / "d.onnx")
    path = export_onnx(model, inputs, tmp_path / "d.onnx", dtype="fp32").path
    assert validate(model, path, inputs).passed
