"""The ONNX Runtime flavor (--onnx-attention ort, attn_export/onnx/ort/): a grouped-query
Llama-style decoder with its cache lowered to GroupQueryAttention and generating the tokens
of generate() through ONNX Runtime (a left-padded batch, the gate) and, when installed, ONNX
Runtime GenAI's generator with the shared max-length buffer (right-padded, as GenAI pads), its
rotary embedding as RotaryEmbedding (plain and YaRN-scaled); a
padded encoder lowered to MultiHeadAttention at parity; a layer the contrib ops cannot compute
kept as the portable node, with the reason."""
import collections
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from attn_export.cache_contract import CacheContract
from attn_export.onnx import export_onnx
from attn_export.onnx.graph import count_attention_nodes
from attn_export.onnx.ort import lower_attention
from helpers import nodes_within
from portability_models import cases

transformers = pytest.importorskip("transformers")

from attn_export.genai_config import write_genai_config  # noqa: E402
from attn_export.validation.generation import check_generation, left_padded, random_prompts, reference_generation  # noqa: E402
from hf_models import HF5, genai_greedy_tokens, tiny_llama  # noqa: E402

NEW_TOKENS = 12
LENGTHS = (5, 9, 12)


def op_counts(model):
    return collections.Counter(n.op_type for n in model.graph.node)


def export_llama(path):
    # 2 layers, 8 query heads over 2 key/value heads; head dim 16: GroupQueryAttention rotates
    # (do_rotary) multiples of 16 only
    model = tiny_llama(head_dim=16)
    ids = torch.randint(1, 97, (2, 5))
    result = export_onnx(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, path, with_past=True,
                         attention="ort")
    return model, result


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("ort_llama") / "model.onnx"
    model, result = export_llama(path)
    return model, result, path


@pytest.mark.slow  # the Llama export (the module fixture, ~8 s)
@pytest.mark.skipif(not HF5, reason="the cached export is checked with transformers 5")
def test_decoder_is_group_query_attention(llama):
    model, result, path = llama
    graph = onnx.load(str(path))
    layers = model.config.num_hidden_layers
    # No If: every layer is the builder's form, GroupQueryAttention alone reading the packed
    # projection and rotating (do_rotary) at the positions it counts from seqlens_k (no
    # position ids), the padding as each row's length over a cache compacted at the row's start:
    # the tokens reordered kept-first (one TopK over the mask's new columns), the logits put back
    # (a second TopK: the inverse order).
    assert not [n for n in nodes_within(graph.graph) if n.op_type == "If"]
    assert any("compacted at the start of its cache" in n for n in result.notes)
    ops = op_counts(graph)
    assert ops["GroupQueryAttention"] == layers and ops["RotaryEmbedding"] == 0 and ops["Expand"] == 0
    for gqa in (n for n in graph.graph.node if n.op_type == "GroupQueryAttention"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gqa.attribute}
        assert (attrs["num_heads"], attrs["kv_num_heads"], attrs["do_rotary"]) == (8, 2, 1)
        assert gqa.input[1] == gqa.input[2] == "" and len(gqa.input) == 9  # packed QKV, no position ids
        assert gqa.input[5] == "ort_compact/seqlens_k"
    assert ops["TopK"] == 2 and ops["GatherElements"] == 1 and ops["GatherND"] == 1  # the tokens in, the logits out
    # The norms' statistics outputs, which nothing reads, unnamed: ONNX Runtime then computes none.
    norms = [n for n in graph.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert len(norms) == 2 * layers and all(list(n.output)[1:3] == ["", ""] for n in norms)
    assert count_attention_nodes(graph) == 0 and not graph.functions
    # Per layer: Q/K/V packed (GroupQueryAttention reads them so), the output projection, gate and
    # up (packed, then unpacked: no Split), down; then the LM head.
    assert ops["MatMul"] == 5 * layers + 1 and ops["Split"] == 0
    assert any("packed into one MatMul" in n for n in result.notes)
    assert any(f"one MatMul per part, no Split: {layers} rewrite(s)" in n for n in result.notes)
    # The operator counts the positions: the file takes no position_ids, as its contract says.
    assert "position_ids" not in {i.name for i in graph.graph.input}
    assert CacheContract.from_metadata(graph).position_ids is False
    metadata = {p.key: p.value for p in graph.metadata_props}
    assert "position_ids" not in json.loads(metadata["attn_export.dynamic_axes"])
    assert "position_ids" not in json.loads(metadata["attn_export.input_names"]) + list(result.dynamic_axes)
    # The cos/sin caches are initializers of the config's positions (no work per call), read at the
    # positions the operator counts; nothing of HF's rotate_half left, no head split/merge around the attention.
    counts = collections.Counter(n.op_type for n in nodes_within(graph.graph))
    assert counts["Cos"] == counts["Sin"] == 0
    cos = next(t for t in graph.graph.initializer if t.name == "ort_rotary_cache_0/cos")
    assert list(cos.dims) == [model.config.max_position_embeddings, 8]
    assert counts["Transpose"] == counts["Reshape"] == 0
    assert counts["Slice"] == counts["Neg"] == 1  # the mask's new columns, from the end
    assert result.attention == "ort" and result.kept_custom == []
    assert any(note.startswith("fused for ONNX Runtime by onnxscript") for note in result.notes)


@pytest.mark.slow  # the Llama export (the module fixture, ~8 s)
@pytest.mark.skipif(not HF5, reason="the cached export is checked with transformers 5")
def test_decoder_generates_the_tokens_of_generate(llama):
    model, _, path = llama
    result = check_generation(model, path, new_tokens=NEW_TOKENS, prompt_lengths=LENGTHS)
    assert result.passed, result.to_dict()
    assert len({tuple(t) for t in result.reference_tokens}) == len(LENGTHS)  # a non-trivial comparison


@pytest.mark.slow  # the Llama export (the module fixture, ~8 s)
@pytest.mark.skipif(not HF5, reason="the cached export is checked with transformers 5")
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_prompt_has_the_models_logits_at_every_kept_position(llama, side):
    """The rows reordered into the compacted layout and the logits put back: position j of
    the file's logits is the model's position j, for transformers' left padding and GenAI's
    right padding alike; the pad positions finite."""
    model, _, path = llama
    prompts = random_prompts(model.config.vocab_size, (3, 9, 12), seed=1, avoid=[0])
    ids, mask = left_padded(prompts, 0)
    if side == "right":
        order = torch.argsort(1 - mask, dim=1, stable=True)  # each row's tokens first, its pads after
        ids, mask = ids.gather(1, order), mask.gather(1, order)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.numpy()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    for i in session.get_inputs():
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((len(prompts), model.config.num_key_value_heads, 0, model.config.head_dim),
                                     np.float32)
    got = session.run(["logits"], feeds)[0]
    kept = mask.numpy().astype(bool)
    assert np.isfinite(got).all()
    scale = np.abs(expected[kept]).max()
    assert np.abs(got - expected)[kept].max() <= 1e-4 * scale, (np.abs(got - expected)[kept].max(), scale)


@pytest.mark.skipif(not HF5, reason="the cached export is checked with transformers 5")
@pytest.mark.slow  # the Llama export (the module fixture) and GenAI
@pytest.mark.parametrize("lengths", [(7,), LENGTHS])
def test_genai_generator_with_the_shared_buffer(llama, lengths):
    pytest.importorskip("onnxruntime_genai")
    model, _, path = llama
    config = json.loads(write_genai_config(path, model.config).read_text())
    assert config["search"]["past_present_share_buffer"] is True
    prompts = random_prompts(model.config.vocab_size, lengths, seed=0, avoid=[0])
    ids, mask = left_padded(prompts, 0)
    expected = reference_generation(model, ids, mask, NEW_TOKENS, 0, takes_positions=True)[0].tolist()
    assert genai_greedy_tokens(path.parent, prompts, 0, NEW_TOKENS) == expected


def run_encoder(path, inputs):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: inputs[i.name].numpy() for i in session.get_inputs()}
    return session.run(None, feeds)[0]


def test_encoder_is_multi_head_attention_at_parity(tmp_path):
    case = cases(["encoder"])["encoder"]
    path = tmp_path / "encoder.onnx"
    result = export_onnx(case.model, case.batch(2, 12, 0), path, attention="ort")
    assert op_counts(onnx.load(str(path)))["MultiHeadAttention"] == 2 and result.kept_custom == []
    for batch, seq in ((2, 12), (3, 5), (1, 17)):
        inputs = case.batch(batch, seq, 1)
        with torch.no_grad():
            expected = case.model(**inputs).numpy()
        valid = case.valid(inputs).numpy()
        np.testing.assert_allclose(run_encoder(path, inputs)[valid], expected[valid], rtol=1e-4, atol=1e-4)


def test_what_no_contrib_op_computes_stays_custom(tmp_path):
    case = cases(["encoder"])["encoder"]
    path = tmp_path / "encoder_bf16.onnx"
    result = export_onnx(case.model, case.batch(2, 12, 0), path, attention="ort", dtype="bf16")
    assert len(result.kept_custom) == 2
    assert all("float32 and float16 only" in line for line in result.kept_custom)
    assert count_attention_nodes(onnx.load(str(path))) == 2


def test_lowering_reports_nothing_on_a_model_without_attention():
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    model = onnx.helper.make_model(graph)
    lowered = lower_attention(model)
    assert lowered.converted == {} and lowered.kept == [] and len(model.graph.node) == 1


@pytest.mark.slow
@pytest.mark.skipif(not HF5, reason="the cached export is checked with transformers 5")
def test_soft_cap_and_sliding_window_generate_the_tokens_of_generate(tmp_path):
    """Gemma 2: soft-capping on every layer, a window of 4 (shorter than the prompts) on every
    other one: GroupQueryAttention's softcap and local_window_size = the node's window."""
    from test_with_past import tiny_gemma2

    model = tiny_gemma2()
    path = tmp_path / "gemma2.onnx"
    ids = torch.randint(1, 97, (2, 5))
    export_onnx(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, path, with_past=True,
                attention="ort")
    graph = onnx.load(str(path))
    gqa = [n for n in graph.graph.node if n.op_type == "GroupQueryAttention"]
    windows = sorted({onnx.helper.get_attribute_value(a) for n in gqa for a in n.attribute if a.name == "local_window_size"})
    assert windows == [-1, 4]
    result = check_generation(model, path, new_tokens=NEW_TOKENS, prompt_lengths=LENGTHS)
    assert result.passed, result.to_dict()


@pytest.mark.slow
@pytest.mark.skipif(not HF5, reason="the cached export is checked with transformers 5")
def test_scaled_rotary_generates_the_tokens_of_generate(tmp_path):
    """YaRN: the cos/sin multiplied by the attention scaling (1.07 here), which the
    RotaryEmbedding's caches must carry."""
    model = tiny_llama(rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                                        "rope_theta": 10000.0})
    assert model.model.rotary_emb.attention_scaling != 1.0
    path = tmp_path / "yarn.onnx"
    ids = torch.randint(1, 97, (2, 5))
    export_onnx(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, path, with_past=True,
                attention="ort")
    graph = onnx.load(str(path)).graph
    # Head size 8: GroupQueryAttention does not rotate it; a RotaryEmbedding per query and key,
    # at the position ids rotated with the tokens into the compacted rows.
    rotary = collections.Counter(n.op_type for n in nodes_within(graph))["RotaryEmbedding"]
    assert rotary == 2 * model.config.num_hidden_layers
    # The caches: initializers of the config's 128 positions, cos(0 * f) = 1 times the scaling.
    cos = onnx.numpy_helper.to_array(next(t for t in graph.initializer if t.name == "ort_rotary_cache_0/cos"))
    assert cos.shape == (model.config.max_position_embeddings, model.config.head_dim // 2)
    np.testing.assert_allclose(cos[0], model.model.rotary_emb.attention_scaling, rtol=1e-6)
    result = check_generation(model, path, new_tokens=NEW_TOKENS, prompt_lengths=LENGTHS)
    assert result.passed, result.to_dict()


@pytest.mark.slow
@pytest.mark.skipif(not HF5, reason="the cached export is checked with transformers 5")
def test_caches_computed_per_call_where_the_position_limit_is_unknown(tmp_path, monkeypatch):
    """No position limit (a model without a config's max_position_embeddings): the cos/sin rows
    are computed per call for the call's positions, padded to the total length for the
    operator's own rotation; the same tokens as generate()."""
    from attn_export.onnx import pipeline

    monkeypatch.setattr(pipeline, "_max_positions", lambda model, attention: None)
    model, result = export_llama(tmp_path / "model.onnx")
    graph = onnx.load(str(tmp_path / "model.onnx")).graph
    counts = collections.Counter(n.op_type for n in nodes_within(graph))
    assert counts["Cos"] == counts["Sin"] == 1 and counts["Pad"] == 2
    assert not any(t.name.startswith("ort_rotary_cache") for t in graph.initializer)
    gate = check_generation(model, tmp_path / "model.onnx", new_tokens=NEW_TOKENS, prompt_lengths=LENGTHS)
    assert gate.passed, gate.to_dict()
