"""--quantize int4|int8 (the ort flavor's weight-only quantization, attn_export/onnx/ort/quantize.py):
the weight MatMuls of a tiny grouped-query Llama become ONNX Runtime's MatMulNBits, the
generation gate passes against the model carrying the file's weights dequantized
(validation/quantized_reference.py) and fails against the original float weights; the flag
without the ort flavor is a usage error."""
import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from attn_export.errors import InputError
from attn_export.onnx import export_onnx
from attn_export.onnx.ort.quantize import dequantized_weights, quantized_nodes
from attn_export.options import ExportOptions
from attn_export.validation import generation as _generation
from attn_export.validation.quantized_reference import dequantize_reference, fake_quantize
from helpers import invoke, nodes_within

transformers = pytest.importorskip("transformers")

from attn_export.validation.generation import check_generation  # noqa: E402
from hf_models import HF5, tiny_llama  # noqa: E402

NEW_TOKENS = 12
LENGTHS = (5, 9, 12)
needs_hf5 = pytest.mark.skipif(not HF5, reason="the cached export is checked with transformers 5")


def export_quantized(path, precision):
    model = tiny_llama()  # 2 layers of Q/K/V, o_proj, gate/up, down_proj; the LM head
    ids = torch.randint(1, 97, (2, 5))
    result = export_onnx(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, path, with_past=True,
                         attention="ort", quantize=precision)
    return model, result, path


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    return export_quantized(tmp_path_factory.mktemp("int4") / "model.onnx", "int4")


def undequantized(monkeypatch):
    """The gate with the original float weights in its reference (the file's scheme still read,
    so the tolerance is the same): what a gate that forgot the quantization would compare."""
    def keep_float(model, onnx_model, base_dir=""):
        import copy
        return dequantize_reference(copy.deepcopy(model), onnx_model, base_dir)

    monkeypatch.setattr(_generation, "dequantize_reference", keep_float)


def check_quantized_file(model, result, path, bits):
    graph = onnx.load(str(path))
    nodes = list(quantized_nodes(graph))  # one per weight, in the main graph and the layers' branches
    ops = collections.Counter(n.op_type for n in nodes_within(graph.graph))
    layers = model.config.num_hidden_layers
    # Every weight MatMul, whatever the packing left (at least per layer the Q/K/V, the output
    # projection, the gate/up, the down projection; then the LM head): no float MatMul stays.
    assert len(nodes) >= 4 * layers + 1 and ops["MatMul"] == 0
    assert {onnx.helper.get_attribute_value(a) for n in nodes
            for a in n.attribute if a.name in ("bits", "block_size", "accuracy_level")} >= {bits, 32, 4}
    outcome = next(p for p in result.passes if p.name == "ort_quantize")
    assert outcome.changed == len(nodes)
    assert f"{len(nodes)} MatMul with a 2-D weight -> com.microsoft.MatMulNBits ({bits} bits, block 32" in \
        outcome.notes[0]


@pytest.mark.slow  # the int4 export (the module fixture, ~8 s)
@needs_hf5
def test_int4_writes_matmul_nbits(int4):
    check_quantized_file(*int4, bits=4)


@pytest.mark.slow  # the int4 export (the module fixture, ~8 s)
@needs_hf5
def test_the_reference_holds_the_files_weights_bit_for_bit(int4):
    """PyTorch's quantize/dequantize of the LM head equals the file's MatMulNBits read back, and
    ONNX Runtime's MatMulNBits computes with those weights (up to its int8 activations)."""
    model, _, path = int4
    graph = onnx.load(str(path))
    node, weight = next((n, w) for n, w in dequantized_weights(graph) if w.shape[1] == model.config.vocab_size)
    np.testing.assert_array_equal(weight.T, fake_quantize(model.lm_head.weight, 4, 32).numpy())
    assert not np.array_equal(weight.T, model.lm_head.weight.detach().numpy())
    one = onnx.helper.make_model(onnx.helper.make_graph(
        [node], "one", [onnx.helper.make_tensor_value_info(node.input[0], onnx.TensorProto.FLOAT, [3, weight.shape[0]])],
        [onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, [3, weight.shape[1]])],
        [i for i in graph.graph.initializer if i.name in node.input]),
        opset_imports=[onnx.helper.make_opsetid("", 20), onnx.helper.make_opsetid("com.microsoft", 1)])
    x = np.random.default_rng(0).standard_normal((3, weight.shape[0])).astype(np.float32)
    y = ort.InferenceSession(one.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {node.input[0]: x})[0]
    assert np.abs(y - x @ weight).max() <= 8 / 127 * np.abs(x @ weight).max()


@pytest.mark.slow  # the int4 export (the module fixture, ~8 s)
@needs_hf5
def test_int4_passes_the_gate_against_the_dequantized_reference(int4):
    model, _, path = int4
    result = check_generation(model, path, new_tokens=NEW_TOKENS, prompt_lengths=LENGTHS)
    assert result.passed, result.failures
    assert result.rtol == pytest.approx(8 / 127)
    assert "the reference carries the file's quantized weights: 15 Linear layer(s)" in result.reference
    assert len({tuple(t) for t in result.reference_tokens}) == len(LENGTHS)


@pytest.mark.slow  # the int4 export (the module fixture, ~8 s)
@needs_hf5
def test_int4_fails_the_gate_against_the_float_weights(int4, monkeypatch):
    model, _, path = int4
    undequantized(monkeypatch)
    result = check_generation(model, path, new_tokens=NEW_TOKENS, prompt_lengths=LENGTHS)
    assert not result.passed
    assert any("/ logits: max abs err" in line for line in result.failures), result.failures


@pytest.mark.slow  # the int4 export (the module fixture, ~8 s)
@needs_hf5
def test_a_file_quantized_from_another_model_is_refused(int4):
    _, _, path = int4
    other = tiny_llama()
    torch.nn.init.normal_(other.lm_head.weight)
    with pytest.raises(InputError, match="columns equal no row of the model's Linear layers"):
        dequantize_reference(other, onnx.load(str(path)))


@pytest.mark.slow
@needs_hf5
def test_int8_writes_matmul_nbits_and_passes_the_gate(tmp_path):
    model, result, path = export_quantized(tmp_path / "model.onnx", "int8")
    check_quantized_file(model, result, path, bits=8)
    gate = check_generation(model, path, new_tokens=NEW_TOKENS, prompt_lengths=LENGTHS)
    assert gate.passed, gate.failures
    assert "(8 bits, block 32, symmetric)" in gate.reference


def test_quantize_needs_the_ort_flavor():
    with pytest.raises(InputError, match="add --onnx-attention ort"):
        ExportOptions(quantize="int4")
    with pytest.raises(InputError, match="--quantize int3: one of int4, int8"):
        ExportOptions(attention="ort", quantize="int3")
    assert ExportOptions(attention="ort", quantize="int8").quantize == "int8"


def test_the_flag_without_the_ort_flavor_exits_2():
    result = invoke("convert", "model.pt", "--quantize", "int4")
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: --quantize int4 writes ONNX Runtime's MatMulNBits, which only the ort "
                                     "flavor targets: add --onnx-attention ort (got --onnx-attention custom)")


def swap_presents(path, out, a="present.0.key", b="present.0.value"):
    """The file with the first layer's present key and value swapped: its cache comes back with
    the keys as values and the values as keys."""
    graph = onnx.load(str(path))
    rename = {a: b, b: a}
    for value in [*graph.graph.output, *(n for n in graph.graph.node)]:
        if isinstance(value, onnx.ValueInfoProto):
            value.name = rename.get(value.name, value.name)
        else:
            value.output[:] = [rename.get(o, o) for o in value.output]
    onnx.save(graph, str(out))
    return out


def genai_row(result):
    return next(run for run in result.runs if run.backend == "onnxruntime-genai")


@pytest.mark.slow  # the int4 export (the module fixture, ~8 s)
@needs_hf5
def test_genai_generates_the_tokens_of_generate_as_its_own_row(int4):
    pytest.importorskip("onnxruntime_genai")
    model, _, path = int4
    result = check_generation(model, path, new_tokens=NEW_TOKENS, prompt_lengths=LENGTHS, genai=True)
    assert result.passed, result.failures
    row = genai_row(result)
    assert row.passed and row.tokens == result.reference_tokens
    assert [r.backend for r in result.runs] == ["onnxruntime", "onnxruntime-genai"]
    assert not (path.parent / "genai_config.json").exists()  # written into a temporary folder


@pytest.mark.slow  # the int4 export (the module fixture, ~8 s)
@needs_hf5
def test_genai_row_fails_on_a_broken_file(int4, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    model, _, path = int4
    broken = swap_presents(path, tmp_path / "model.onnx")
    result = check_generation(model, broken, new_tokens=NEW_TOKENS, prompt_lengths=LENGTHS, genai=True)
    row = genai_row(result)
    assert not row.passed and row.first_divergence is not None, row
    assert any(line.startswith("generate / onnxruntime-genai: tokens differ") for line in result.failures)


@pytest.mark.slow  # the int4 export (the module fixture, ~8 s)
@needs_hf5
def test_no_genai_row_without_a_config_unless_asked(int4):
    model, _, path = int4
    result = check_generation(model, path, new_tokens=2, prompt_lengths=(5,))
    assert [r.backend for r in result.runs] == ["onnxruntime"]


def test_quantize_takes_float32_weights():
    with pytest.raises(InputError, match="leave out --dtype fp16"):
        ExportOptions(attention="ort", quantize="int4", dtype="fp16")


@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_pytorch_quantizes_as_onnx_runtime_ties_included(precision):
    """Values exactly half-way between two levels (x.5 after the scale): ONNX Runtime rounds the
    offset value half away from zero, so -3.5 is stored as 5 - 8 = -3 and 6.5 as 7, where
    torch.round's half-to-even would give -4 and 6; plus a partial last block (K = 40)."""
    from attn_export.onnx.ort.quantize import quantize_weights

    low = 8.0 if precision == "int4" else 128.0
    weight = np.random.default_rng(1).uniform(-1, 1, (40, 3)).astype(np.float32)  # [K, N]
    weight[:32, 0] = 0.0
    weight[:4, 0] = [-low, -3.5, 6.5, 0.5]  # scale 1: ties at every other value
    graph = onnx.helper.make_graph([onnx.helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 40])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 3])],
                                   [onnx.numpy_helper.from_array(weight, "w")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 20)])
    assert quantize_weights(model, precision) == collections.Counter({"MatMul": 1})
    (_, stored), = dequantized_weights(model)
    ours = fake_quantize(torch.from_numpy(weight.T.copy()), 4 if precision == "int4" else 8, 32).numpy()
    np.testing.assert_array_equal(stored.T, ours)
    assert stored[:4, 0].tolist() == [-low, -3.0, 7.0, 1.0]


def test_a_near_tie_is_a_gap_within_twice_atol():
    from attn_export.validation.generation import near_tie

    reference = torch.tensor([[1.0, 0.99, 0.0], [0.0, 1.0, 0.5]])
    picked = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])  # row 0 takes token 1, 0.01 below the top
    tokens = torch.tensor([0, 1])
    assert "row 0: token 1 instead of 0, a near tie" in near_tie(picked, reference, tokens, rtol=0.01)
    assert near_tie(picked, reference, tokens, rtol=0.004) == ""
