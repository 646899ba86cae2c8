"""Every function body the exporter can write — the lean body of each node variant (every
combination of is_causal, the two masks and softcap, for each T and for an unknown T; and with
grouped-query heads and both causal alignments) and the generic body on the same nodes — in ONNX Runtime against a float64 numpy reference written from
the node's formula in csrc/attention_spec.h, and with the function identity the spec gives."""
import itertools
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from attn_export import spec
from attn_export.onnx import body as onnx_body
from attn_export.onnx import node as onnx_node
from helpers import assert_parity

S = spec.load()
OPSET = 20
B, H, LQ, LK, D, DV = 2, 3, 5, 7, 4, 6

# (name, T of the node, the query type the exporter saw: None when the graph did not record it).
TYPES = [("f32", TensorProto.FLOAT, TensorProto.FLOAT), ("f32_unknown", TensorProto.FLOAT, None),
         ("fp16", TensorProto.FLOAT16, TensorProto.FLOAT16), ("bf16", TensorProto.BFLOAT16, TensorProto.BFLOAT16)]
TORCH_TYPES = {TensorProto.FLOAT: torch.float32, TensorProto.FLOAT16: torch.float16,
               TensorProto.BFLOAT16: torch.bfloat16}
FLAGS = list(itertools.product([False, True], repeat=4))  # is_causal, key padding mask, attn mask, softcap


def flag_id(flags):
    return "-".join(name for name, on in zip(("causal", "kpm", "mask", "softcap"), flags) if on) or "plain"


def spec_reference(query, key, value, key_padding_mask, attn_mask, *, num_heads, scale, is_causal, softcap,
                   kv_num_heads=0, causal_alignment=0, window=0):
    """The node's output in float64, written from csrc/attention_spec.h: query head h reads
    key/value head h // (H / Hkv); x = scale <q, k>; c = softcap tanh(x / softcap) when
    softcap > 0; s = c + masks (+ -inf where j > i + a, causal, a = Lk - Lq bottom-right; and
    where j <= i + a - window with a window);
    p = softmax_j(s), or 0 where every s is -inf; output = sum_j p v, heads packed."""
    def heads(t, n):  # [B, L, n*D] -> [B, n, L, D]
        return t.reshape(t.shape[0], t.shape[1], n, -1).transpose(0, 2, 1, 3)

    kv_heads = kv_num_heads or num_heads
    group = [h // (num_heads // kv_heads) for h in range(num_heads)]
    q, k, v = heads(query, num_heads), heads(key, kv_heads)[:, group], heads(value, kv_heads)[:, group]
    x = scale * (q @ k.transpose(0, 1, 3, 2))
    c = softcap * np.tanh(x / softcap) if softcap > 0 else x
    s = c + key_padding_mask[:, None, None, :] + attn_mask
    if is_causal:
        lq, lk = s.shape[-2:]
        offset = lk - lq if causal_alignment == 1 else 0
        s = s + np.where(np.triu(np.ones((lq, lk), bool), 1 + offset), -np.inf, 0.0)
        if window > 0:
            s = s + np.where(np.tril(np.ones((lq, lk), bool), offset - window), -np.inf, 0.0)
    dead = np.isneginf(s).all(-1, keepdims=True)
    e = np.exp(s - np.where(dead, 0.0, s.max(-1, keepdims=True)))
    p = np.where(dead, 0.0, e / np.where(dead, 1.0, e.sum(-1, keepdims=True)))
    out = p @ v
    return out.transpose(0, 2, 1, 3).reshape(out.shape[0], out.shape[2], -1)


def one_node_model(function, attrs, elem):
    """Float32 graph inputs and output, cast to and from T around one FusedAttention node of the
    function's domain (ONNX Runtime's Python API feeds no bfloat16 arrays)."""
    names = list(S.input_names)
    node = helper.make_node(S.op_type, names, ["out"], domain=function.domain, **attrs)
    nodes = [helper.make_node("Cast", [f"{n}_f32"], [n], to=elem) for n in names[:3]]
    nodes += [node, helper.make_node("Cast", ["out"], ["out_f32"], to=TensorProto.FLOAT)]
    inputs = [helper.make_tensor_value_info(f"{n}_f32", TensorProto.FLOAT, ["B", f"L{n[0]}", f"E{n[0]}"])
              for n in names[:3]]
    inputs += [helper.make_tensor_value_info(names[3], TensorProto.FLOAT, ["mb", "mk"]),
               helper.make_tensor_value_info(names[4], TensorProto.FLOAT, ["ab", "ah", "aq", "ak"])]
    output = helper.make_tensor_value_info("out_f32", TensorProto.FLOAT, ["B", "Lq", "Ev"])
    graph = helper.make_graph(nodes, "one_node", inputs, [output])
    return helper.make_model(graph, functions=[function], opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(function.domain, S.domain_version)])


def random_case(flags, elem, seed, heads=H, kv_heads=H, lq=LQ, lk=LK, causal_alignment=0, window=0):
    """Inputs rounded to T (so the graph's Cast to T is exact), masks with a fully masked row:
    batch 1 sees only its first two keys; head 1, query 2 (query 0 when Lq = 1) sees
    none (attn mask)."""
    is_causal, kpm, mask, softcap = flags
    rng = np.random.default_rng(seed)

    def in_t(shape, scale):
        x = torch.from_numpy(rng.standard_normal(shape) * scale).to(TORCH_TYPES[elem])
        return x.float().numpy()

    feeds = {"query_f32": in_t((B, lq, heads * D), 2.0), "key_f32": in_t((B, lk, kv_heads * D), 2.0),
             "value_f32": in_t((B, lk, kv_heads * DV), 1.0)}
    padding = np.zeros((1, 1), np.float32)
    if kpm:
        padding = (rng.standard_normal((B, lk)) * 0.5).astype(np.float32)
        padding[1, 2:] = -np.inf
    attn = np.zeros((1, 1, 1, 1), np.float32)
    if mask:
        attn = rng.standard_normal((1, heads, lq, lk)).astype(np.float32)
        attn[0, 1, min(2, lq - 1)] = -np.inf
    feeds.update({S.input_names[3]: padding, S.input_names[4]: attn})
    attrs = onnx_node.node_attributes(heads, 0.45, is_causal, kpm, mask, softcap=1.5 if softcap else 0.0,
                                      causal_alignment=causal_alignment, kv_num_heads=kv_heads, window=window)
    return feeds, attrs


def run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def run_body(body, attrs, elem, query_type, feeds):
    """One node of ``attrs`` on its lean body or the generic one, in ONNX Runtime: (its variant,
    the output, the inputs in float64 in the spec's order)."""
    node = helper.make_node(S.op_type, list(S.input_names), ["out"], domain=S.domain, **attrs)
    variant = onnx_node.BodyVariant.of_node(node, query_type)
    function = (onnx_node.lean_function_proto(OPSET, variant) if body == "lean"
                else onnx_node.function_proto(OPSET))
    model = one_node_model(function, attrs, elem)
    onnx.checker.check_model(model, full_check=True)
    args = [feeds[n].astype(np.float64) for n in ("query_f32", "key_f32", "value_f32", *S.input_names[3:])]
    return variant, run(model, feeds), args


@pytest.mark.parametrize("body", ["lean", "generic"])
@pytest.mark.parametrize("type_name,elem,query_type", TYPES, ids=[t[0] for t in TYPES])
@pytest.mark.parametrize("flags", FLAGS, ids=map(flag_id, FLAGS))
def test_every_body_matches_the_spec_formula_in_float64(flags, type_name, elem, query_type, body):
    feeds, attrs = random_case(flags, elem, seed=FLAGS.index(flags))
    variant, out, args = run_body(body, attrs, elem, query_type, feeds)
    expected = spec_reference(*args, num_heads=H, scale=attrs[S.attr_scale], is_causal=flags[0],
                              softcap=attrs[S.attr_softcap])
    if flags[2]:
        assert (expected[:, 2, DV:2 * DV] == 0).all()  # the reference's own view of the dead row
    # One unit in the last place of T (the output's rounding, whatever the runtime's Cast rounds
    # to) plus float32 accumulation, relative to the output's largest magnitude.
    rel = torch.finfo(TORCH_TYPES[elem]).eps * (1 if elem != TensorProto.FLOAT else 0) + 2e-6
    assert_parity(torch.from_numpy(out), torch.from_numpy(expected), rel, f"{body} body of {variant.name}")


@pytest.mark.parametrize("type_name,elem,query_type", TYPES, ids=[t[0] for t in TYPES])
@pytest.mark.parametrize("flags", FLAGS, ids=map(flag_id, FLAGS))
def test_every_lean_body_has_the_spec_identity_and_only_its_work(flags, type_name, elem, query_type):
    is_causal, kpm, mask, softcap = flags
    variant = onnx_node.BodyVariant(is_causal, kpm, mask, softcap, query_type == TensorProto.FLOAT)
    function = onnx_node.lean_function_proto(OPSET, variant)
    assert (function.domain, function.name, function.overload) == (variant.domain, S.op_type, "")
    assert list(function.input) == list(S.input_names) and list(function.output) == list(S.output_names)
    assert list(function.attribute) == [a.name for a in S.attributes if a.required]
    assert {a.name: helper.get_attribute_value(a) for a in function.attribute_proto} == {
        # A list's function default is [0.0] (body.default_attribute: tools cannot write an empty one).
        a.name: a.default.encode() if isinstance(a.default, str) else [0.0] if isinstance(a.default, tuple)
        else a.default for a in S.attributes if not a.required}
    assert [(o.domain, o.version) for o in function.opset_import] == [("", OPSET)]
    ops = [n.op_type for n in function.node]
    assert ("Cast" in ops) == (query_type != TensorProto.FLOAT) and ("Tanh" in ops) == softcap
    assert ("Trilu" in ops) == is_causal and ("IsInf" in ops) == (kpm or mask)
    assert "Greater" not in ops  # nothing selected at run time: the generic body's work
    assert "Range" not in ops  # no ALiBi step without slopes
    assert set(function.input) <= {i for n in function.node for i in n.input}
    outputs = [o for n in function.node for o in n.output]
    assert len(outputs) == len(set(outputs))  # single assignment


def test_the_generic_body_selects_causal_and_softcap_from_the_attributes():
    ops = [n.op_type for n in onnx_node.function_proto(OPSET).node]
    refs = {a.ref_attr_name for n in onnx_node.function_proto(OPSET).node for a in n.attribute if a.ref_attr_name}
    assert refs == {S.attr_num_heads, S.attr_scale, S.attr_is_causal, S.attr_softcap, S.attr_causal_alignment,
                    S.attr_kv_num_heads, S.attr_window, S.attr_alibi_slopes}
    assert {"Trilu", "Tanh", "Greater", "IsInf", "Cast", "CastLike"} <= set(ops)


# (heads, kv_heads): one key/value head per query head, two groups of two, one shared (multi-query).
GROUPINGS = [(3, 3), (4, 2), (4, 1)]
# (Lq, Lk): a decoder's chunk over a longer cache, more queries than keys (bottom-right leaves
# the first Lq - Lk queries without a key), and one decode step (one query over the cache).
LENGTHS = [(5, 7), (7, 4), (1, 6)]
GQA_FLAGS = [(causal, kpm, mask, False) for causal, kpm, mask in itertools.product([False, True], repeat=3)]


@pytest.mark.parametrize("body", ["lean", "generic"])
@pytest.mark.parametrize("type_name,elem,query_type", [TYPES[0], TYPES[3]], ids=["f32", "bf16"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: f"lq{x[0]}-lk{x[1]}")
@pytest.mark.parametrize("alignment", [0, 1], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("grouping", GROUPINGS, ids=lambda x: f"h{x[0]}-kv{x[1]}")
@pytest.mark.parametrize("flags", GQA_FLAGS, ids=map(flag_id, GQA_FLAGS))
def test_grouped_heads_and_causal_alignments_match_the_spec_formula(flags, grouping, alignment, lengths,
                                                                     type_name, elem, query_type, body):
    (heads, kv_heads), (lq, lk) = grouping, lengths
    feeds, attrs = random_case(flags, elem, seed=GQA_FLAGS.index(flags), heads=heads, kv_heads=kv_heads, lq=lq,
                               lk=lk, causal_alignment=alignment)
    variant, out, args = run_body(body, attrs, elem, query_type, feeds)
    assert variant.grouped == (kv_heads != heads) and variant.bottom_right == (flags[0] and alignment == 1)
    expected = spec_reference(*args, num_heads=heads, scale=attrs[S.attr_scale], is_causal=flags[0], softcap=0.0,
                              kv_num_heads=kv_heads, causal_alignment=alignment)
    if flags[0] and alignment == 1 and lq > lk:
        assert (expected[:, : lq - lk] == 0).all()  # queries before the cache's first key see none
    rel = torch.finfo(TORCH_TYPES[elem]).eps * (1 if elem != TensorProto.FLOAT else 0) + 2e-6
    assert_parity(torch.from_numpy(out), torch.from_numpy(expected), rel, f"{body} body of {variant.name}")


def test_the_reference_groups_and_aligns_as_sdpa():
    """spec_reference's grouping and bottom-right alignment against torch's own SDPA (enable_gqa;
    a bottom-right boolean mask built independently with tril's diagonal)."""
    feeds, attrs = random_case((True, False, False, False), TensorProto.FLOAT, seed=3, heads=4, kv_heads=2, lq=3,
                               lk=6, causal_alignment=1)
    q, k, v = (torch.from_numpy(feeds[n]).double().reshape(B, -1, h, d).transpose(1, 2)
               for n, h, d in (("query_f32", 4, D), ("key_f32", 2, D), ("value_f32", 2, DV)))
    visible = torch.ones(3, 6, dtype=torch.bool).tril(diagonal=6 - 3)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.45, enable_gqa=True)
    ours = spec_reference(*(feeds[n].astype(np.float64) for n in ("query_f32", "key_f32", "value_f32",
                                                                  *S.input_names[3:])),
                          num_heads=4, scale=0.45, is_causal=True, softcap=0.0, kv_num_heads=2, causal_alignment=1)
    np.testing.assert_allclose(ours, ref.transpose(1, 2).reshape(B, 3, 4 * DV).numpy(), rtol=0, atol=1e-12)


def test_lean_bodies_group_and_align_only_when_their_node_does():
    for bottom_right, grouped in itertools.product([False, True], repeat=2):
        variant = onnx_node.BodyVariant(True, False, False, False, True, bottom_right=bottom_right, grouped=grouped)
        function = onnx_node.lean_function_proto(OPSET, variant)
        ops = [n.op_type for n in function.node]
        refs = {a.ref_attr_name for n in function.node for a in n.attribute if a.ref_attr_name}
        assert "Expand" not in ops and (S.attr_kv_num_heads in refs) == grouped  # K/V never repeated
        assert ("Sub" in ops) == bottom_right and ("IsInf" in ops) == bottom_right  # Lq > Lk may empty a row
        assert S.attr_causal_alignment not in refs  # fixed by the variant, not read at run time
        assert variant.name == "f32_causal" + "_br" * bottom_right + "_gqa" * grouped


@pytest.mark.parametrize("flags", GQA_FLAGS, ids=map(flag_id, GQA_FLAGS))
def test_a_grouped_body_reads_key_and_value_once(flags):
    """Key and value go through one Reshape and one Transpose each, straight into their MatMul:
    no Expand, Tile or Concat copies a key/value head for its group, whatever the masks."""
    causal, kpm, mask, _ = flags
    variant = onnx_node.BodyVariant(causal, kpm, mask, False, True, bottom_right=causal, grouped=True)
    nodes = onnx_node.lean_function_proto(OPSET, variant).node
    consumers = {}
    for n in nodes:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    for name in S.input_names[1:3]:
        (reshape,) = [n for n in consumers[name] if n.op_type != "Shape"]
        (transpose,) = consumers[reshape.output[0]]
        (matmul,) = consumers[transpose.output[0]]
        assert (reshape.op_type, transpose.op_type, matmul.op_type) == ("Reshape", "Transpose", "MatMul")
    assert not {"Expand", "Tile"} & {n.op_type for n in nodes}


WINDOWS = [1, 2, 5, 9]  # the diagonal alone, short, and reaching past every key (no effect)


@pytest.mark.parametrize("body", ["lean", "generic"])
@pytest.mark.parametrize("kpm", [False, True], ids=["no_kpm", "kpm"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: f"lq{x[0]}-lk{x[1]}")
@pytest.mark.parametrize("alignment", [0, 1], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_windows_match_the_spec_formula(window, alignment, lengths, kpm, body):
    (lq, lk) = lengths
    feeds, attrs = random_case((True, kpm, False, False), TensorProto.FLOAT, seed=window, heads=4, kv_heads=2,
                               lq=lq, lk=lk, causal_alignment=alignment, window=window)
    variant, out, args = run_body(body, attrs, TensorProto.FLOAT, TensorProto.FLOAT, feeds)
    assert variant.windowed and "win" in variant.name
    expected = spec_reference(*args, num_heads=4, scale=attrs[S.attr_scale], is_causal=True, softcap=0.0,
                              kv_num_heads=2, causal_alignment=alignment, window=window)
    plain = spec_reference(*args, num_heads=4, scale=attrs[S.attr_scale], is_causal=True, softcap=0.0,
                           kv_num_heads=2, causal_alignment=alignment)
    widest = lk if alignment else min(lq, lk)  # the most keys a causal row sees
    if window < widest:
        assert np.abs(expected - plain).max() > 1e-3  # the window matters here: the check can fail
    assert np.isfinite(out).all()
    assert_parity(torch.from_numpy(out), torch.from_numpy(expected), 2e-6, f"{body} body of {variant.name}")


def test_the_window_reference_is_the_torch_reference():
    from helpers import reference_attention

    feeds, attrs = random_case((True, True, False, False), TensorProto.FLOAT, seed=8, lq=7, lk=4, window=2)
    q, k, v = (torch.from_numpy(feeds[n]).double().reshape(B, -1, H, d).transpose(1, 2)
               for n, d in (("query_f32", D), ("key_f32", D), ("value_f32", DV)))
    kpm = torch.from_numpy(feeds[S.input_names[3]]).double()
    ref, _ = reference_attention(q, k, v, key_padding_mask=kpm, is_causal=True, scale=0.45, window=2)
    ours = spec_reference(*(feeds[n].astype(np.float64) for n in ("query_f32", "key_f32", "value_f32",
                                                                  *S.input_names[3:])),
                          num_heads=H, scale=0.45, is_causal=True, softcap=0.0, window=2)
    np.testing.assert_allclose(ours, ref.transpose(1, 2).reshape(B, 7, H * DV).numpy(), rtol=0, atol=1e-12)
    assert (ours[:, 5:] == 0).all()  # top-left, Lq > Lk: queries 5 and 6 have no key in their window


def test_only_windowed_lean_bodies_build_the_window():
    for windowed in (False, True):
        variant = onnx_node.BodyVariant(True, False, False, False, True, windowed=windowed)
        function = onnx_node.lean_function_proto(OPSET, variant)
        ops = [n.op_type for n in function.node]
        refs = {a.ref_attr_name for n in function.node for a in n.attribute if a.ref_attr_name}
        assert ops.count("Trilu") == 1 + windowed and (S.attr_window in refs) == windowed
        assert "Greater" not in ops  # the window is > 0 by the variant: nothing selected at run time
        assert variant.name == "f32_causal" + "_win" * windowed


def test_a_body_refuses_a_value_name_twice():
    b = onnx_body._Body()
    b.op("Shape", "query", out="x")
    with pytest.raises(ValueError, match="'x'"):
        b.op("Shape", "key", out="x")
    assert b.const("a", [1, 2]) == b.const("b", [1, 2]) == "a" and b.const("c", 1) == "c"  # 0-D is another value


def test_the_spec_reference_is_the_torch_reference():
    # The numpy formula above against tests/helpers.py's, on one case with every term.
    from helpers import reference_attention

    feeds, attrs = random_case((True, True, True, True), TensorProto.FLOAT, seed=7)
    q, k, v = (torch.from_numpy(feeds[n]).double().reshape(B, -1, H, d).transpose(1, 2)
               for n, d in (("query_f32", D), ("key_f32", D), ("value_f32", DV)))
    kpm, attn = (torch.from_numpy(feeds[n]).double() for n in S.input_names[3:])
    ref, _ = reference_attention(q, k, v, attn_mask=attn, key_padding_mask=kpm, is_causal=True, scale=0.45,
                                 softcap=1.5)
    ours = spec_reference(*(feeds[n].astype(np.float64) for n in ("query_f32", "key_f32", "value_f32",
                                                                  *S.input_names[3:])),
                          num_heads=H, scale=0.45, is_causal=True, softcap=1.5)
    np.testing.assert_allclose(ours, ref.transpose(1, 2).reshape(B, LQ, H * DV).numpy(), rtol=0, atol=1e-12)
    assert math.isfinite(ours.sum())
