"""A packed projection no operator reads packed, back as one MatMul per part
(attn_export.onnx.ort.packed_split.split_as_matmuls), on hand-built graphs: ONNX Runtime's
outputs before the rewrite are the reference; a Split that is not a projection's last axis, or
a projection something else also reads, stays."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper, numpy_helper

from attn_export.onnx.ort.packed_split import split_as_matmuls

ort = pytest.importorskip("onnxruntime")

HIDDEN, WIDTHS = 8, (5, 7)


def projection(bias=False, equal=False, axis=-1, also_read=False):
    rng = np.random.default_rng(0)
    width = 2 * WIDTHS[0] if equal else sum(WIDTHS)
    inits = [numpy_helper.from_array(rng.standard_normal((HIDDEN, width)).astype(np.float32), "w")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["packed"])]
    source = "packed"
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), "b"))
        nodes.append(helper.make_node("Add", ["packed", "b"], ["biased"]))
        source = "biased"
    if equal:
        nodes.append(helper.make_node("Split", [source], ["gate", "up"], axis=axis, num_outputs=2))
    else:
        inits.append(numpy_helper.from_array(np.array(WIDTHS, np.int64), "sizes"))
        nodes.append(helper.make_node("Split", [source, "sizes"], ["gate", "up"], axis=axis))
    nodes += [helper.make_node("Sigmoid", ["gate"], ["act"]), helper.make_node("Neg", ["up"], ["y2"])]
    outputs = [helper.make_tensor_value_info("act", T.FLOAT, None), helper.make_tensor_value_info("y2", T.FLOAT, None)]
    if also_read:
        outputs.append(helper.make_tensor_value_info(source, T.FLOAT, None))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", T.FLOAT, ["batch", "sequence", HIDDEN])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return onnx.shape_inference.infer_shapes(model)


def run(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["act", "y2"], {"x": x})


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("equal", [False, True])
@pytest.mark.parametrize("axis", [-1, 2])
def test_each_part_is_its_own_matmul(bias, equal, axis):
    model = projection(bias, equal, axis)
    x = np.random.default_rng(1).standard_normal((2, 3, HIDDEN)).astype(np.float32)
    want = run(model, x)
    assert split_as_matmuls(model) == 1
    ops = [n.op_type for n in model.graph.node]
    assert "Split" not in ops and ops.count("MatMul") == 2 and ops.count("Add") == (2 if bias else 0)
    for got, ref in zip(run(model, x), want):
        assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max()


@pytest.mark.parametrize("case", ["not the last axis", "packed output read elsewhere"])
def test_other_splits_stay(case):
    model = projection(axis=1) if case == "not the last axis" else projection(also_read=True)
    before = model.SerializeToString()
    assert split_as_matmuls(model) == 0 and model.SerializeToString() == before
