"""The standard-Attention flavor (--onnx-attention standard): the rewrite of one node against a
float64 reference written from the definition, the layers it keeps custom, the opset rule, and
the parity gate on the models the suite exports (encoder, decoder with cross-attention,
transformers BERT/GPT-2/ViT)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from attn_export import spec

from attn_export.onnx import node as onnx_node
from attn_export.onnx import attention_flavor, export_onnx, to_standard_attention
from attn_export.validation import validate
from helpers import assert_parity, invoke, one_line_error, reference_attention
from test_onnx_node import additive, definition_case, one_node_model, pack

S = spec.load()


def standard_model(attrs, elem=TensorProto.FLOAT):
    model = one_node_model(attrs, elem, opset=23)
    rewrite = to_standard_attention(model)
    onnx.checker.check_model(model, full_check=True)
    return model, rewrite


def run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masks", ["none", "padding", "attn_float", "both"])
@pytest.mark.parametrize("lengths", [(5, 7), (7, 3)])
def test_one_standard_node_matches_the_definition(causal, masks, lengths):
    q, k, v, padding = definition_case(masks, lengths, padded_row=1)
    (B, H, Lq, _), Lk, Dv = q.shape, k.shape[2], v.shape[-1]
    attn = None
    if masks == "both":
        attn = torch.rand(B, H, Lq, Lk) < 0.3  # per head: the guard works per head
    if masks == "attn_float":
        attn = torch.randn(1, 1, Lq, Lk)
    model, rewrite = standard_model(onnx_node.node_attributes(H, 0.37, causal, padding is not None, attn is not None))
    assert rewrite.converted == 1 and attention_flavor(model)["flavor"] == "standard"
    assert not any(o.domain == S.domain for o in model.opset_import)
    feeds = {"query": pack(q), "key": pack(k), "value": pack(v),
             "key_padding_mask": additive(padding).numpy() if padding is not None else np.zeros((1, 1), np.float32),
             "attn_mask": additive(attn).numpy() if attn is not None else np.zeros((1, 1, 1, 1), np.float32)}
    out = run(model, feeds)
    ref, _ = reference_attention(q, k, v, attn_mask=attn, key_padding_mask=padding, is_causal=causal, scale=0.37)
    expected = ref.transpose(1, 2).reshape(B, Lq, H * Dv).numpy()
    assert_parity(out, expected, 2e-6)  # the reference is 0 on rows the masks empty


@pytest.mark.parametrize("elem,dtype,tol", [(TensorProto.FLOAT16, np.float16, 3e-3), (TensorProto.BFLOAT16, None, 2e-2)])
def test_half_precision(elem, dtype, tol):
    """fp16 runs natively (mask cast to fp16); bf16 runs in float32 between Casts (ONNX Runtime's
    CPU kernel has no bf16)."""
    import ml_dtypes  # numpy's bfloat16 (onnx depends on it)

    dtype = dtype or ml_dtypes.bfloat16
    B, H, Lq, Lk, D = 2, 2, 5, 9, 16
    q, k, v = torch.randn(B, H, Lq, D), torch.randn(B, H, Lk, D), torch.randn(B, H, Lk, D)
    padding = torch.zeros(B, Lk, dtype=torch.bool)
    padding[0, 4:] = True
    model, _ = standard_model(onnx_node.node_attributes(H, 0.25, True, True, False), elem)
    feeds = {"query": pack(q).astype(dtype), "key": pack(k).astype(dtype), "value": pack(v).astype(dtype),
             "key_padding_mask": additive(padding).numpy(), "attn_mask": np.zeros((1, 1, 1, 1), np.float32)}
    if elem == TensorProto.BFLOAT16:  # onnxruntime's Python API takes bf16 as OrtValues of the raw bits
        model.graph.node.append(onnx.helper.make_node("Cast", ["out"], ["out_f32"], to=TensorProto.FLOAT))
        model.graph.output.append(onnx.helper.make_tensor_value_info("out_f32", TensorProto.FLOAT, None))
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        values = {n: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(x.view(np.uint16), elem) if x.dtype == dtype
                  else ort.OrtValue.ortvalue_from_numpy(x) for n, x in feeds.items()}
        (out,) = session.run_with_ort_values(["out_f32"], values)
        out = out.numpy()
    else:
        out = run(model, feeds)
    ref, _ = reference_attention(q, k, v, key_padding_mask=padding, is_causal=True, scale=0.25)
    assert_parity(out.astype(np.float32), ref.transpose(1, 2).reshape(B, Lq, -1).numpy(), tol)


def test_fully_masked_rows_are_zero():
    B, H, L, D = 2, 2, 4, 8
    q, k, v = torch.randn(B, H, L, D), torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    padding = torch.zeros(B, L, dtype=torch.bool)
    padding[1] = True
    model, _ = standard_model(onnx_node.node_attributes(H, 0.3, False, True, False))
    out = run(model, {"query": pack(q), "key": pack(k), "value": pack(v), "key_padding_mask": additive(padding).numpy(),
                      "attn_mask": np.zeros((1, 1, 1, 1), np.float32)})
    assert (out[1] == 0).all() and np.abs(out[0]).min() > 0
    # ONNX Runtime 1.32 (and onnx's reference) already give 0 there; the opset-23 text allows NaN or
    # uniform weights, so the guard must be in the file for other runtimes: a Where reads the output.
    (attention,) = [n for n in model.graph.node if n.op_type == "Attention"]
    readers = [n.op_type for n in model.graph.node if attention.output[0] in n.input]
    assert readers == ["Where"]


@pytest.mark.parametrize("causal,kpm,mask,converted", [(False, False, False, 1), (True, False, False, 0),
                                                        (False, True, False, 0), (False, False, True, 0)])
def test_softcap_with_masks_keeps_the_custom_node_and_says_why(causal, kpm, mask, converted):
    model, rewrite = standard_model(onnx_node.node_attributes(2, 0.5, causal, kpm, mask, softcap=5.0))
    assert rewrite.converted == converted
    if not converted:
        (reason,) = rewrite.kept
        assert "soft-capping" in reason
        assert attention_flavor(model)["flavor"] == "custom"
        assert [f.name for f in model.functions] == [S.op_type]  # still runnable: its function is there
        B, H, L, D = 1, 2, 4, 4
        q, k, v = torch.randn(B, H, L, D), torch.randn(B, H, L, D), torch.randn(B, H, L, D)
        feeds = {"query": pack(q), "key": pack(k), "value": pack(v),
                 "key_padding_mask": np.zeros((1, 1), np.float32), "attn_mask": np.zeros((1, 1, 1, 1), np.float32)}
        ref, _ = reference_attention(q, k, v, is_causal=causal, scale=0.5, softcap=5.0)
        assert_parity(run(model, feeds), ref.transpose(1, 2).reshape(B, L, -1).numpy(), 2e-6)


@pytest.mark.parametrize("lengths", [(5, 7), (7, 4)], ids=lambda x: f"lq{x[0]}-lk{x[1]}")
@pytest.mark.parametrize("masks", ["none", "padding"])
@pytest.mark.parametrize("causal,alignment", [(False, 0), (True, 0), (True, 1)],
                         ids=["plain", "causal_top_left", "causal_bottom_right"])
@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (4, 2), (4, 1)], ids=lambda x: str(x))
def test_grouped_heads_and_bottom_right_causal_convert_exactly(heads, kv_heads, causal, alignment, masks, lengths):
    """Grouped-query layers become Attention with their own kv_num_heads (no repeated K/V), and
    bottom-right causal joins the explicit mask (opset 23's is_causal is top-left without a
    cache), with the guard zeroing the rows Lq > Lk leaves without a key; against the float64
    formula of test_onnx_body, in ONNX Runtime's own Attention kernel."""
    from test_onnx_body import random_case, spec_reference

    lq, lk = lengths
    flags = (causal, masks == "padding", False, False)
    feeds32, attrs = random_case(flags, TensorProto.FLOAT, seed=heads + kv_heads, heads=heads, kv_heads=kv_heads,
                                 lq=lq, lk=lk, causal_alignment=alignment)
    model, rewrite = standard_model(attrs)
    assert rewrite.converted == 1 and attention_flavor(model)["flavor"] == "standard"
    (attention,) = [n for n in model.graph.node if n.op_type == "Attention"]
    got = {a.name: helper.get_attribute_value(a) for a in attention.attribute}
    assert (got["q_num_heads"], got["kv_num_heads"]) == (heads, kv_heads)
    assert got["is_causal"] == int(causal and alignment == 0 and masks == "none")
    assert not {"Expand", "Tile"} & {n.op_type for n in model.graph.node if attention.input[1] in n.output
                                    or attention.input[2] in n.output}
    feeds = {name: feeds32[f"{name}_f32"] for name in ("query", "key", "value")}
    feeds.update({name: feeds32[name] for name in S.input_names[3:]})
    args = [feeds[n].astype(np.float64) for n in S.input_names]
    expected = spec_reference(*args, num_heads=heads, scale=attrs[S.attr_scale], is_causal=causal, softcap=0.0,
                              kv_num_heads=kv_heads, causal_alignment=alignment)
    assert_parity(run(model, feeds), expected, 2e-6)


def test_an_attribute_the_rewrite_does_not_express_keeps_the_custom_node():
    """An attribute the rewrite does not carry over (one added to the spec after it was written),
    set off its default, keeps the custom node: dropping it would change what the node computes."""
    from attn_export.onnx.standard import why_not_standard

    attrs = onnx_node.node_attributes(2, 0.5, False, False, False)
    plain = helper.make_node(S.op_type, list(S.input_names), ["out"], domain=S.domain, **attrs)
    assert why_not_standard(plain) is None
    extra = helper.make_node(S.op_type, list(S.input_names), ["out"], domain=S.domain, **attrs, future_attribute=3)
    assert why_not_standard(extra) == "attribute future_attribute has no counterpart in the standard Attention operator"


@pytest.mark.parametrize("alignment", [0, 1], ids=["top_left", "bottom_right"])
def test_a_sliding_window_keeps_the_custom_node_and_says_why(alignment):
    """Opset 23 Attention has no window: a windowed causal layer stays custom (with its function,
    so it still runs), named in kept; the same node without a window converts."""
    plain, rewrite = standard_model(onnx_node.node_attributes(2, 0.5, True, False, False, causal_alignment=alignment))
    assert rewrite.converted == 1 and not rewrite.kept
    model, rewrite = standard_model(onnx_node.node_attributes(2, 0.5, True, False, False, causal_alignment=alignment,
                                                              window=3))
    assert rewrite.converted == 0
    (reason,) = rewrite.kept
    assert "sliding window (window=3)" in reason and "opset 23 Attention has no window" in reason
    assert attention_flavor(model)["flavor"] == "custom"
    assert [f.name for f in model.functions] == [S.op_type]


def test_opset_below_23_is_refused():
    with pytest.raises(ValueError, match="opset >= 23"):
        to_standard_attention(one_node_model(onnx_node.node_attributes(2, 0.5, False, False, False), opset=22))
    proc = invoke("--model", "attn_export.examples:tiny_seq2seq", "--onnx-attention", "standard", "--opset", "22")
    one_line_error(proc, "--onnx-attention standard", "opset 23")
    assert proc.returncode == 2


# The parity gate on the models the suite exports, in the standard flavor.


def _hf_cases():
    transformers = pytest.importorskip("transformers")
    from hf_models import HF5, padded_batch, tiny_bert, tiny_gpt2, tiny_vit

    cases = {"gpt2": (tiny_gpt2(), padded_batch([12, 7], 12)), "vit": (tiny_vit(), {"pixel_values": torch.randn(2, 3, 16, 16)})}
    if HF5:
        cases["bert"] = (tiny_bert(), padded_batch([12, 5], 12))
    del transformers
    return cases


@pytest.fixture(scope="module")
def standard_seq2seq(small_seq2seq, torchlib_ops_once, tmp_path_factory):
    """small_seq2seq exported once in the standard flavor: the parity gate and the fully-padded-row
    check read the same file."""
    path = tmp_path_factory.mktemp("standard") / "seq2seq.onnx"
    return small_seq2seq, export_onnx(small_seq2seq, small_seq2seq.example_inputs, path, attention="standard")


@pytest.mark.slow  # four exports through the parity gate (~15 s)
@pytest.mark.usefixtures("torchlib_ops_once")
@pytest.mark.parametrize("name", ["seq2seq", "bert", "gpt2", "vit"])
def test_the_parity_gate_passes_in_the_standard_flavor(request, tmp_path, name):
    if name == "seq2seq":  # encoder self-attention, decoder causal self- and cross-attention
        model, result = request.getfixturevalue("standard_seq2seq")
        inputs = model.example_inputs
    else:
        cases = _hf_cases()
        if name not in cases:
            pytest.skip("BERT dispatches through AttentionInterface from transformers 5")
        model, inputs = cases[name]
        result = export_onnx(model, inputs, tmp_path / f"{name}.onnx", attention="standard")
    assert result.opset == 23 and result.num_attention_nodes == 0 and result.num_standard_attention_nodes > 0
    report = validate(model, result.path, inputs)
    assert report.passed, report.failures
    assert report.attention_flavor["flavor"] == "standard"
    assert report.to_dict()["attention_flavor"]["standard_nodes"] == result.num_standard_attention_nodes
    if name == "seq2seq":  # inspect FILE.onnx names the flavor, counted from the graph
        proc = invoke("inspect", result.path)
        assert proc.returncode == 0 and "attention flavor standard: 3 standard Attention" in " ".join(proc.stdout.split())


def two_layer_model(attrs, recorded=True):
    """Two FusedAttention nodes, the second's query the first's output, reading the same masks;
    ``recorded``: the graph records the first output's shape (its length is the query's)."""
    first = helper.make_node(S.op_type, ["query", *S.input_names[1:]], ["mid"], domain=S.domain, **attrs)
    second = helper.make_node(S.op_type, ["mid", *S.input_names[1:]], ["out"], domain=S.domain, **attrs)
    model = one_node_model(attrs, opset=23)
    del model.graph.node[:]
    model.graph.node.extend([first, second])
    model.graph.value_info.append(helper.make_tensor_value_info("mid", TensorProto.FLOAT,
                                                                ["B", "Lq", "Ev"] if recorded else None))
    return model


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masks", ["padding", "both"])
def test_layers_that_share_masks_and_lengths_share_one_mask_and_guard(causal, masks):
    """Built once per model, not per layer: both Attention nodes read ONE mask and there is ONE
    ReduceMax; the result is the float64 reference applied twice, 0 on rows the masks empty. A
    graph that does not record the lengths gets a mask per node (equal inputs are not enough)."""
    B, H, L, D = 2, 2, 5, 4
    q, k, v = torch.randn(B, H, L, D), torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    padding = torch.zeros(B, L, dtype=torch.bool)
    padding[1, :] = True  # a whole batch row empty
    padding[0, 3:] = True
    attn = torch.rand(B, H, L, L) < 0.3 if masks == "both" else None
    attrs = onnx_node.node_attributes(H, 0.41, causal, True, attn is not None)
    feeds = {"query": pack(q), "key": pack(k), "value": pack(v), "key_padding_mask": additive(padding).numpy(),
             "attn_mask": additive(attn).numpy() if attn is not None else np.zeros((1, 1, 1, 1), np.float32)}
    mid, _ = reference_attention(q, k, v, attn_mask=attn, key_padding_mask=padding, is_causal=causal, scale=0.41)
    ref, _ = reference_attention(mid, k, v, attn_mask=attn, key_padding_mask=padding, is_causal=causal, scale=0.41)
    for recorded, masks_built in ((True, 1), (False, 2)):
        model = two_layer_model(attrs, recorded)
        assert to_standard_attention(model).converted == 2
        onnx.checker.check_model(model, full_check=True)
        attention = [n for n in model.graph.node if n.op_type == "Attention"]
        assert len({n.input[3] for n in attention}) == masks_built
        assert [n.op_type for n in model.graph.node].count("ReduceMax") == masks_built
        assert_parity(run(model, feeds), ref.transpose(1, 2).reshape(B, L, -1).numpy(), 2e-6)


def test_fully_padded_source_rows_stay_finite_in_the_exported_seq2seq(standard_seq2seq):
    """A real export: a batch row whose source is all padding gives the fused PyTorch model's
    finite output (the stock nn.Transformer: NaN there); the other rows match the stock model."""
    import copy

    from attn_export.surgery.replace import replace_attention

    model, result = standard_seq2seq
    gen = torch.Generator().manual_seed(1)
    src, tgt = torch.randn(3, 9, 8, generator=gen), torch.randn(3, 5, 8, generator=gen)
    padding = torch.zeros(3, 9, dtype=torch.bool)
    padding[1] = True
    padding[2, 6:] = True
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    out = session.run(None, {"src": src.numpy(), "tgt": tgt.numpy(), "src_key_padding_mask": padding.numpy()})[0]
    fused = copy.deepcopy(model)
    replace_attention(fused)  # in place
    with torch.no_grad():
        want, want_fused = model(src, tgt, padding), fused(src, tgt, padding)
    assert np.isfinite(out).all()
    assert_parity(out, want_fused.numpy(), 1e-5)
    assert_parity(out[[0, 2]], want[[0, 2]].numpy(), 1e-5)
