"""The node's model-local function (the portable body) in ONNX Runtime against a float64
reference written from the definition (tests/helpers.py), on a hand-built one-node model."""
import math
import subprocess
import sys

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from attn_export import spec

from attn_export.onnx import node as onnx_node
from helpers import assert_parity, reference_attention

S = spec.load()
OPSET = 20


def one_node_model(attrs, elem=TensorProto.FLOAT, opset=OPSET, body="generic"):
    """One FusedAttention node with the generic function (``body="generic"``, what a node of the
    spec's domain runs) or the lean function of its variant (``"lean"``, what the exporter
    attaches: the node in the variant's domain)."""
    node = helper.make_node(S.op_type, list(S.input_names), ["out"], domain=S.domain, **attrs)
    function = onnx_node.function_proto(opset)
    if body == "lean":
        variant = onnx_node.BodyVariant.of_node(node, elem)
        node.domain = variant.domain
        function = onnx_node.lean_function_proto(opset, variant)
    inputs = [
        helper.make_tensor_value_info("query", elem, ["B", "Lq", "E"]),
        helper.make_tensor_value_info("key", elem, ["B", "Lk", "E"]),
        helper.make_tensor_value_info("value", elem, ["B", "Lk", "Ev"]),
        helper.make_tensor_value_info("key_padding_mask", TensorProto.FLOAT, ["mb", "mk"]),
        helper.make_tensor_value_info("attn_mask", TensorProto.FLOAT, ["ab", "ah", "aq", "ak"]),
    ]
    graph = helper.make_graph([node], "one_node", inputs, [helper.make_tensor_value_info("out", elem, ["B", "Lq", "Ev"])])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(node.domain, S.domain_version)],
        functions=[function],
    )
    return model


def run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def pack(t):  # [B, H, L, D] -> [B, L, H*D]
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1).numpy()


def additive(mask):
    if mask is None:
        return None
    return torch.where(mask, -math.inf, 0.0).float() if mask.dtype == torch.bool else mask.float()


BODIES = ["generic", "lean"]


def definition_case(masks, lengths, padded_row=0):
    """q, k, v [B=2, H=3, L, D=4 / Dv=6] and a padding mask (``masks`` "padding" or "both") that
    hides the second half of ``padded_row``'s keys."""
    B, H, D, Dv = 2, 3, 4, 6
    Lq, Lk = lengths
    q, k, v = torch.randn(B, H, Lq, D), torch.randn(B, H, Lk, D), torch.randn(B, H, Lk, Dv)
    padding = None
    if masks in ("padding", "both"):
        padding = torch.zeros(B, Lk, dtype=torch.bool)
        padding[padded_row, Lk // 2 + 1:] = True
    return q, k, v, padding


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masks", ["none", "padding", "attn_bool", "attn_float", "both"])
@pytest.mark.parametrize("lengths", [(5, 7), (6, 6), (1, 9)])
def test_function_body_matches_the_definition(causal, masks, lengths, body):
    q, k, v, padding = definition_case(masks, lengths)
    (B, H, Lq, _), Lk, Dv = q.shape, k.shape[2], v.shape[-1]
    attn = None
    if masks in ("attn_bool", "both"):
        attn = torch.rand(B, H, Lq, Lk) < 0.3
    if masks == "attn_float":
        attn = torch.randn(1, H, Lq, Lk)
    scale = 0.37
    attrs = onnx_node.node_attributes(H, scale, causal, padding is not None, attn is not None)
    feeds = {
        "query": pack(q), "key": pack(k), "value": pack(v),
        "key_padding_mask": additive(padding).numpy() if padding is not None else np.zeros((1, 1), np.float32),
        "attn_mask": additive(attn).numpy() if attn is not None else np.zeros((1, 1, 1, 1), np.float32),
    }
    model = one_node_model(attrs, body=body)
    onnx.checker.check_model(model, full_check=True)
    out = run(model, feeds)
    ref, _ = reference_attention(q, k, v, attn_mask=attn, key_padding_mask=padding, is_causal=causal, scale=scale)
    expected = ref.transpose(1, 2).reshape(B, Lq, H * Dv).numpy()
    assert not np.isnan(out).any()
    assert_parity(out, expected, 2e-6)


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_rows_are_zero_not_nan(body, causal):
    B, H, L, D = 2, 2, 4, 8
    q, k, v = torch.randn(B, H, L, D), torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    padding = torch.zeros(B, L, dtype=torch.bool)
    padding[1] = True  # every key of batch 1 is padding
    attn = torch.zeros(L, L, dtype=torch.bool)
    attn[2] = True  # query 2 sees nothing in any batch
    feeds = {"query": pack(q), "key": pack(k), "value": pack(v),
             "key_padding_mask": additive(padding).numpy(), "attn_mask": additive(attn)[None, None].numpy()}
    out = run(one_node_model(onnx_node.node_attributes(H, 1 / math.sqrt(D), causal, True, True), body=body), feeds)
    assert np.isfinite(out).all()
    assert (out[1] == 0).all() and (out[0, 2] == 0).all()
    assert np.abs(out[0, [0, 1, 3]]).min() > 0


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("elem,dtype,tol", [(TensorProto.FLOAT16, np.float16, 2e-3)])
def test_half_precision_inputs_accumulate_in_float32(elem, dtype, tol, body):
    B, H, Lq, Lk, D = 2, 2, 5, 9, 16
    q, k, v = torch.randn(B, H, Lq, D), torch.randn(B, H, Lk, D), torch.randn(B, H, Lk, D)
    feeds = {"query": pack(q).astype(dtype), "key": pack(k).astype(dtype), "value": pack(v).astype(dtype),
             "key_padding_mask": np.zeros((1, 1), np.float32), "attn_mask": np.zeros((1, 1, 1, 1), np.float32)}
    out = run(one_node_model(onnx_node.node_attributes(H, 0.25, True, False, False), elem, body=body), feeds)
    assert out.dtype == dtype
    ref, _ = reference_attention(q, k, v, is_causal=True, scale=0.25)
    assert_parity(out.astype(np.float32), ref.transpose(1, 2).reshape(B, Lq, -1).numpy(), tol)


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("opset", [18, 20, 23])
def test_function_is_valid_at_every_supported_opset(opset, body):
    model = one_node_model(onnx_node.node_attributes(2, 0.5, True, True, True, softcap=1.0), opset=opset, body=body)
    onnx.checker.check_model(model, full_check=True)


def test_opset_below_the_minimum_is_refused():
    with pytest.raises(ValueError, match="opset"):
        onnx_node.function_proto(S.min_onnx_opset - 1)


def test_without_the_function_onnx_runtime_cannot_run_the_node():
    """Why the function is attached: a bare custom node is not runnable."""
    model = one_node_model(onnx_node.node_attributes(2, 0.5, False, False, False))
    del model.functions[:]
    with pytest.raises(Exception, match="FusedAttention"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_checker_passes_in_a_process_without_the_registered_schema(tmp_path):
    path = tmp_path / "node.onnx"
    onnx.save(one_node_model(onnx_node.node_attributes(2, 0.5, True, True, True)), str(path))
    code = (
        "import onnx, sys; m = onnx.load(sys.argv[1]); "
        "assert not onnx.defs.has('FusedAttention', 'attn_export'); "
        "onnx.checker.check_model(m, full_check=True); print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("softcap", [0.0, 0.8, 4.0, 30.0])
@pytest.mark.parametrize("causal", [False, True])
def test_function_body_soft_caps_before_the_masks(softcap, causal, body):
    """One body for every node: softcap > 0 caps (Div, Tanh, Mul), 0 leaves the scores as
    they are without dividing by zero (a NaN would reach every output)."""
    B, H, Lq, Lk, D = 2, 3, 5, 7, 4
    q, k, v = torch.randn(B, H, Lq, D) * 3, torch.randn(B, H, Lk, D) * 3, torch.randn(B, H, Lk, D)
    padding = torch.zeros(B, Lk, dtype=torch.bool)
    padding[1, 2:] = True
    attn = torch.randn(1, H, Lq, Lk)
    attn[0, 1, 3] = -math.inf  # head 1, query 3: nothing visible
    attrs = onnx_node.node_attributes(H, 0.6, causal, True, True, softcap=softcap)
    assert attrs[S.attr_softcap] == softcap
    model = one_node_model(attrs, body=body)
    onnx.checker.check_model(model, full_check=True)
    feeds = {"query": pack(q), "key": pack(k), "value": pack(v), "key_padding_mask": additive(padding).numpy(),
             "attn_mask": attn.numpy()}
    out = run(model, feeds)
    ref, _ = reference_attention(q, k, v, attn_mask=attn, key_padding_mask=padding, is_causal=causal, scale=0.6,
                                 softcap=softcap)
    assert np.isfinite(out).all()
    assert_parity(out, ref.transpose(1, 2).reshape(B, Lq, -1).numpy(), 2e-6)


def test_a_node_without_the_softcap_attribute_is_uncapped():
    """softcap has a default (0) in the function, so a node may leave it out."""
    attrs = onnx_node.node_attributes(2, 0.5, False, False, False)
    del attrs[S.attr_softcap]
    B, L, D = 1, 4, 4
    q, k, v = torch.randn(B, 2, L, D), torch.randn(B, 2, L, D), torch.randn(B, 2, L, D)
    feeds = {"query": pack(q), "key": pack(k), "value": pack(v), "key_padding_mask": np.zeros((1, 1), np.float32),
             "attn_mask": np.zeros((1, 1, 1, 1), np.float32)}
    out = run(one_node_model(attrs), feeds)
    ref, _ = reference_attention(q, k, v, scale=0.5)
    assert_parity(out, ref.transpose(1, 2).reshape(B, L, -1).numpy(), 2e-6)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_node_attributes_refuse_a_bad_softcap(bad):
    with pytest.raises(ValueError, match="softcap"):
        onnx_node.node_attributes(2, 0.5, False, False, False, softcap=bad)


# ---- The schema, the attributes and the lean bodies' names, against the spec's words
# (csrc/attention_spec.h, docs/onnx_node.md) written out here.

def test_the_registered_schema_spells_out_the_spec():
    onnx_node.register_schema()
    onnx_node.register_schema()  # a second call is a no-op, not a "schema already registered" error
    schema = onnx.defs.get_schema("FusedAttention", S.domain_version, S.domain)
    assert (schema.domain, schema.since_version) == (S.domain, S.domain_version)
    assert [(p.name, p.type_str) for p in schema.inputs] == [
        ("query", "T"), ("key", "T"), ("value", "T"), ("key_padding_mask", "M"), ("attn_mask", "M")]
    assert [(p.name, p.type_str) for p in schema.outputs] == [(S.output_names[0], "T")]
    constraints = {c.type_param_str: sorted(c.allowed_type_strs) for c in schema.type_constraints}
    assert constraints == {"T": ["tensor(bfloat16)", "tensor(float)", "tensor(float16)"], "M": ["tensor(float)"]}
    attrs = schema.attributes
    assert sorted(attrs) == sorted(["num_heads", "scale", "is_causal", "has_key_padding_mask", "has_attn_mask",
                                    "softcap", "causal_alignment", "kv_num_heads", "window", "has_past",
                                    "alibi_slopes", "plugin_namespace", "plugin_version"])
    assert {n for n, a in attrs.items() if a.required} == {"num_heads", "scale"}
    A = onnx.defs.OpSchema.AttrType
    assert (attrs["num_heads"].type, attrs["scale"].type, attrs["softcap"].type) == (A.INT, A.FLOAT, A.FLOAT)
    # Optional without a default: onnxscript writes no empty list on nodes without slopes (one that
    # onnx-graphsurgeon and onnxslim could not write back).
    assert attrs["alibi_slopes"].type == A.FLOATS and not attrs["alibi_slopes"].default_value.name
    defaults = {n: helper.get_attribute_value(a.default_value) for n, a in attrs.items()
                if not a.required and n != "alibi_slopes"}
    assert defaults == {"is_causal": 0, "has_key_padding_mask": 0, "has_attn_mask": 0, "softcap": 0.0,
                        "causal_alignment": 0, "kv_num_heads": 0, "window": 0, "has_past": 0,
                        "plugin_namespace": b"", "plugin_version": b"6"}
    assert all(a.description for a in attrs.values())


def test_node_attributes_are_the_spec_names_with_normalized_values():
    attrs = onnx_node.node_attributes(np.int64(4), 1, 1, 0, 2, softcap=3)
    assert attrs == {"num_heads": 4, "scale": 1.0, "is_causal": 1, "has_key_padding_mask": 0, "has_attn_mask": 1,
                     "softcap": 3.0, "causal_alignment": 0, "kv_num_heads": 4, "window": 0, "has_past": 0,
                     "plugin_namespace": "", "plugin_version": "6"}
    assert [type(attrs[n]) for n in ("num_heads", "scale", "is_causal", "softcap")] == [int, float, int, float]
    # ALiBi slopes only when there are some, as floats.
    assert onnx_node.node_attributes(2, 1, 0, 0, 0, alibi_slopes=(1, np.float32(0.5)))["alibi_slopes"] == [1.0, 0.5]
    assert onnx_node.node_attributes(1, -0.5, False, False, False)["num_heads"] == 1  # the smallest head count


def test_kv_num_heads_is_written_on_every_node():
    args = (8, 0.5, True, False, False)
    assert onnx_node.node_attributes(*args)["kv_num_heads"] == 8  # no grouping: one kv head per query head
    for kv_heads in (1, 2, 4, 8):
        assert onnx_node.node_attributes(*args, kv_num_heads=np.int64(kv_heads))["kv_num_heads"] == kv_heads
    assert onnx_node.node_attributes(*args, causal_alignment=1)["causal_alignment"] == 1


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_heads=0), "num_heads must be >= 1; got 0"),
    (dict(scale=math.nan), "scale must be finite; got nan"),
    (dict(scale=-math.inf), "scale must be finite; got -inf"),
    (dict(softcap=-1e-9), "softcap must be finite and >= 0 (0 = off); got -1e-09"),
    (dict(num_heads=8, kv_num_heads=3), "kv_num_heads must divide num_heads=8; got 3"),
    (dict(kv_num_heads=0), "kv_num_heads must divide num_heads=2; got 0"),
    (dict(causal_alignment=2), "causal_alignment must be 0 or 1 (0 = top-left: query i sees keys j <= i; "
                               "1 = bottom-right: keys j <= i + Lk - Lq); got 2"),
    (dict(causal_alignment=0.5), "causal_alignment must be an integer; got 0.5"),
    (dict(num_heads=4, kv_num_heads=2.0000001), "kv_num_heads must divide num_heads=4; got 2.0000001"),
])
def test_node_attributes_refuse_bad_values_with_the_rule(kwargs, message):
    args = dict(num_heads=2, scale=0.5, is_causal=False, has_key_padding_mask=False, has_attn_mask=False)
    with pytest.raises(ValueError) as info:
        onnx_node.node_attributes(**{**args, **kwargs})
    assert str(info.value) == message


def test_an_undescribed_attribute_is_refused_naming_it_and_the_file_to_fix(monkeypatch):
    monkeypatch.delitem(onnx_node._ATTRIBUTE_DOCS, "softcap")
    monkeypatch.setattr(onnx_node.onnx.defs, "has", lambda *_: False)  # as in a fresh process
    with pytest.raises(spec.SpecError) as info:
        onnx_node.register_schema()
    assert str(info.value) == ("the node attribute 'softcap' of kAttributes (csrc/attention_spec.h) has no description: "
                               "add one to _ATTRIBUTE_DOCS in exporter/attn_export/onnx/node.py")


def test_the_minimum_opset_is_accepted_and_the_refusal_names_it():
    for make in (onnx_node.function_proto, lambda o: onnx_node.lean_function_proto(o, onnx_node.BodyVariant(
            True, True, True, True, False))):
        assert make(S.min_onnx_opset).opset_import[0].version == S.min_onnx_opset
        with pytest.raises(ValueError) as info:
            make(S.min_onnx_opset - 1)
        assert str(info.value) == (f"the FusedAttention function body needs ONNX opset >= {S.min_onnx_opset}; "
                                   f"got {S.min_onnx_opset - 1}")


@pytest.mark.parametrize("attrs,query_type,name", [
    ({}, TensorProto.FLOAT, "f32"),
    ({"is_causal": 1}, TensorProto.FLOAT16, "cast_causal"),
    ({"has_key_padding_mask": 1, "softcap": 2.0}, None, "cast_kpm_softcap"),
    ({"is_causal": 1, "has_key_padding_mask": 1, "has_attn_mask": 1, "softcap": 0.5}, TensorProto.FLOAT,
     "f32_causal_kpm_mask_softcap"),
    ({"has_attn_mask": 1, "softcap": 0.0}, TensorProto.BFLOAT16, "cast_mask"),
])
def test_body_variants_are_read_from_the_node_and_named_by_their_work(attrs, query_type, name):
    node = helper.make_node(S.op_type, list(S.input_names), ["out"], domain=S.domain, num_heads=2, scale=0.5, **attrs)
    variant = onnx_node.BodyVariant.of_node(node, query_type)
    assert variant.name == name and variant.domain == f"{S.domain}.{name}"
    function = onnx_node.lean_function_proto(OPSET, variant)
    # Its own (domain, name), no overload: tools that ignore overloads cannot mix variants up.
    assert (function.domain, function.name, function.overload) == (f"{S.domain}.{name}", S.op_type, "")
    ops = [n.op_type for n in function.node]
    assert ("Cast" in ops) == name.startswith("cast") and ("Tanh" in ops) == ("softcap" in name)
    assert ("Trilu" in ops) == ("causal" in name)
    assert ("IsInf" in ops) == ("kpm" in name or "mask" in name)  # the dead-row guard: masks only
    # Every declared input is read (an absent mask for an empty slice of its shape): tools that
    # drop unread function inputs leave the node's arity alone.
    assert set(function.input) <= {i for n in function.node for i in n.input}


@pytest.mark.parametrize("domain, ours", [
    (S.domain, True), (f"{S.domain}.f32_causal", True), (f"{S.domain}.cast_kpm_softcap", True),
    (f"{S.domain}x", False), (f"{S.domain}_cast", False), ("", False), ("ai.onnx", False), ("com.microsoft", False),
    (f"x.{S.domain}", False),
])
def test_the_attention_domains_are_the_spec_domain_and_its_variants(domain, ours):
    # What the graph checks, the TensorRT build and the opset-23 rewrite read as our node.
    assert onnx_node.is_attention_domain(domain) is ours


def test_both_bodies_declare_the_spec_attributes():
    for function in (onnx_node.function_proto(OPSET),
                     onnx_node.lean_function_proto(OPSET, onnx_node.BodyVariant(False, False, False, False, True))):
        assert list(function.input) == list(S.input_names) and list(function.output) == list(S.output_names)
        assert list(function.attribute) == ["num_heads", "scale"]
        assert {a.name: helper.get_attribute_value(a) for a in function.attribute_proto} == {
            "is_causal": 0, "has_key_padding_mask": 0, "has_attn_mask": 0, "softcap": 0.0,
            "causal_alignment": 0, "kv_num_heads": 0, "window": 0, "has_past": 0, "alibi_slopes": [0.0],
            "plugin_namespace": b"", "plugin_version": b"6"}
        assert [(o.domain, o.version) for o in function.opset_import] == [("", OPSET)]


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", ["padding", "attn"])
def test_rows_one_mask_alone_empties_are_zero(mask, causal, body):
    """The dead-row guard for a node with only one of the masks (the lean bodies guard when
    either is present): batch 1's keys all padded, or query 1 seeing no key."""
    B, H, L, D = 2, 2, 4, 4
    q, k, v = torch.randn(B, H, L, D), torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    padding = attn = None
    if mask == "padding":
        padding = torch.zeros(B, L, dtype=torch.bool)
        padding[1] = True
    else:
        attn = torch.zeros(1, 1, L, L, dtype=torch.bool)
        attn[..., 1, :] = True
    feeds = {"query": pack(q), "key": pack(k), "value": pack(v),
             "key_padding_mask": additive(padding).numpy() if padding is not None else np.zeros((1, 1), np.float32),
             "attn_mask": additive(attn).numpy() if attn is not None else np.zeros((1, 1, 1, 1), np.float32)}
    attrs = onnx_node.node_attributes(H, 0.5, causal, padding is not None, attn is not None)
    out = run(one_node_model(attrs, body=body), feeds)
    ref, _ = reference_attention(q, k, v, attn_mask=attn, key_padding_mask=padding, is_causal=causal, scale=0.5)
    expected = ref.transpose(1, 2).reshape(B, L, -1).numpy()
    assert (expected[1] == 0).all() if mask == "padding" else (expected[:, 1] == 0).all()
    assert_parity(out, expected, 2e-6)


@pytest.mark.parametrize("window", [0, 3], ids=["no_window", "window"])
@pytest.mark.parametrize("alignment", [0, 1], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("causal", [False, True])
def test_trilu_diagonal_offsets_are_0_d_as_the_operator_spec_requires(causal, alignment, window):
    # ONNX's Trilu takes its k as "a 0-D tensor"; ONNX Runtime and onnx's reference evaluator
    # also accept a one-element vector, stricter parsers need not. Both bodies, every Trilu; a k
    # computed from the lengths (bottom-right, the window's) is 0-D by shape inference of the inlined body.
    window = window if causal else 0
    attrs = onnx_node.node_attributes(2, 0.5, causal, True, True, causal_alignment=alignment, window=window)
    node = helper.make_node(S.op_type, list(S.input_names), ["out"], domain=S.domain, **attrs)
    variant = onnx_node.BodyVariant.of_node(node, TensorProto.FLOAT)
    bodies = [onnx_node.function_proto(OPSET), onnx_node.lean_function_proto(OPSET, variant)]
    trilus = 0
    for function in bodies:
        call = helper.make_node(S.op_type, list(S.input_names), ["out"], domain=function.domain, **attrs)
        # onnx.inliner does not apply a function's attribute defaults: the generic body's ALiBi
        # Constant needs the (empty) slopes on the call, as the exporter writes them.
        call.attribute.append(helper.make_attribute(S.attr_alibi_slopes, [], attr_type=onnx.AttributeProto.FLOATS))
        inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in zip(
            S.input_names, (["B", "Lq", 8], ["B", "Lk", 8], ["B", "Lk", 8], ["B", "Lk"], [1, 1, 1, 1]))]
        model = helper.make_model(
            helper.make_graph([call], "g", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)]),
            functions=[function], opset_imports=[helper.make_opsetid("", OPSET),
                                                 helper.make_opsetid(function.domain, S.domain_version)])
        inlined = onnx.shape_inference.infer_shapes(onnx.inliner.inline_local_functions(model), strict_mode=True)
        ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in inlined.graph.value_info}
        for body_node in inlined.graph.node:
            if body_node.op_type == "Trilu":
                trilus += 1
                if len(body_node.input) > 1 and body_node.input[1]:
                    assert ranks[body_node.input[1]] == 0, f"{function.name}: Trilu's k is not 0-D"
    # The generic body always holds its causal and window Trilus; the lean one what the node needs.
    assert trilus == 2 + ((2 if window else 1) if causal else 0)


# Attributes that ONNX's operator specs define as boolean flags (an int, 0 or 1).
BOOLEAN_ATTRIBUTES = {("Trilu", "upper"), ("IsInf", "detect_positive"), ("IsInf", "detect_negative"),
                      ("ReduceMax", "keepdims")}


def test_boolean_attributes_are_0_or_1_in_both_bodies():
    # ONNX Runtime reads any nonzero flag as true; the spec says 0 or 1, and a stricter consumer
    # may refuse anything else. Every mask and the cap on: the bodies hold all their nodes.
    attrs = onnx_node.node_attributes(2, 0.5, True, True, True, softcap=1.0)
    variant = onnx_node.BodyVariant.of_node(
        helper.make_node(S.op_type, list(S.input_names), ["out"], domain=S.domain, **attrs), TensorProto.FLOAT)
    seen = set()
    for function in (onnx_node.function_proto(OPSET), onnx_node.lean_function_proto(OPSET, variant)):
        for node in function.node:
            for attribute in node.attribute:
                if (node.op_type, attribute.name) in BOOLEAN_ATTRIBUTES:
                    seen.add((node.op_type, attribute.name))
                    assert helper.get_attribute_value(attribute) in (0, 1), (function.name, node.op_type, attribute.name)
    assert seen == BOOLEAN_ATTRIBUTES  # the bodies set each of them explicitly


@pytest.mark.parametrize("body", BODIES)
def test_rows_with_a_positive_infinite_score_are_nan_as_in_pytorch(body):
    # Only rows with no visible key are zeroed. A row whose scores overflow float32 to +inf, or
    # whose float mask adds +inf, is NaN, as PyTorch's SDPA gives it: validation then sees the
    # overflow instead of a row of zeros that looks like a masked one.
    B, H, L, D = 1, 2, 4, 4
    torch.manual_seed(0)
    q, k, v = torch.randn(B, H, L, D), torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    q[0, 0, 1] = 1e30
    k[0, 0, 2] = 1e10  # head 0, query 1: q . k = 4e40 -> +inf
    attn = torch.zeros(1, 1, L, L)
    attn[0, 0, 3, 0] = math.inf  # query 3 of every head: a +inf bias
    scale = 0.5
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn, scale=scale)
    expected = expected.transpose(1, 2).reshape(B, L, H * D).numpy()
    assert np.isnan(expected[0, 1, :D]).all() and np.isnan(expected[0, 3]).all()  # the reference's own view
    feeds = {"query": pack(q), "key": pack(k), "value": pack(v),
             "key_padding_mask": np.zeros((B, L), np.float32), "attn_mask": attn.numpy()}
    out = run(one_node_model(onnx_node.node_attributes(H, scale, False, True, True), body=body), feeds)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    finite = ~np.isnan(expected)
    assert_parity(out[finite], expected[finite], 2e-6)

