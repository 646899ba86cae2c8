"""The FusedAttention node's cache form (has_past = 1, docs/onnx_node.md "The cache form"): its
lean and generic bodies in ONNX Runtime and in ONNX's reference evaluator against the float64
formula of csrc/attention_spec.h over cat(past, new keys), with an empty past (prefill) and a
non-empty one, grouped-query heads and masks; the presents must be exactly [past | new]."""
import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from attn_export import spec
from attn_export.onnx import node as onnx_node
from helpers import assert_parity
from test_onnx_body import TORCH_TYPES, spec_reference

S = spec.load()
OPSET = 20
B, D, DV = 2, 4, 6
GROUPINGS = [(3, 3), (4, 2), (4, 1)]
# (past P, new S): prefill with no past, a chunk after a past, one decode step.
LENGTHS = [(0, 4), (5, 3), (6, 1)]
# is_causal (bottom-right, the decoder's alignment), key padding mask, attn mask, softcap.
FLAGS = [(True, True, False, False), (True, False, True, True), (False, True, True, False)]
# Each flag set with one grouping (the fast tier's budget); every grouping and every length runs.
CASES = list(zip(FLAGS, GROUPINGS))
BODIES = [("lean", TensorProto.FLOAT), ("lean", TensorProto.BFLOAT16), ("generic", TensorProto.FLOAT)]


def flag_id(flags):
    return "-".join(name for name, on in zip(("causal", "kpm", "mask", "softcap"), flags) if on) or "plain"


def cache_model(function, attrs, elem):
    """Float32 graph inputs and outputs cast to and from T around one cache-form node."""
    names, outs = list(S.node_inputs(True)), list(S.node_outputs(True))
    cast_in = [n for n in names if n not in S.input_names[3:5]]
    nodes = [helper.make_node("Cast", [f"{n}_f32"], [n], to=elem) for n in cast_in]
    nodes.append(helper.make_node(S.op_type, names, outs, domain=function.domain, **attrs))
    nodes += [helper.make_node("Cast", [o], [f"{o}_f32"], to=TensorProto.FLOAT) for o in outs]
    shapes = {"query": ["B", "S", "E"], "key": ["B", "S", "Ek"], "value": ["B", "S", "Ev"],
              "past_key": ["B", "Hkv", "P", "D"], "past_value": ["B", "Hkv", "P", "Dv"]}
    inputs = [helper.make_tensor_value_info(f"{n}_f32", TensorProto.FLOAT, shapes[n]) for n in cast_in]
    inputs += [helper.make_tensor_value_info(S.input_names[3], TensorProto.FLOAT, ["mb", "mk"]),
               helper.make_tensor_value_info(S.input_names[4], TensorProto.FLOAT, ["ab", "ah", "aq", "ak"])]
    out_shapes = [["B", "S", "Eo"], ["B", "Hkv", "T", "D"], ["B", "Hkv", "T", "Dv"]]
    outputs = [helper.make_tensor_value_info(f"{o}_f32", TensorProto.FLOAT, shape) for o, shape in zip(outs, out_shapes)]
    graph = helper.make_graph(nodes, "cache_node", inputs, outputs)
    return helper.make_model(graph, functions=[function], opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(function.domain, S.domain_version)])


def cache_case(flags, elem, heads, kv_heads, past, new, seed):
    """Feeds (rounded to T) with a masked-out key and a dead row, and the node's attributes."""
    is_causal, kpm, mask, softcap = flags
    rng = np.random.default_rng(seed)
    total = past + new

    def in_t(shape, scale=1.0):
        return torch.from_numpy(rng.standard_normal(shape) * scale).to(TORCH_TYPES[elem]).float().numpy()

    feeds = {"query_f32": in_t((B, new, heads * D), 2.0), "key_f32": in_t((B, new, kv_heads * D), 2.0),
             "value_f32": in_t((B, new, kv_heads * DV)), "past_key_f32": in_t((B, kv_heads, past, D), 2.0),
             "past_value_f32": in_t((B, kv_heads, past, DV))}
    padding = np.zeros((1, 1), np.float32)
    if kpm:
        padding = (rng.standard_normal((B, total)) * 0.5).astype(np.float32)
        padding[1, : total // 2] = -np.inf  # left padding of the second sequence
    attn = np.zeros((1, 1, 1, 1), np.float32)
    if mask:
        attn = rng.standard_normal((1, heads, new, total)).astype(np.float32)
        attn[0, 1, new - 1] = -np.inf  # a dead row
    feeds.update({S.input_names[3]: padding, S.input_names[4]: attn})
    attrs = onnx_node.node_attributes(heads, 0.45, is_causal, kpm, mask, softcap=1.5 if softcap else 0.0,
                                      causal_alignment=1, kv_num_heads=kv_heads, has_past=True)
    return feeds, attrs


def expected_outputs(feeds, attrs, heads, kv_heads, flags):
    """The float64 formula over the present, and the presents [past | new keys head-major]."""
    f = {n: feeds[n].astype(np.float64) for n in feeds}

    def heads_first(t, n):  # [B, S, n*D] -> [B, n, S, D]
        return t.reshape(t.shape[0], t.shape[1], n, -1).transpose(0, 2, 1, 3)

    def token_major(t):  # [B, n, L, D] -> [B, L, n*D]
        return t.transpose(0, 2, 1, 3).reshape(t.shape[0], t.shape[2], -1)

    present_k = np.concatenate([f["past_key_f32"], heads_first(f["key_f32"], kv_heads)], axis=2)
    present_v = np.concatenate([f["past_value_f32"], heads_first(f["value_f32"], kv_heads)], axis=2)
    out = spec_reference(f["query_f32"], token_major(present_k), token_major(present_v), f[S.input_names[3]],
                         f[S.input_names[4]], num_heads=heads, scale=attrs[S.attr_scale], is_causal=flags[0],
                         softcap=attrs[S.attr_softcap], kv_num_heads=kv_heads, causal_alignment=1)
    return out, present_k, present_v


def function_for(body, attrs, query_type):
    node = helper.make_node(S.op_type, list(S.node_inputs(True)), list(S.node_outputs(True)), domain=S.domain,
                            **attrs)
    variant = onnx_node.BodyVariant.of_node(node, query_type)
    assert variant.past
    if body == "lean":
        return variant, onnx_node.lean_function_proto(OPSET, variant)
    # The generic body under a domain of its own: onnx.checker holds a node of the spec's domain
    # to the OpSchema that register_schema() may have registered in this process (the plain
    # form torch's exporter writes), not to the function.
    function = onnx_node.function_proto(OPSET, past=True)
    function.domain = f"{S.domain}.generic_past"
    return variant, function


@pytest.mark.parametrize("body,elem", BODIES, ids=["lean-f32", "lean-bf16", "generic-f32"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: f"p{x[0]}-s{x[1]}")
@pytest.mark.parametrize("flags,grouping", CASES, ids=[f"{flag_id(f)}-h{g[0]}-kv{g[1]}" for f, g in CASES])
def test_cache_bodies_match_the_formula_over_the_present(flags, grouping, lengths, elem, body):
    (heads, kv_heads), (past, new) = grouping, lengths
    feeds, attrs = cache_case(flags, elem, heads, kv_heads, past, new, seed=FLAGS.index(flags) + past)
    variant, function = function_for(body, attrs, elem)
    model = cache_model(function, attrs, elem)
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out, present_k, present_v = session.run(None, feeds)
    expected, expected_k, expected_v = expected_outputs(feeds, attrs, heads, kv_heads, flags)
    # The presents are copies of T values: exact.
    assert np.array_equal(present_k, expected_k) and np.array_equal(present_v, expected_v)
    if flags[2]:
        assert (expected[:, new - 1, DV:2 * DV] == 0).all()  # the dead row, in the reference too
    rel = torch.finfo(TORCH_TYPES[elem]).eps * (1 if elem != TensorProto.FLOAT else 0) + 2e-6
    assert_parity(torch.from_numpy(out), torch.from_numpy(expected), rel, f"{body} body of {variant.name}")


@pytest.mark.parametrize("lengths", LENGTHS[:2], ids=lambda x: f"p{x[0]}-s{x[1]}")
def test_the_cache_body_in_onnx_reference_evaluator(lengths):
    """A second runtime: ONNX's own reference evaluator runs the lean body (GQA, padding mask,
    attn mask, bottom-right causal)."""
    from onnx.reference import ReferenceEvaluator

    past, new = lengths
    flags = (True, True, True, False)
    feeds, attrs = cache_case(flags, TensorProto.FLOAT, 4, 2, past, new, seed=7)
    _, function = function_for("lean", attrs, TensorProto.FLOAT)
    out, present_k, present_v = ReferenceEvaluator(cache_model(function, attrs, TensorProto.FLOAT)).run(None, feeds)
    expected, expected_k, expected_v = expected_outputs(feeds, attrs, 4, 2, flags)
    assert np.array_equal(present_k, expected_k) and np.array_equal(present_v, expected_v)
    assert_parity(torch.from_numpy(out), torch.from_numpy(expected), 2e-6, "reference evaluator")


def test_the_cache_body_reads_the_cache_in_place():
    """The cache is transposed nowhere but in the one Transpose the scores' MatMul reads (which
    ONNX Runtime folds into the MatMul: FusedMatMul transB=1); the new tokens alone are reshaped."""
    variant = onnx_node.BodyVariant(True, True, False, False, True, bottom_right=True, grouped=True, past=True)
    function = onnx_node.lean_function_proto(OPSET, variant)
    assert list(function.input) == list(S.node_inputs(True)) and list(function.output) == list(S.node_outputs(True))
    readers = {}
    for n in function.node:
        for i in n.input:
            if n.op_type != "Shape":  # a Shape reads the dims alone (Lk, from the present)
                readers.setdefault(i, []).append(n)
    present_k, present_v = S.present_output_names
    (transpose,) = readers[present_k]
    assert transpose.op_type == "Transpose" and [r.op_type for r in readers[transpose.output[0]]] == ["MatMul"]
    assert [r.op_type for r in readers[present_v]] == ["MatMul"]
    for past in S.past_input_names:
        assert [r.op_type for r in readers[past]] == ["Concat"]


def test_ort_folds_the_key_transpose_into_the_matmul(tmp_path):
    """What the body relies on: ONNX Runtime's optimized graph keeps no Transpose of the cache."""
    flags = (True, True, False, False)
    feeds, attrs = cache_case(flags, TensorProto.FLOAT, 4, 2, 5, 1, seed=3)
    _, function = function_for("lean", attrs, TensorProto.FLOAT)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(cache_model(function, attrs, TensorProto.FLOAT).SerializeToString(), options,
                         providers=["CPUExecutionProvider"])
    graph = onnx.load(str(tmp_path / "optimized.onnx")).graph
    present = next(n for n in graph.node if n.op_type == "Concat" and any("past_key" in i for i in n.input))
    assert not any(n.op_type == "Transpose" and n.input[0] == present.output[0] for n in graph.node)
    assert any(n.op_type == "FusedMatMul" and n.input[1] == present.output[0] for n in graph.node), \
        [(n.op_type, list(n.input)) for n in graph.node if present.output[0] in n.input]
