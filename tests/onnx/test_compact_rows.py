"""The compacted cache (attn_export.onnx.ort.compact_rows) on a hand-built one-layer graph, fast:
the layer's If on "some key is padded" (the operator with the padding as a bias over the
caller's layout, or without) replaced by the operator alone over rows compacted at the start of
the cache; ONNX Runtime's own GroupQueryAttention with the bias, on the graph before the rewrite,
is the reference for a left-padded, a right-padded and an unpadded prompt and the decode step
after each."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper, numpy_helper

from attn_export.onnx.ort.compact_rows import compact_rows

ort = pytest.importorskip("onnxruntime")

VOCAB, D = 11, 8
MS = "com.microsoft"


def _gqa(name, outputs, bias=None):
    inputs = ["x", "x", "x", "past_key_values.0.key", "past_key_values.0.value", "seqlens_k", "total"]
    return helper.make_node("GroupQueryAttention", inputs + (["", "", "", bias] if bias else []), outputs, name=name,
                            domain=MS, num_heads=1, kv_num_heads=1, scale=0.5)


def one_layer(mask_read_elsewhere=False):
    rng = np.random.default_rng(0)
    c = lambda name, values, dtype=np.int64: numpy_helper.from_array(np.asarray(values, dtype=dtype), name)  # noqa: E731
    inits = [c("embed", rng.standard_normal((VOCAB, D)), np.float32), c("head", rng.standard_normal((D, VOCAB)), np.float32),
             c("one32", [1], np.int32), c("axis0", [0]), c("axes12", [1, 2]), c("zero_f", 0.0, np.float32),
             c("lowest", -3.0e38, np.float32)]
    outs = ["attn", "present.0.key", "present.0.value"]
    branch = lambda node: helper.make_graph([node], node.name, [], [helper.make_tensor_value_info(o, T.FLOAT, None)  # noqa: E731
                                                                     for o in node.output])
    nodes = [
        helper.make_node("Gather", ["embed", "input_ids"], ["x"]),
        # transformers' layout: every row's length is the total, the padding a bias
        helper.make_node("Shape", ["attention_mask"], ["total64"], start=1, end=2),
        helper.make_node("Cast", ["total64"], ["total1"], to=T.INT32),
        helper.make_node("Squeeze", ["total1", "axis0"], ["total"]),
        helper.make_node("Sub", ["total1", "one32"], ["last"]),
        helper.make_node("Shape", ["input_ids"], ["batch"], start=0, end=1),
        helper.make_node("Expand", ["last", "batch"], ["seqlens_k"]),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=T.FLOAT),
        helper.make_node("ReduceMin", ["maskf"], ["lowest_kept"], keepdims=0),
        helper.make_node("Equal", ["lowest_kept", "zero_f"], ["padded"]),
        helper.make_node("Equal", ["maskf", "zero_f"], ["masked"]),
        helper.make_node("Where", ["masked", "lowest", "zero_f"], ["kpm"]),
        helper.make_node("Unsqueeze", ["kpm", "axes12"], ["kpm4"]),
        helper.make_node("Shape", ["input_ids"], ["lq"], start=1, end=2),
        helper.make_node("Concat", ["batch", "one1", "lq", "total64"], ["bias_shape"], axis=0),
        helper.make_node("Expand", ["kpm4", "bias_shape"], ["bias"]),
        helper.make_node("If", ["padded"], outs, name="layer/if_padded",
                         then_branch=branch(_gqa("exact", [f"{o}/p" for o in outs], "bias")),
                         else_branch=branch(_gqa("dense", [f"{o}/d" for o in outs]))),
        helper.make_node("MatMul", ["attn", "head"], ["logits"]),
    ]
    inits.append(c("one1", [1]))
    outputs = [helper.make_tensor_value_info("logits", T.FLOAT, ["batch", "sequence", VOCAB])]
    if mask_read_elsewhere:  # a kept node that reads the mask's columns in the caller's order
        nodes.append(helper.make_node("ReduceSum", ["maskf"], ["kept_count"], keepdims=0))
        outputs.append(helper.make_tensor_value_info("kept_count", T.FLOAT, []))
    outputs += [helper.make_tensor_value_info(f"present.0.{kv}", T.FLOAT, ["batch", 1, "total_sequence", D])
                for kv in ("key", "value")]
    inputs = [helper.make_tensor_value_info("input_ids", T.INT64, ["batch", "sequence"]),
              helper.make_tensor_value_info("attention_mask", T.INT64, ["batch", "total_sequence"])]
    inputs += [helper.make_tensor_value_info(f"past_key_values.0.{kv}", T.FLOAT, ["batch", 1, "past_sequence", D])
               for kv in ("key", "value")]
    graph = helper.make_graph(nodes, "one_layer", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(MS, 1)])


def run(model, ids, mask, past):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "attention_mask": mask, "past_key_values.0.key": past[0], "past_key_values.0.value": past[1]}
    logits, key, value = session.run(["logits", "present.0.key", "present.0.value"], feeds)
    return logits, (key, value)


@pytest.mark.parametrize("padding", ["left", "right", "none"])
def test_the_compacted_graph_gives_the_biased_operators_logits(padding):
    reference = one_layer()
    compact = one_layer()
    assert compact_rows(compact) == 1
    assert not [n for n in compact.graph.node if n.op_type == "If"]
    assert [n.input[5] for n in compact.graph.node if n.op_type == "GroupQueryAttention"] == ["ort_compact/seqlens_k"]
    rng = np.random.default_rng(1)
    ids = rng.integers(1, VOCAB, (2, 6))
    mask = np.ones((2, 6), np.int64)
    if padding == "left":
        mask[1, :4] = 0
    elif padding == "right":
        mask[1, 2:] = 0
    empty = np.zeros((2, 1, 0, D), np.float32)
    want, want_cache = run(reference, ids, mask, (empty, empty))
    got, got_cache = run(compact, ids, mask, (empty, empty))
    kept = mask.astype(bool)
    scale = np.abs(want[kept]).max()
    assert np.isfinite(got).all() and np.abs(got - want)[kept].max() <= 1e-5 * scale
    # A decode step after it, each graph on its own cache (the compacted rows are not the caller's layout).
    step_ids, step_mask = rng.integers(1, VOCAB, (2, 1)), np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    want, _ = run(reference, step_ids, step_mask, want_cache)
    got, _ = run(compact, step_ids, step_mask, got_cache)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_graph_that_reads_the_mask_elsewhere_keeps_its_if():
    model = one_layer(mask_read_elsewhere=True)
    before = model.SerializeToString()
    assert compact_rows(model) == 0 and model.SerializeToString() == before


@pytest.mark.parametrize("seed", range(12))
def test_random_batches_of_mixed_padding(seed):
    """Random batch sizes, lengths and padding sides, rows of left and right padding and of holes
    anywhere (a packed or edited prompt) mixed in one batch, and a decode step: the compacted graph
    against the biased operator on the original."""
    rng = np.random.default_rng(100 + seed)
    batch, length = int(rng.integers(1, 5)), int(rng.integers(1, 10))
    ids = rng.integers(1, VOCAB, (batch, length))
    mask = np.zeros((batch, length), np.int64)
    for row in range(batch):
        kept, side = int(rng.integers(1, length + 1)), rng.random()
        if side < 0.4:
            mask[row, length - kept:] = 1
        elif side < 0.8:
            mask[row, :kept] = 1
        else:
            mask[row, rng.choice(length, kept, replace=False)] = 1
    reference, compact = one_layer(), one_layer()
    assert compact_rows(compact) == 1
    empty = np.zeros((batch, 1, 0, D), np.float32)
    want, want_cache = run(reference, ids, mask, (empty, empty))
    got, got_cache = run(compact, ids, mask, (empty, empty))
    kept = mask.astype(bool)
    assert np.isfinite(got).all() and np.abs(got - want)[kept].max() <= 1e-5 * np.abs(want[kept]).max(), (batch, length, mask)
    step_mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
    step_ids = rng.integers(1, VOCAB, (batch, 1))
    want, _ = run(reference, step_ids, step_mask, want_cache)
    got, _ = run(compact, step_ids, step_mask, got_cache)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (batch, length, mask)
