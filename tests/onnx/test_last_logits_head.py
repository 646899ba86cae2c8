"""Where the last-logits pass finds the language-model head (attn_export/onnx/last_logits.py) and
what it does where it finds none: fail when --last-logits was asked for, keep every position's
logits with a note when it is --genai-config's default (passes/last_logits.py)."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from attn_export.errors import InputError
from attn_export.onnx.last_logits import ROWS_LAST
from attn_export.onnx.passes.base import PassContext
from attn_export.onnx.passes.last_logits import LastLogits
from attn_export.options import LAST_LOGITS_IF_FOUND

HIDDEN, VOCAB = 8, 11


def _model(head: str, after: str = "Tanh") -> onnx.ModelProto:
    """hidden [B, S, 8] -> the head -> ``after`` -> logits [B, S, 11]; the weight [11, 8] is read
    transposed, as a head tied to the embedding."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((VOCAB, HIDDEN)).astype(np.float32), "w")
    if head == "MatMul":
        nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["h", "wt"], ["z"])]
    else:  # ONNX Runtime's fusion of the two
        nodes = [helper.make_node("FusedMatMul", ["h", "w"], ["z"], domain="com.microsoft", transB=1)]
    nodes.append(helper.make_node(after, ["z"], ["logits"]))
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["B", "S", HIDDEN])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "S", VOCAB])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)])


def _run(model, hidden):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"h": hidden})[0]


@pytest.mark.parametrize("head", ["MatMul", "FusedMatMul"])
def test_a_tied_head_is_sliced_to_the_last_position(head):
    model = _model(head)
    hidden = np.random.default_rng(1).standard_normal((2, 5, HIDDEN)).astype(np.float32)
    full = _run(model, hidden)
    context = PassContext(20, attention="ort", last_logits=LAST_LOGITS_IF_FOUND)
    outcome = LastLogits().run(model, context)
    assert outcome.changed == 1 and context.last_logits is True
    last = _run(model, hidden)
    assert last.shape == (2, 1, VOCAB)
    np.testing.assert_allclose(last[:, 0], full[:, -1], rtol=0, atol=1e-6 * float(np.abs(full).max()))


@pytest.mark.parametrize("asked", [True, LAST_LOGITS_IF_FOUND])
def test_no_head_found_fails_when_asked_and_keeps_every_position_by_default(asked):
    model = _model("MatMul", after="Relu")  # not an elementwise op the pass walks through
    context = PassContext(20, attention="ort", last_logits=asked)
    if asked is True:
        with pytest.raises(InputError, match="--last-logits: no MatMul .* behind 'logits'; export without it"):
            LastLogits().run(model, context)
        return
    outcome = LastLogits().run(model, context)
    assert outcome.changed == 0 and context.last_logits is False
    assert outcome.notes == ("last_logits: every position's logits kept (no MatMul with a constant weight found "
                             "behind 'logits')",)
    assert [n.op_type for n in model.graph.node] == ["Transpose", "MatMul", "Relu"]  # untouched


def _masked_model() -> onnx.ModelProto:
    """As _model's MatMul head, with the graph's attention_mask [B, past + S] beside the hidden states."""
    model = _model("MatMul", after="Tanh")
    model.graph.input.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "T"]))
    return model


def test_each_row_takes_its_last_kept_position():
    """Right padding (ONNX Runtime GenAI's: a short row's pad tokens after its prompt), left
    padding (transformers'), no padding, and a decode step after a padded prompt: each row's
    logits are those of the last position its mask keeps among the call's S positions."""
    model = _masked_model()
    rng = np.random.default_rng(2)
    hidden = rng.standard_normal((3, 6, HIDDEN)).astype(np.float32)
    full = _run(_model("MatMul", after="Tanh"), hidden)
    context = PassContext(20, last_logits=True)
    LastLogits().run(model, context)
    assert [n.name for n in model.graph.node if n.name.endswith(ROWS_LAST)], "no per-row pick"
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    past = np.ones((3, 4), dtype=np.int64)  # a cache of 4 positions before the 6 new ones
    new = np.array([[1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=np.int64)
    got = session.run(None, {"h": hidden, "attention_mask": np.concatenate([past, new], axis=1)})[0]
    assert got.shape == (3, 1, VOCAB)
    for row, last in enumerate([2, 5, 5]):
        np.testing.assert_allclose(got[row, 0], full[row, last], rtol=0, atol=1e-6 * float(np.abs(full).max()))
    step = session.run(None, {"h": hidden[:, :1], "attention_mask": np.concatenate([past, new, past[:, :1]], axis=1)})
    np.testing.assert_allclose(step[0][:, 0], full[:, 0], rtol=0, atol=1e-6 * float(np.abs(full).max()))
