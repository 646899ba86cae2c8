"""The function-free export (``functions="inline"``, ``--onnx-functions inline``): the custom
nodes' bodies written into the graph, for runtimes that do not read model-local functions;
ONNX Runtime on it agrees with the PyTorch model."""
import onnx
import onnxruntime as ort
import pytest
import torch

from attn_export import spec
from attn_export.errors import InputError
from attn_export.onnx import export_onnx, read_metadata
from helpers import assert_parity, invoke, slow_path_outputs

S = spec.load()


def _only_standard_ops(model):
    assert not model.functions
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    assert not [o.domain for o in model.opset_import if o.domain.startswith(S.domain)]


def test_inline_export_has_no_function_and_matches_the_model(small_seq2seq, tmp_path):
    result = export_onnx(small_seq2seq, small_seq2seq.example_inputs, tmp_path / "inline.onnx", functions="inline")
    model = onnx.load(str(result.path))
    _only_standard_ops(model)
    onnx.checker.check_model(model, full_check=True)
    assert (result.functions, result.num_attention_nodes) == ("inline", 0)
    assert [p.name for p in result.passes][-3:] == ["attach_functions", "inline_functions", "record_shapes"]
    assert read_metadata(model)["functions"] == "inline"
    assert sum(n.op_type == "Softmax" for n in model.graph.node) == 3  # the three layers' bodies
    inputs = small_seq2seq.example_inputs
    expected = slow_path_outputs(small_seq2seq, inputs)
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {k: v.numpy() for k, v in inputs.items()})
    assert_parity(torch.from_numpy(out), expected, 5e-6, "inline export")


def test_unknown_function_mode_is_refused(small_seq2seq, tmp_path):
    with pytest.raises(InputError, match="--onnx-functions nested: one of local, inline"):
        export_onnx(small_seq2seq, small_seq2seq.example_inputs, tmp_path / "x.onnx", functions="nested")


@pytest.mark.slow  # a whole convert and gate; the export: test_inline_export_has_no_function_and_matches_the_model
def test_cli_writes_and_validates_the_function_free_export(tmp_path):
    out = tmp_path / "inline.onnx"
    proc = invoke("--model", "attn_export.examples:tiny_seq2seq", "--onnx-functions", "inline", "-o", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _only_standard_ops(onnx.load(str(out)))


def test_cli_refuses_an_unknown_function_mode():
    proc = invoke("--model", "attn_export.examples:tiny_seq2seq", "--onnx-functions", "nested")
    assert proc.returncode == 2 and "'nested' is not one of 'local', 'inline'" in proc.stderr
