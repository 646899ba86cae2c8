"""export_onnx: one custom node per fused layer, the function attached, check_model passes, the
graph's dynamic axes are symbolic, and ONNX Runtime agrees with the ORIGINAL PyTorch model."""
import json
import math
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import attn_export
from attn_export import spec
from attn_export.errors import ExportError, InputError
from attn_export.inputs import resize
from attn_export.onnx import export_onnx, read_metadata
from attn_export.validation import validate
from helpers import MaskedSelfAttention, assert_parity, dims, slow_path_outputs

S = spec.load()


def session(path):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def ort_run(path, inputs):
    sess = session(path)
    return sess.run(None, {i.name: inputs[i.name].numpy() for i in sess.get_inputs()})


def fused_nodes(path):
    model = onnx.load(str(path))
    return [n for n in model.graph.node if n.op_type == S.op_type and n.domain.startswith(S.domain)], model


def attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_one_node_per_replaced_layer_with_its_attributes(exported_seq2seq):
    nodes, model = fused_nodes(exported_seq2seq.path)
    assert exported_seq2seq.replacement.num_replaced == 3 == len(nodes) == exported_seq2seq.num_attention_nodes
    onnx.checker.check_model(model, full_check=True)
    # One lean function per variant in use (docs/onnx_node.md, "The lean bodies"), in the variant's domain.
    # The first is the generic body in the spec's domain, which no node calls (for parsers that
    # look functions up by name alone).
    generic, *lean = model.functions
    assert generic.domain == S.domain and not [n for n in nodes if n.domain == S.domain]
    functions = {f.domain[len(S.domain) + 1:]: f for f in lean}
    assert all(f.name == S.op_type and not f.overload for f in model.functions)
    assert {f.domain for f in lean} == {n.domain for n in nodes}
    assert set(functions) == {"f32_kpm", "f32_causal_mask"}
    ops = {variant: [n.op_type for n in f.node] for variant, f in functions.items()}
    assert "Trilu" not in ops["f32_kpm"] and "Trilu" in ops["f32_causal_mask"]  # no causal work unless causal
    assert not [op for body in ops.values() for op in body if op in ("Cast", "CastLike", "Tanh")]  # float32, no cap
    by_flags = sorted((a["is_causal"], a["has_key_padding_mask"], a["has_attn_mask"]) for a in map(attrs, nodes))
    # encoder self-attn: padding; decoder self-attn: causal + its float causal mask; cross: padding
    assert by_flags == [(0, 1, 0), (0, 1, 0), (1, 0, 1)]
    for a in map(attrs, nodes):
        assert a["num_heads"] == 2
        assert math.isclose(a["scale"], 1 / math.sqrt(8), rel_tol=1e-6)
    # No attention math outside the nodes: the only Softmax is inside the function.
    assert not [n for n in model.graph.node if n.op_type == "Softmax"]
    assert read_metadata(model)["attention_nodes"] == "3"


def test_dynamic_axes_are_symbolic_and_independent(exported_seq2seq):
    model = onnx.load(str(exported_seq2seq.path))
    assert dims(model, "src")[:2] == ["batch", "seq"]
    assert dims(model, "tgt")[:2] == ["batch", "tgt_seq"]
    assert dims(model, "src_key_padding_mask") == ["batch", "seq"]
    assert dims(model, "output")[:2] == ["batch", "tgt_seq"]
    assert [i.name for i in model.graph.input] == ["src", "tgt", "src_key_padding_mask"]


def test_a_runtime_that_finds_functions_by_name_alone_gets_a_body_right_for_every_node(small_seq2seq,
                                                                                     exported_seq2seq, tmp_path):
    """TensorRT's parser keys model-local functions by name alone, the first one winning, when it
    runs a node's function instead of the plugin. Emulated: every FusedAttention node calls the
    model's first function of that name, the others removed; ONNX Runtime must still match."""
    model = onnx.load(str(exported_seq2seq.path))
    first = next(f for f in model.functions if f.name == S.op_type)
    nodes = [n for n in model.graph.node if n.op_type == S.op_type]
    assert len({n.domain for n in nodes}) == 2  # two variants: a wrong body would show
    for node in nodes:
        node.domain = first.domain
    kept = [f for f in model.functions if f.name != S.op_type or f is first]
    del model.functions[:]
    model.functions.extend(kept)
    path = tmp_path / "by_name.onnx"
    onnx.save(model, str(path))
    inputs = resize(small_seq2seq.example_inputs, {"src": {0: "batch", 1: "seq"}, "tgt": {0: "batch", 1: "tgt_seq"},
                                                   "src_key_padding_mask": {0: "batch", 1: "seq"}},
                    {"batch": 2, "seq": 9, "tgt_seq": 6}, seed=3)
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            expected = small_seq2seq(**inputs)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    (out,) = ort_run(path, inputs)
    assert_parity(torch.from_numpy(out), expected, 5e-6, "every node on the first function")


def test_every_intermediate_value_has_its_shape_in_the_file(exported_seq2seq):
    """Shape inference ran before saving: each node output is in value_info with a shape whose
    rank is known (tools such as Polygraphy read shapes from the file), the attention nodes'
    outputs with their symbolic batch and length."""
    model = onnx.load(str(exported_seq2seq.path))
    recorded = {v.name: v for v in list(model.graph.value_info) + list(model.graph.output)}
    produced = [o for n in model.graph.node for o in n.output if o]
    assert produced and [o for o in produced if o not in recorded] == []
    assert [o for o in produced if not recorded[o].type.tensor_type.HasField("shape")] == []
    nodes, _ = fused_nodes(exported_seq2seq.path)
    for node in nodes:
        dims = [d.dim_param or d.dim_value for d in recorded[node.output[0]].type.tensor_type.shape.dim]
        assert dims[0] == "batch" and dims[1] in ("seq", "tgt_seq") and dims[2] == 16, (node.name, dims)


@pytest.mark.parametrize("sizes", [{}, {"batch": 1}, {"seq": 1, "tgt_seq": 1}, {"seq": 7, "tgt_seq": 13},
                                   {"batch": 3, "seq": 40, "tgt_seq": 3}])
def test_onnx_runtime_matches_the_original_model(small_seq2seq, exported_seq2seq, sizes):
    example = small_seq2seq.example_inputs
    axes = {"src": {0: "batch", 1: "seq"}, "tgt": {0: "batch", 1: "tgt_seq"},
            "src_key_padding_mask": {0: "batch", 1: "seq"}}
    base = {"batch": 2, "seq": 16, "tgt_seq": 12}
    inputs = resize(example, axes, {**base, **sizes}, seed=1)
    expected = slow_path_outputs(small_seq2seq, inputs)
    (out,) = ort_run(exported_seq2seq.path, inputs)
    assert out.shape == tuple(expected.shape)
    assert_parity(torch.from_numpy(out), expected, 5e-6, "output")


def test_the_original_model_is_not_modified(small_seq2seq, exported_seq2seq):
    assert not any(isinstance(m, attn_export.FusedMultiheadAttention) for m in small_seq2seq.modules())


def test_file_loads_and_checks_in_a_fresh_process(exported_seq2seq):
    code = (
        "import sys, onnx, onnxruntime as ort, numpy as np\n"
        "m = onnx.load(sys.argv[1]); onnx.checker.check_model(m, full_check=True)\n"
        "s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n"
        "f = {'src': np.zeros((3, 5, 8), np.float32), 'tgt': np.zeros((3, 4, 8), np.float32),\n"
        "     'src_key_padding_mask': np.zeros((3, 5), bool)}\n"
        "print(s.run(None, f)[0].shape)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(exported_seq2seq.path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(3, 4, 8)"


class SoftcapModel(nn.Module):
    """Gemma 2-style attention core: soft-capped scores, a padding mask and a float mask."""

    def __init__(self, softcap):
        super().__init__()
        self.softcap = softcap

    def forward(self, q, k, v, key_padding_mask, attn_mask):
        return attn_export.attention(q, k, v, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                     is_causal=True, scale=0.7, softcap=self.softcap)


@pytest.mark.parametrize("softcap", [1.5, 50.0])
def test_softcap_exports_as_the_node_attribute_and_onnx_runtime_matches_float64(tmp_path, softcap):
    from helpers import reference_attention

    # Scores of magnitude ~20 (q, k of std 3; resize keeps it): far beyond softcap 1.5.
    q, k, v = torch.randn(2, 3, 5, 8) * 3, torch.randn(2, 3, 7, 8) * 3, torch.randn(2, 3, 7, 6)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 3:] = True
    mask = torch.randn(5, 7)
    inputs = {"q": q, "k": k, "v": v, "key_padding_mask": pad, "attn_mask": mask}
    axes = {"q": {0: "batch", 2: "lq"}, "k": {0: "batch", 2: "lk"}, "v": {0: "batch", 2: "lk"},
            "key_padding_mask": {0: "batch", 1: "lk"}, "attn_mask": {0: "lq", 1: "lk"}}
    result = export_onnx(SoftcapModel(softcap), inputs, tmp_path / "softcap.onnx", dynamic_axes=axes, replace=False)
    nodes, model = fused_nodes(result.path)
    onnx.checker.check_model(model, full_check=True)
    assert len(nodes) == 1
    assert math.isclose(attrs(nodes[0])[S.attr_softcap], softcap, rel_tol=1e-6)
    assert {o.domain: o.version for o in model.opset_import}[nodes[0].domain] == S.domain_version == 6
    assert attrs(nodes[0])[S.attr_plugin_version] == b"6"
    for shapes in ({"batch": 2, "lq": 5, "lk": 7}, {"batch": 3, "lq": 9, "lk": 4}):
        other = resize(inputs, axes, shapes, seed=3)
        (out,) = ort_run(result.path, other)
        expected, _ = reference_attention(other["q"], other["k"], other["v"], attn_mask=other["attn_mask"],
                                          key_padding_mask=other["key_padding_mask"], is_causal=True, scale=0.7,
                                          softcap=softcap)
        assert np.isfinite(out).all()
        # float32 scores of magnitude ~20 carry ~2e-6 absolute rounding into the softmax.
        assert_parity(out, expected.numpy(), 5e-5)
        uncapped, _ = reference_attention(other["q"], other["k"], other["v"], attn_mask=other["attn_mask"],
                                          key_padding_mask=other["key_padding_mask"], is_causal=True, scale=0.7)
        if softcap < 10:  # the cap changes the result: the body does apply it
            assert np.abs(out - uncapped.numpy()).max() > 1e-2


class CoreModel(nn.Module):
    def forward(self, q, k, v, key_padding_mask):
        return attn_export.attention(q, k, v, key_padding_mask=key_padding_mask, is_causal=True, scale=0.3)


def test_the_core_op_alone_exports_as_one_node(tmp_path):
    q, k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 6)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 3:] = True
    inputs = {"q": q, "k": k, "v": v, "key_padding_mask": pad}
    axes = {"q": {0: "batch", 2: "lq"}, "k": {0: "batch", 2: "lk"}, "v": {0: "batch", 2: "lk"},
            "key_padding_mask": {0: "batch", 1: "lk"}}
    result = export_onnx(CoreModel(), inputs, tmp_path / "core.onnx", dynamic_axes=axes, replace=False)
    nodes, model = fused_nodes(result.path)
    assert len(nodes) == 1 and attrs(nodes[0])["num_heads"] == 3 and attrs(nodes[0])["is_causal"] == 1
    assert attrs(nodes[0])[S.attr_softcap] == 0.0  # no soft-cap: the attribute says off
    assert math.isclose(attrs(nodes[0])["scale"], 0.3, rel_tol=1e-6)
    assert dims(model, "q") == ["batch", 3, "lq", 4]
    other = resize(inputs, axes, {"batch": 3, "lq": 9, "lk": 4}, seed=2)
    (out,) = ort_run(result.path, other)
    expected = CoreModel()(**other)
    assert_parity(out, expected.numpy(), 2e-6)


class GroupedBottomRightModel(nn.Module):
    def forward(self, q, k, v):
        return attn_export.attention(q, k, v, is_causal=True, scale=0.4, causal_alignment=1)


def test_grouped_query_and_bottom_right_causal_export_as_node_attributes(tmp_path):
    """Key/value with 2 heads for 4 query heads go into the node as they are (kv_num_heads=2),
    causal_alignment=1 is the node's attribute, and ONNX Runtime matches PyTorch's SDPA
    (enable_gqa, a bottom-right boolean mask) at Lq < Lk and Lq > Lk (rows without a key: 0)."""
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 6)
    inputs = {"q": q, "k": k, "v": v}
    axes = {"q": {0: "batch", 2: "lq"}, "k": {0: "batch", 2: "lk"}, "v": {0: "batch", 2: "lk"}}
    result = export_onnx(GroupedBottomRightModel(), inputs, tmp_path / "gqa.onnx", dynamic_axes=axes, replace=False)
    nodes, model = fused_nodes(result.path)
    onnx.checker.check_model(model, full_check=True)
    assert len(nodes) == 1
    assert (attrs(nodes[0])[S.attr_num_heads], attrs(nodes[0])[S.attr_kv_num_heads]) == (4, 2)
    assert attrs(nodes[0])[S.attr_causal_alignment] == 1 and attrs(nodes[0])[S.attr_is_causal] == 1
    assert "Expand" not in {n.op_type for n in model.graph.node}
    for shapes in ({"batch": 2, "lq": 3, "lk": 7}, {"batch": 3, "lq": 6, "lk": 4}):
        other = resize(inputs, axes, shapes, seed=4)
        (out,) = ort_run(result.path, other)
        lq, lk = shapes["lq"], shapes["lk"]
        visible = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        expected = torch.nn.functional.scaled_dot_product_attention(
            other["q"].double(), other["k"].double(), other["v"].double(), attn_mask=visible, scale=0.4,
            enable_gqa=True).nan_to_num(0.0)  # SDPA's NaN rows are the node's zero rows
        assert_parity(out, expected.float().numpy(), 2e-6)


class WeightsModel(nn.Module):
    def __init__(self, use_weights, batch_first=True, average=True):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=batch_first)
        self.use_weights = use_weights
        self.average = average

    def forward(self, x, memory):
        y, w = self.attn(x, memory, memory, average_attn_weights=self.average)  # need_weights defaults to True
        return (y, w) if self.use_weights else y


def test_unused_attention_weights_cost_nothing(tmp_path):
    torch.manual_seed(0)
    model = WeightsModel(use_weights=False).eval()
    inputs = {"x": torch.randn(2, 5, 16), "memory": torch.randn(2, 7, 16)}
    result = export_onnx(model, inputs, tmp_path / "w.onnx")
    nodes, onnx_model = fused_nodes(result.path)
    assert len(nodes) == 1 and not [n for n in onnx_model.graph.node if n.op_type == "Softmax"]
    (out,) = ort_run(result.path, inputs)
    assert_parity(out, model(**inputs).detach().numpy(), 2e-6)


@pytest.mark.parametrize("average", [True, False])
def test_used_attention_weights_are_exported_too(tmp_path, average):
    torch.manual_seed(0)
    model = WeightsModel(use_weights=True, batch_first=False, average=average).eval()
    inputs = {"x": torch.randn(5, 2, 16), "memory": torch.randn(7, 2, 16)}
    axes = {"x": {0: "lq", 1: "batch"}, "memory": {0: "lk", 1: "batch"}}
    result = export_onnx(model, inputs, tmp_path / "w.onnx", dynamic_axes=axes)
    assert result.output_names == ["output_0", "output_1"]
    other = resize(inputs, axes, {"lq": 3, "lk": 9, "batch": 3}, seed=3)
    out, weights = ort_run(result.path, other)
    ref_out, ref_w = model(**other)
    assert_parity(out, ref_out.detach().numpy(), 2e-6)
    assert_parity(weights, ref_w.detach().numpy(), 2e-6)


def test_unbatched_and_float_masks(tmp_path):
    class Unbatched(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2)

        def forward(self, x, bias):
            return self.attn(x, x, x, attn_mask=bias, need_weights=False)[0]

    torch.manual_seed(0)
    model = Unbatched().eval()
    inputs = {"x": torch.randn(6, 16), "bias": torch.randn(6, 6)}
    axes = {"x": {0: "seq"}, "bias": {0: "seq", 1: "seq"}}
    result = export_onnx(model, inputs, tmp_path / "u.onnx", dynamic_axes=axes)
    node = fused_nodes(result.path)[0][0]
    assert attrs(node)["has_attn_mask"] == 1 and attrs(node)["has_key_padding_mask"] == 0
    other = resize(inputs, axes, {"seq": 11}, seed=4)
    (out,) = ort_run(result.path, other)
    assert_parity(out, model(**other).detach().numpy(), 2e-6)


def test_per_head_boolean_mask(tmp_path):
    torch.manual_seed(0)
    model = MaskedSelfAttention(16, 2).eval()
    mask = torch.rand(2 * 2, 5, 5) < 0.3
    mask[..., 0] = False
    result = export_onnx(model, {"x": torch.randn(2, 5, 16), "mask": mask}, tmp_path / "h.onnx", dynamic_axes={})
    x = torch.randn(2, 5, 16)
    (out,) = ort_run(result.path, {"x": x, "mask": mask})
    assert_parity(out, model(x, mask).detach().numpy(), 2e-6)


def test_size_one_example_is_traced_at_two_and_stays_dynamic(tmp_path):
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    result = export_onnx(model, {"src": torch.randn(1, 1, 16)}, tmp_path / "one.onnx")
    assert any("size 2" in note for note in result.notes)
    assert dims(onnx.load(str(result.path)), "src") == ["batch", "seq", 16]
    x = torch.randn(3, 4, 16)
    (out,) = ort_run(result.path, {"src": x})
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        expected = model(x).detach().numpy()
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert_parity(out, expected, 5e-6)


def test_static_export_and_fp16_export(tmp_path):
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    static = export_onnx(model, {"src": x}, tmp_path / "s.onnx", dynamic_axes={})
    assert dims(onnx.load(str(static.path)), "src") == [2, 5, 16] and static.dynamic_axes == {}
    half = export_onnx(model, {"src": x}, tmp_path / "h.onnx", dtype="fp16")
    onnx_model = onnx.load(str(half.path))
    assert onnx_model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    (out,) = ort_run(half.path, {"src": x.half()})
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        expected = model(x).detach()
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert out.dtype == np.float16
    assert_parity(torch.from_numpy(out.astype(np.float32)), expected, 2e-2, "fp16 output")


def test_the_export_group_and_its_keywords_are_one_api(tmp_path):
    """export_onnx(..., ExportOptions(...)) and its fields as keywords (applied over the group)."""
    from attn_export.options import ExportOptions

    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    result = export_onnx(model, {"src": torch.randn(2, 5, 16)}, tmp_path / "g.onnx",
                         ExportOptions(dynamic_axes={}, dtype="fp32", replace=False), dtype="fp16")
    onnx_model = onnx.load(str(result.path))
    assert result.dynamic_axes == {} and dims(onnx_model, "src") == [2, 5, 16]
    assert result.dtype == "fp16" and onnx_model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert result.num_attention_nodes == 0 and result.replacement is None  # replace=False: exported as it is
    with pytest.raises(InputError, match="--dtype fp8"):
        export_onnx(model, {"src": torch.randn(2, 5, 16)}, tmp_path / "bad.onnx", dtype="fp8")
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        export_onnx(model, {"src": torch.randn(2, 5, 16)}, tmp_path / "bad.onnx", precision="fp16")
    assert not (tmp_path / "bad.onnx").exists()


def test_input_and_output_errors_leave_no_file(tmp_path):
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    with pytest.raises(InputError, match="rejected the example inputs"):
        export_onnx(model, {"src": torch.randn(2, 5, 12)}, tmp_path / "bad.onnx")
    with pytest.raises(InputError, match="unknown input name"):
        export_onnx(model, {"source": torch.randn(2, 5, 16)}, tmp_path / "bad.onnx")
    with pytest.raises(InputError, match="does not exist"):
        export_onnx(model, {"src": torch.randn(2, 5, 16)}, tmp_path / "missing" / "bad.onnx")
    with pytest.raises(InputError, match="opset"):
        export_onnx(model, {"src": torch.randn(2, 5, 16)}, tmp_path / "bad.onnx", opset=12)
    assert list(tmp_path.iterdir()) == []


def test_an_axis_the_model_specializes_is_reported(tmp_path):
    class FixedLength(nn.Module):
        def forward(self, x):
            return x.reshape(x.shape[0], 5 * 16)  # only works for length 5

    class Branch(nn.Module):
        def forward(self, x):
            return x * 2 if x.shape[1] == 5 else x  # torch.export specializes the length to 5

    declared = {"x": {0: "batch", 1: "seq"}}
    for model in (FixedLength(), Branch()):
        with pytest.raises(ExportError, match=r"came out static: x:1 \(seq"):
            export_onnx(model, {"x": torch.randn(2, 5, 16)}, tmp_path / "f.onnx", dynamic_axes=declared)
    assert not (tmp_path / "f.onnx").exists()
    # Declared static, the same model exports.
    result = export_onnx(Branch(), {"x": torch.randn(2, 5, 16)}, tmp_path / "f.onnx", dynamic_axes={"x": {0: "batch"}})
    assert result.dynamic_axes == {"x": {0: "batch"}}


def test_a_default_axis_the_model_specializes_stays_static_with_a_note(tmp_path):
    """No axes declared: the defaults that come out static are dropped (with a note), not an error;
    the file records only the dynamic ones, and the gate sweeps those."""
    class Channels(nn.Module):  # a 3-D [B, C, L] signal whose channel count is fixed
        def __init__(self):
            super().__init__()
            self.proj = nn.Conv1d(3, 4, 1)

        def forward(self, x):
            return self.proj(x)

    path, model = tmp_path / "c.onnx", Channels().eval()
    result = export_onnx(model, {"x": torch.randn(2, 3, 7)}, path)
    assert result.dynamic_axes == {"x": {0: "batch"}}
    assert any("default dynamic axes the model specializes stay static: x:1 (seq, came out as 3)" in note
               for note in result.notes)
    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert json.loads(meta["attn_export.dynamic_axes"]) == {"x": {"0": "batch"}}
    report = validate(model, path, {"x": torch.randn(2, 3, 7)})
    assert report.passed, report.failures


def test_output_names_never_collide_with_input_names(tmp_path):
    """diffusers' UNet returns its output under the name of its input (``sample``): an ONNX graph
    names every value once."""
    class Same(nn.Module):
        def forward(self, sample):
            return {"sample": sample * 2, "sample_output": sample + 1}

    path = tmp_path / "s.onnx"
    result = export_onnx(Same(), {"sample": torch.randn(2, 5, 4)}, path)
    assert result.output_names == ["sample_output_output", "sample_output"] or \
        result.output_names == ["sample_output", "sample_output_output"]
    graph = onnx.load(str(path)).graph
    assert [v.name for v in graph.input] == ["sample"]
    assert len({v.name for v in graph.output} | {"sample"}) == 3
    x = torch.randn(3, 6, 4)
    assert validate(Same(), path, {"sample": x}).passed


def test_a_symbolic_bool_failure_says_what_to_try(tmp_path):
    class CausalWhenLong(nn.Module):  # whisper: is_causal=q.shape[2] > 1 on SDPA
        def forward(self, x):
            q = x.unsqueeze(1)
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=q.shape[2] > 1)

    with pytest.raises(ExportError) as info:
        export_onnx(CausalWhenLong(), {"x": torch.randn(2, 5, 4)}, tmp_path / "b.onnx", replace=False)
    message = str(info.value)
    if "SymBool" not in message:
        pytest.skip(f"this torch exports it: {message[:80]}")
    assert "keep that input's sequence static" in message


def _padded_cross_inputs(query: str, kdim: int, vdim: int):
    """Query [2, 5, 16], key [2, 7, kdim], value [2, 7, vdim] and a key-padding mask (row 1 padded
    from key 5), with dynamic batch, query length and key length."""
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    inputs = {query: torch.randn(2, 5, 16), "k": torch.randn(2, 7, kdim), "v": torch.randn(2, 7, vdim),
              "key_padding_mask": pad}
    axes = {query: {0: "batch", 1: "lq"}, "k": {0: "batch", 1: "lk"}, "v": {0: "batch", 1: "lk"},
            "key_padding_mask": {0: "batch", 1: "lk"}}
    return inputs, axes


@pytest.mark.parametrize("bias", [True, False])
def test_separate_query_key_value_with_and_without_bias(tmp_path, bias):
    class Separate(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 4, bias=bias, batch_first=True)

        def forward(self, q, k, v, key_padding_mask):
            return self.attn(q, k, v, key_padding_mask=key_padding_mask, need_weights=False)[0]

    torch.manual_seed(0)
    model = Separate().eval()
    inputs, axes = _padded_cross_inputs("q", kdim=16, vdim=16)
    result = export_onnx(model, inputs, tmp_path / "sep.onnx", dynamic_axes=axes)
    nodes, onnx_model = fused_nodes(result.path)
    assert len(nodes) == 1 and sum(n.op_type == "MatMul" for n in onnx_model.graph.node) == 4
    other = resize(inputs, axes, {"batch": 3, "lq": 2, "lk": 11}, seed=5)
    (out,) = ort_run(result.path, other)
    assert_parity(out, model(**other).detach().numpy(), 2e-6)


class CoreOperatorLayers(nn.Module):
    """The configurations that run on the attention-core operator: kdim/vdim, add_bias_kv,
    add_zero_attn."""

    def __init__(self):
        super().__init__()
        self.cross = nn.MultiheadAttention(16, 2, kdim=8, vdim=12, batch_first=True)
        self.extra = nn.MultiheadAttention(16, 4, add_bias_kv=True, add_zero_attn=True, batch_first=True)

    def forward(self, x, k, v, key_padding_mask):
        y = self.cross(x, k, v, key_padding_mask=key_padding_mask, need_weights=False)[0]
        return self.extra(y, y, y, need_weights=False)[0]


def test_core_operator_configurations_export_and_validate(tmp_path):
    from attn_export.validation import validate

    torch.manual_seed(0)
    model = CoreOperatorLayers().eval()
    with torch.no_grad():
        for layer in (model.cross, model.extra):
            layer.in_proj_bias.normal_(0, 0.1)
    inputs, axes = _padded_cross_inputs("x", kdim=8, vdim=12)
    result = export_onnx(model, inputs, tmp_path / "core.onnx", dynamic_axes=axes)
    assert result.replacement.num_replaced == 2
    nodes, onnx_model = fused_nodes(result.path)
    assert len(nodes) == 2 and not [n for n in onnx_model.graph.node if n.op_type == "Softmax"]
    other = resize(inputs, axes, {"batch": 3, "lq": 2, "lk": 11}, seed=5)
    (out,) = ort_run(result.path, other)
    assert_parity(out, model(**other).detach().numpy(), 2e-6)
    report = validate(model, result.path, inputs, dynamic_axes=axes)
    assert report.passed, report


