"""The console script as users run it: convert (as written), inspect, validate, exit codes,
errors as one line, no partial output files, safe loading."""
import json
import os
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from helpers import invoke, one_line_error, run

pytestmark = pytest.mark.slow  # make test-fast leaves it out

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """model.pt: a stock nn.TransformerEncoder (torch.nn only, loads with no flag) carrying its
    own example_inputs, and model.onnx exported from it by `attn-export model.pt --to onnx`."""
    d = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2).eval()
    model.example_inputs = {"src": torch.randn(2, 12, 32)}
    torch.save(model, d / "model.pt")
    proc = run("model.pt", "--to", "onnx", cwd=d)
    return d, proc


def test_convert_as_written_writes_model_onnx_beside_the_input(workdir):
    d, proc = workdir
    assert proc.returncode == 0, proc.stderr
    assert (d / "model.onnx").is_file()
    assert "PASSED" in proc.stdout and "onnxruntime" in proc.stdout and "seq=long" in proc.stdout
    assert "2 fused attention node(s)" in proc.stdout
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr
    model = onnx.load(str(d / "model.onnx"))
    assert [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim][:2] == ["batch", "seq"]
    assert sorted(p.name for p in d.iterdir()) == ["model.onnx", "model.pt"]  # no temporary leftovers


def test_validate_passes_then_fails_on_a_corrupted_onnx(workdir, tmp_path):
    d, _ = workdir
    ok = run("validate", d / "model.pt", d / "model.onnx", "--json", tmp_path / "ok.json",
             "--junit", tmp_path / "ok.xml", expect=0)
    assert "PASSED" in ok.stdout
    assert json.loads((tmp_path / "ok.json").read_text())["passed"] is True
    ET.parse(tmp_path / "ok.xml")

    model = onnx.load(str(d / "model.onnx"))
    init = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    values = numpy_helper.to_array(init).copy()
    values.flat[:: max(1, values.size // 10)] += 0.05  # a few weights nudged
    init.CopyFrom(numpy_helper.from_array(values, init.name))
    onnx.save(model, str(tmp_path / "bad.onnx"))
    bad = run("validate", d / "model.pt", tmp_path / "bad.onnx", "--json", tmp_path / "bad.json", expect=1)
    assert "FAILED" in bad.stderr and "onnxruntime" in bad.stderr
    report = json.loads((tmp_path / "bad.json").read_text())
    assert report["passed"] is False
    failed = [c for c in report["cases"] if not c["passed"]]
    assert failed and all(c["backend"] == "onnxruntime" for c in failed)
    assert all(c["max_abs_err"] > c["atol"] for c in failed)


def test_quiet_prints_nothing_and_reports_are_written(workdir, tmp_path):
    d, _ = workdir
    out = tmp_path / "q.onnx"
    proc = run("--quiet", d / "model.pt", "-o", out, "--static", "--json", tmp_path / "r.json",
               "--junit", tmp_path / "r.xml", expect=0)
    assert proc.stdout == "" and proc.stderr == ""
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["passed"] is True and data["export"]["dynamic_axes"] == {}
    assert [c["case"] for c in data["cases"]] == ["example", "example"]
    dims = onnx.load(str(out)).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [2, 12, 32]
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite.get("failures") == "0"


def test_inspect_lists_layers_and_the_coverage_gate(tmp_path):
    model = nn.ModuleDict({
        "encoder": nn.TransformerEncoderLayer(16, 2, 32, batch_first=True),
        "odd": nn.MultiheadAttention(16, 2, add_zero_attn=True),  # fused on the core operator, with a note
    })
    torch.save(model, tmp_path / "m.pt")
    proc = run("inspect", tmp_path / "m.pt", "--json", tmp_path / "i.json", expect=0)
    text = " ".join(proc.stdout.split())
    assert "encoder.self_attn" in text and "will be replaced" in text and "add_zero_attn" in text
    data = json.loads((tmp_path / "i.json").read_text())
    assert [(layer["path"], layer["num_heads"], layer["embed_dim"], layer["status"]) for layer in data["layers"]] == [
        ("encoder.self_attn", 2, 16, "will be replaced"), ("odd", 2, 16, "will be replaced")]
    assert invoke("inspect", tmp_path / "m.pt", "--require-all").returncode == 0
    assert invoke("inspect", tmp_path / "m.pt", "--min-replaced", "3").returncode == 1
    assert invoke("inspect", tmp_path / "m.pt", "--min-replaced", "2").returncode == 0
    # A layer that cannot be swapped: the model itself is the attention layer.
    torch.save(nn.MultiheadAttention(16, 2), tmp_path / "bare.pt")
    gate = invoke("inspect", tmp_path / "bare.pt", "--require-all")
    assert gate.returncode == 1 and "FAILED" in gate.stderr and "the model itself" in gate.stderr


def test_errors_are_one_line_with_exit_2_and_leave_no_file(workdir, tmp_path):
    d, _ = workdir
    model = d / "model.pt"
    # As a subprocess once, the rest in-process.
    one_line_error(run(tmp_path / "missing.pt", "--to", "onnx"), "no such file")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(model.read_bytes()[:5000])
    one_line_error(invoke(truncated, "--to", "onnx"), "corrupt or truncated")
    one_line_error(invoke(model, "-o", tmp_path / "w.onnx", "--input", "src:2x12x20"), "rejected the example inputs")
    one_line_error(invoke(model, "-o", tmp_path / "w.onnx", "--input", "source:2x12x32"), "unknown input name", "src")
    one_line_error(invoke(model, "-o", tmp_path / "w.onnx", "--input", "src:2by12"), "dimensions must be integers")
    one_line_error(invoke(model, "-o", tmp_path / "w.onnx", "--dynamic", "src:7=seq"), "only 3 dimensions")
    one_line_error(invoke(model, "-o", tmp_path / "no_dir" / "w.onnx"), "does not exist")
    one_line_error(invoke("validate", model), "MODEL and ONNX")
    one_line_error(invoke("validate", model, tmp_path / "missing.onnx"), "no such file")
    one_line_error(invoke("validate", model, truncated), "not a readable ONNX file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["truncated.pt"]


def test_unwritable_output_leaves_no_file(workdir, tmp_path):
    d, _ = workdir
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # root writes anywhere: use a pseudo file system
        target = Path("/proc/attn-export-test.onnx")
        one_line_error(invoke(d / "model.pt", "-o", target, "--no-validate"), "cannot write")
        assert not target.exists()
        return
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        one_line_error(invoke(d / "model.pt", "-o", locked / "m.onnx", "--no-validate"), "not writable")
    finally:
        locked.chmod(0o700)
    assert list(locked.iterdir()) == []


def test_verbose_shows_the_traceback(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_text("garbage")
    quiet = invoke(bad, "--to", "onnx")
    loud = invoke(bad, "--to", "onnx", "--verbose")
    assert quiet.returncode == loud.returncode == 2
    assert "Traceback" not in quiet.stderr and "Traceback" in loud.stderr


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_never_runs_without_trust_model_file(tmp_path):
    marker = tmp_path / "PWNED"
    torch.save({"model": _Evil(str(marker))}, tmp_path / "evil.pt")
    evil = tmp_path / "evil.pt"
    one_line_error(run(evil, "--to", "onnx"), "--allow-class", "--trust-model-file", "posix:system")
    for args in (["inspect", evil], ["inspect", evil, "--allow-class", "attn_export.examples:TinySeq2Seq"],
                 ["validate", evil, tmp_path / "x.onnx"]):
        one_line_error(invoke(*args), "--allow-class", "--trust-model-file")
    assert not marker.exists()
    # Positive control: with the flag the file's code runs (and it is not a model).
    proc = run("inspect", evil, "--trust-model-file")
    assert marker.exists()
    one_line_error(proc, "not a torch.nn.Module")


def test_allow_class_and_the_model_factory(tmp_path):
    from attn_export.examples import TinySeq2Seq

    torch.manual_seed(0)
    torch.save(TinySeq2Seq(features=8, d_model=16, heads=2, layers=1), tmp_path / "s2s.pt")
    refused = invoke("inspect", tmp_path / "s2s.pt")
    one_line_error(refused, "attn_export.examples:TinySeq2Seq")
    allowed = invoke("inspect", tmp_path / "s2s.pt", "--allow-class", "attn_export.examples:TinySeq2Seq")
    assert allowed.returncode == 0 and "3 found, 3 to replace" in allowed.stdout

    (tmp_path / "factory_mod.py").write_text(textwrap.dedent("""
        from torch import nn
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            def forward(self, x, mask):
                return self.attn(x, x, x, key_padding_mask=mask, need_weights=False)[0]
        def build():
            return Net()
    """))
    torch.manual_seed(1)
    sys.path.insert(0, str(tmp_path))
    try:
        import factory_mod  # noqa: F401
        weights = factory_mod.build().state_dict()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("factory_mod", None)
    torch.save(weights, tmp_path / "w.pt")
    proc = run("--model", "factory_mod:build", "--weights", "w.pt", "--input", "x:2x9x16",
               "--input", "mask:2x9:bool", cwd=tmp_path, expect=0)
    assert (tmp_path / "build.onnx").is_file() and "PASSED" in proc.stdout
    run("validate", "--model", "factory_mod:build", "--weights", "w.pt", "build.onnx", "--input", "x:3x5x16",
        "--input", "mask:3x5:bool", cwd=tmp_path, expect=0)


def test_no_example_inputs_is_a_clear_error(tmp_path):
    torch.save(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), tmp_path / "m.pt")
    one_line_error(invoke(tmp_path / "m.pt", "--to", "onnx"), "--input", "src")
