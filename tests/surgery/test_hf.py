"""Hugging Face transformers models (BERT, GPT-2, ViT from tiny configs; nothing downloaded):
attention routed through transformers' AttentionInterface, parity with the original model at
valid tokens, the replacement report, ONNX export with dynamic batch and sequence, the parity
gate with padded batches, and the command line. Skipped when transformers is not installed
(`pip install 'attn-export[hf]'`)."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install 'attn-export[hf]'")

import attn_export  # noqa: E402
from attn_export.surgery import transformers as hf  # noqa: E402
from attn_export.onnx import export_onnx  # noqa: E402
from attn_export.validation import validate  # noqa: E402

from helpers import assert_parity, max_rel_err  # noqa: E402
from hf_models import HF5, main_output, padded_batch, repeats_feeding, tiny_bert, tiny_gpt2, tiny_llama, tiny_vit  # noqa: E402,F401

TOL = 1e-5  # float32, relative to the output's largest magnitude (the issue: ~1e-5)
transformers.utils.logging.set_verbosity_error()


def routed(model):
    model = copy.deepcopy(model)
    report = attn_export.replace_attention(model)
    return model, report


class CountCalls:
    """Counts calls of attn_export.ops.functional.attention (what the registered function runs)."""

    def __init__(self, monkeypatch):
        import attn_export.ops.functional as ops

        self.calls = 0
        original = ops.attention

        def counting(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(ops, "attention", counting)


# --------------------------------------------------------------------------------------------
# The attention function and its registration
# --------------------------------------------------------------------------------------------

def test_registered_under_attn_export_in_both_interfaces():
    hf.register()
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert transformers.AttentionInterface()[hf.IMPLEMENTATION] is hf.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[hf.IMPLEMENTATION] is hf.attention_mask


def test_from_config_with_attn_implementation_runs_the_operator(monkeypatch):
    hf.register()
    counter = CountCalls(monkeypatch)
    config = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="attn_export").eval()
    assert model.config._attn_implementation == "attn_export"
    with torch.no_grad():
        model(**padded_batch([5, 8], 8))
    assert counter.calls == 3  # one call per layer


def test_operator_masks_follow_the_operator_convention():
    keep = torch.tensor([[True, True, False], [True, False, False]])
    attn_mask, kpm = hf.to_operator_masks(keep[:, None, None, :], 2, 3)
    assert attn_mask is None and torch.equal(kpm, ~keep)  # True = attend -> True = masked out
    full = torch.ones(2, 1, 3, 3, dtype=torch.bool).tril()
    attn_mask, kpm = hf.to_operator_masks(full, 2, 3)
    assert kpm is None and torch.equal(attn_mask, ~full)
    additive = torch.zeros(2, 1, 3, 3)
    additive[..., -1] = torch.finfo(torch.float32).min
    attn_mask, kpm = hf.to_operator_masks(additive, 2, 3)
    assert attn_mask is additive and kpm is None
    assert hf.to_operator_masks(None, 2, 3) == (None, None)


def test_calls_with_arguments_the_operator_does_not_compute_run_transformers_eager_attention():
    """Attention sinks (GPT-OSS's s_aux): never ignored, never a failed run: the call runs the
    modeling file's eager attention, is counted, and the plan said so beforehand."""
    import hf_zoo

    model = hf_zoo.build(hf_zoo.BY_NAME["GPT-OSS"])
    inputs = hf_zoo.example_inputs(hf_zoo.BY_NAME["GPT-OSS"], model)
    plan = attn_export.inspect_attention(model)
    assert [layer.status for layer in plan.layers] == ["skipped", "skipped"]
    assert all("attention sinks (s_aux=...)" in layer.reason and "eager" in layer.reason for layer in plan.layers)
    with pytest.raises(attn_export.CoverageError, match="attention sinks"):
        attn_export.replace_attention(copy.deepcopy(model), require_all=True)
    # Forced onto the route (as a model loaded with attn_implementation="attn_export" is): the
    # sinks still count, through transformers' eager attention.
    routed_model = copy.deepcopy(model)
    hf.route(routed_model)
    assert routed_model.config._attn_implementation == "attn_export"
    with torch.no_grad():
        want = model(**inputs).last_hidden_state
        got = routed_model(**inputs).last_hidden_state
    valid = inputs["attention_mask"].bool()
    assert_parity(got[valid], want[valid], TOL)
    layer = routed_model.layers[0].self_attn
    assert list(hf.unfused_calls(layer)) == [hf.unfused_reason(layer, {"s_aux": layer.sinks})]
    # Without the sinks the result would differ: the fallback really computes them.
    with torch.no_grad():
        for block in routed_model.layers:
            block.self_attn.sinks.fill_(-1e4)
        assert max_rel_err(routed_model(**inputs).last_hidden_state[valid], want[valid]) > 1e-3


def test_cli_require_all_fails_with_the_reason_for_layers_left_on_transformers_attention(tmp_path):
    import hf_zoo

    hf_zoo.build(hf_zoo.BY_NAME["GPT-OSS"]).config.to_json_file(tmp_path / "oss.json")
    args = ["--model", "transformers:AutoModel", "--config", tmp_path / "oss.json"]
    result = _invoke("inspect", *args, "--require-all")
    assert result.exit_code == 1, result.output
    assert "attention sinks" in result.output + result.stderr
    assert _invoke("inspect", *args).exit_code == 0


def test_t5_position_bias_is_the_operators_additive_mask_and_learns_through_eager_attention(monkeypatch):
    import hf_zoo

    import dataclasses

    arch = hf_zoo.BY_NAME["T5"]
    arch = dataclasses.replace(arch, config=dict(arch.config, dropout_rate=0.0))  # training without randomness
    model = hf_zoo.build(arch)
    inputs = hf_zoo.example_inputs(arch, model)
    fused = copy.deepcopy(model)
    assert all(layer.status == "routed" for layer in attn_export.replace_attention(fused).layers)
    counter = CountCalls(monkeypatch)
    with torch.no_grad():
        got, want = fused(**inputs), model(**inputs)
    assert counter.calls == 6  # encoder self, decoder self and cross attention, 2 layers each
    valid = inputs["attention_mask"].bool()
    assert_parity(got.encoder_last_hidden_state[valid], want.encoder_last_hidden_state[valid], TOL)
    assert_parity(got.last_hidden_state, want.last_hidden_state, TOL)
    # Training the relative position bias: its gradient flows (transformers' eager attention runs
    # those calls; the operator takes no gradient for its mask) and matches the original's.
    fused.train(), model.train()
    weights = None
    for m in (fused, model):
        out = m(**inputs)
        if weights is None:
            gen = torch.Generator().manual_seed(1)
            weights = [torch.randn(t.shape, generator=gen) for t in (out.last_hidden_state, out.encoder_last_hidden_state)]
        ((out.last_hidden_state * weights[0]).sum() + (out.encoder_last_hidden_state * weights[1]).sum()).backward()
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    g_fused, g_orig = dict(fused.named_parameters())[bias].grad, dict(model.named_parameters())[bias].grad
    assert g_orig.abs().max() > 0
    assert_parity(g_fused, g_orig, 1e-4, "gradient")
    reasons = hf.unfused_calls(fused.encoder.block[0].layer[0].SelfAttention)
    assert list(reasons) and "requires grad" in next(iter(reasons))


def test_sliding_window_shorter_than_the_sequence_is_honoured():
    import hf_zoo

    arch = hf_zoo.BY_NAME["Mistral"]
    assert arch.config["sliding_window"] < hf_zoo.SEQ
    model = hf_zoo.build(arch)
    inputs = hf_zoo.example_inputs(arch, model, batch=1)
    del inputs["attention_mask"]  # no padding: causal and windowed masks only
    global_model = copy.deepcopy(model)
    global_model.config.sliding_window = None
    fused = copy.deepcopy(model)
    attn_export.replace_attention(fused)
    with torch.no_grad():
        got, want = fused(**inputs).last_hidden_state, model(**inputs).last_hidden_state
        unwindowed = global_model(**inputs).last_hidden_state
    assert_parity(got, want, TOL)
    assert max_rel_err(unwindowed, want) > 1e-3  # the window matters at this length


def test_a_causal_call_without_a_mask_keeps_its_sliding_window():
    """Should transformers ever skip building the mask, the window is applied explicitly."""
    module = nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    got, _ = hf.attention_forward(module, q, k, v, None, scaling=0.3, sliding_window=3)
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    allowed = (j <= i) & (j > i - 3)
    scores = (q.double() @ k.double().transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf"))
    want = (scores.softmax(-1) @ v.double()).transpose(1, 2)
    assert_parity(got.double(), want, 1e-6)


@pytest.mark.skipif(not hasattr(transformers, "Gemma2Config"), reason="transformers without Gemma 2")
def test_gemma2_logit_softcapping_is_honoured(monkeypatch):
    """Gemma 2 passes attn_logit_softcapping as `softcap`: the operator caps like transformers'
    eager attention (which also applies the sliding-window layers' masks)."""
    hf.register()
    config = transformers.Gemma2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_logit_softcapping=0.5,
        final_logit_softcapping=None, sliding_window=4, query_pre_attn_scalar=8)
    torch.manual_seed(0)
    eager = transformers.Gemma2ForCausalLM._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in eager.parameters():
            p.mul_(3)  # scores well beyond the cap
    fused = copy.deepcopy(eager)
    fused.set_attn_implementation("attn_export")
    batch = padded_batch([9, 6], 9)
    counter = CountCalls(monkeypatch)
    with torch.no_grad():
        want, got = eager(**batch).logits, fused(**batch).logits
        for layer in eager.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = eager(**batch).logits
    assert counter.calls == 2
    valid = batch["attention_mask"].bool()
    assert_parity(got[valid], want[valid], 1e-5)
    assert max_rel_err(uncapped[valid], want[valid]) > 1e-3  # the cap matters in this model




def test_missing_transformers_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(hf.UnsupportedTransformersError, match=r"attn-export\[hf\]"):
        hf.register()


# --------------------------------------------------------------------------------------------
# Parity with the original model (fp32), padded batches
# --------------------------------------------------------------------------------------------

MODELS = {"bert": tiny_bert, "gpt2": tiny_gpt2}


@pytest.mark.parametrize("name", ["bert", "gpt2"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_text_models_match_the_original_at_valid_tokens(name, impl, monkeypatch):
    if name == "bert" and not HF5:
        pytest.skip("BERT dispatches through AttentionInterface from transformers 5")
    original = MODELS[name]()
    if hasattr(original, "set_attn_implementation"):
        original.set_attn_implementation(impl)
    else:  # transformers < 4.54
        original.config._attn_implementation = impl
    model, report = routed(original)
    assert report.num_replaced == 2 and not report.skipped
    counter = CountCalls(monkeypatch)
    batch = padded_batch([13, 9, 1], 13)  # different padded lengths, one row with one token
    with torch.no_grad():
        got, want = main_output(model(**batch)), main_output(original(**batch))
    assert counter.calls == 2
    valid = batch["attention_mask"].bool()
    assert torch.isfinite(got).all()
    assert_parity(got[valid], want[valid], TOL)
    # Without an attention_mask (BERT: no mask; GPT-2: the causal flag alone)
    with torch.no_grad():
        got, want = main_output(model(input_ids=batch["input_ids"])), main_output(original(input_ids=batch["input_ids"]))
    assert_parity(got, want, TOL)


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_padding_is_honoured_padded_tokens_do_not_leak(name):
    """Independent of any reference: changing the ids at padded positions changes nothing at
    the valid ones, while without the mask it does (so the test can fail). GPT-2 is causal,
    so its padding goes on the left, where later tokens could see it."""
    if name == "bert" and not HF5:
        pytest.skip("BERT dispatches through AttentionInterface from transformers 5")
    model, _ = routed(MODELS[name]())
    left = name == "gpt2"
    batch = padded_batch([6, 11], 11, left=left)
    padded = ~batch["attention_mask"].bool()
    other = {k: v.clone() for k, v in batch.items()}
    other["input_ids"][padded] = (other["input_ids"][padded] + 5) % 97
    with torch.no_grad():
        a, b = main_output(model(**batch)), main_output(model(**other))
        c = main_output(model(input_ids=other["input_ids"]))
        d = main_output(model(input_ids=batch["input_ids"]))
    valid = ~padded
    assert torch.equal(a[valid], b[valid])
    assert not torch.allclose(c[valid], d[valid])


def test_gpt2_left_padding_has_no_nan_and_matches_at_valid_tokens():
    """Left padding gives padded queries no visible key: the operator returns zeros there."""
    original = tiny_gpt2()
    model, _ = routed(original)
    batch = padded_batch([4, 10, 7], 10, left=True)
    with torch.no_grad():
        got, want = main_output(model(**batch)), main_output(original(**batch))
    valid = batch["attention_mask"].bool()
    assert torch.isfinite(got).all()
    assert_parity(got[valid], want[valid], TOL)


def test_grouped_query_attention_and_cached_generation():
    """A Llama-style decoder: 2 key/value heads for 4 query heads (read in place by the operator),
    and greedy generation with a key/value cache (one query per step attends to every key)."""
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(config).eval()
    model, report = routed(original)
    assert report.num_replaced == 2
    batch = padded_batch([9, 4], 9)
    with torch.no_grad():
        got, want = model(**batch).logits, original(**batch).logits
        valid = batch["attention_mask"].bool()
        assert_parity(got[valid], want[valid], TOL)
        prompt = batch["input_ids"][:1]
        assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False),
                           original.generate(prompt, max_new_tokens=6, do_sample=False))


def test_vit_matches_the_original():
    original = tiny_vit()
    model, report = routed(original)
    assert report.num_replaced == 2
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        assert_parity(model(pixel_values=x).last_hidden_state, original(pixel_values=x).last_hidden_state, TOL)


def test_gradients_flow_through_the_operator():
    original = tiny_gpt2(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    model, _ = routed(original)
    batch = padded_batch([7, 5], 7)
    valid = batch["attention_mask"].bool()
    for m in (model, original):
        m.train()
        main_output(m(**batch))[valid].square().sum().backward()
    a = model.transformer.h[0].attn.c_attn.weight.grad
    b = original.transformer.h[0].attn.c_attn.weight.grad
    assert_parity(a, b, 1e-4)


def test_attention_dropout_in_training_runs_sdpa_unfused(monkeypatch):
    model, report = routed(tiny_gpt2())  # attn_pdrop 0.1
    assert any("dropout" in note for layer in report.layers for note in layer.notes)
    counter = CountCalls(monkeypatch)
    batch = padded_batch([5, 5], 5)
    model.train()
    model(**batch)
    assert counter.calls == 0
    model.eval()
    with torch.no_grad():
        model(**batch)
    assert counter.calls == 2


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------

class HandWrittenAttention(nn.Module):
    """Computes attention itself: no attn_implementation can reach it."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.softmax(q @ k.transpose(-1, -2) / 32 ** 0.5, -1) @ v


class WithExtraHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.gpt = tiny_gpt2("GPT2Model")
        self.head_attention = HandWrittenAttention()


def test_report_says_what_was_routed_and_what_not_and_why():
    model = WithExtraHead()
    plan = attn_export.inspect_attention(model)
    assert [layer.status for layer in plan.layers] == ["will be routed", "will be routed", "skipped"]
    assert model.gpt.config._attn_implementation != "attn_export"  # inspect changes nothing
    report = attn_export.replace_attention(model)
    routed_layers = [layer for layer in report.layers if layer.status == "routed"]
    assert [layer.path for layer in routed_layers] == ["gpt.h.0.attn", "gpt.h.1.attn"]
    assert all(layer.num_heads == 4 and layer.embed_dim == 32 for layer in routed_layers)
    skipped = report.skipped
    assert [layer.path for layer in skipped] == ["head_attention"]
    assert "AttentionInterface" in skipped[0].reason
    assert model.gpt.config._attn_implementation == "attn_export"
    payload = report.to_dict()
    assert payload["num_routed"] == 2 and payload["num_replaced"] == 2 and payload["num_skipped"] == 1
    assert "2 routed" in report.summary() and any("AttentionInterface" in n for n in report.notes)
    again = attn_export.replace_attention(model)
    assert again.num_replaced == 0 and len(again.already_fused) == 2
    with pytest.raises(attn_export.CoverageError):
        attn_export.replace_attention(WithExtraHead(), require_all=True)


@pytest.mark.skipif(HF5, reason="transformers < 5: BERT's attention classes compute attention themselves")
def test_old_bert_is_reported_as_not_routable():
    report = attn_export.replace_attention(tiny_bert())
    assert report.num_replaced == 0 and len(report.skipped) == 2
    assert all("AttentionInterface" in layer.reason for layer in report.skipped)


# --------------------------------------------------------------------------------------------
# Export and the parity gate
# --------------------------------------------------------------------------------------------

def _ort_run(path, feeds):
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {k: v.numpy() for k, v in feeds.items()})


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Each model exported once: (model, example inputs, ExportResult)."""
    d = tmp_path_factory.mktemp("hf_export")
    out = {}
    cases = {"gpt2": (tiny_gpt2(), padded_batch([12, 7], 12)),
             "vit": (tiny_vit(), {"pixel_values": torch.randn(2, 3, 16, 16)})}
    if HF5:
        cases["bert"] = (tiny_bert(), padded_batch([12, 5], 12))
    for name, (model, inputs) in cases.items():
        out[name] = (model, inputs, export_onnx(model, inputs, d / f"{name}.onnx"))
    return out


@pytest.mark.parametrize("name", ["bert", "gpt2", "vit"])
@pytest.mark.slow  # end to end: make test-fast leaves it out
def test_export_one_custom_node_per_layer_dynamic_batch_and_sequence(exported, name):
    import onnx

    if name not in exported:
        pytest.skip("BERT dispatches through AttentionInterface from transformers 5")
    model, inputs, result = exported[name]
    assert result.num_attention_nodes == 2
    proto = onnx.load(str(result.path))
    nodes = [n for n in proto.graph.node if n.op_type == "FusedAttention"]
    assert len(nodes) == 2 and all(n.domain.startswith("attn_export.") for n in nodes)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in proto.graph.input}
    if name == "vit":
        assert dims == {"pixel_values": ["batch", 3, 16, 16]}
    else:
        assert dims["input_ids"] == ["batch", "seq"]
        # transformers 5 ties the mask's length to the tokens'; older versions keep it a symbol of its own
        assert dims["attention_mask"][0] == "batch" and isinstance(dims["attention_mask"][1], str)
        assert all(v.type.tensor_type.elem_type == onnx.TensorProto.INT64 for v in proto.graph.input)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    if name == "bert":  # a padding mask stays one row per key: the node's rank-2 mask input
        assert attrs["has_key_padding_mask"] == 1 and attrs["has_attn_mask"] == 0
    if name == "gpt2":  # causal x padding: is_causal (bottom-right) and the padding, no [B, 1, L, L] mask
        assert attrs["has_key_padding_mask"] == 1 and attrs["has_attn_mask"] == 0
        assert (attrs["is_causal"], attrs["causal_alignment"]) == (1, 1)


@pytest.mark.slow  # end to end (the module's HF exports): make test-fast leaves it out
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_onnx_runtime_matches_the_original_on_new_padded_batches(exported, name):
    if name not in exported:
        pytest.skip("BERT dispatches through AttentionInterface from transformers 5")
    model, _, result = exported[name]
    for lengths, seq in (([3, 17, 9, 1], 17), ([5], 5), ([30, 2, 30], 30)):
        batch = padded_batch(lengths, seq, seed=seq)
        with torch.no_grad():
            want = main_output(model(**batch))
        got = torch.from_numpy(_ort_run(result.path, batch)[0])
        valid = batch["attention_mask"].bool()
        assert_parity(got[valid], want[valid], TOL, f"lengths {lengths}, seq {seq}")


@pytest.mark.slow  # end to end (the module's HF exports): make test-fast leaves it out
@pytest.mark.parametrize("name", ["bert", "gpt2", "vit"])
def test_the_parity_gate_passes_with_padded_cases(exported, name):
    if name not in exported:
        pytest.skip("BERT dispatches through AttentionInterface from transformers 5")
    model, inputs, result = exported[name]
    report = validate(model, result.path, inputs)
    assert report.passed, report.failures
    ran = {c.case for c in report.cases if c.status == "passed"}
    if name == "vit":
        assert ran == {"example", "batch=1"}
    else:
        assert ran == {"example", "batch=1", "seq=1", "seq=odd", "seq=long"}
        assert any("valid tokens" in n for n in report.notes)
        example = next(c for c in report.cases if c.case == "example")
        assert example.shapes == {"input_ids": [2, 12], "attention_mask": [2, 12]}


@pytest.mark.slow  # end to end: make test-fast leaves it out
def test_grouped_query_export_has_no_repeated_key_value_and_passes_the_gate(tmp_path):
    """A 2-layer Llama-style decoder (8 query heads, 2 key/value heads): the FusedAttention nodes
    read the 2 key/value heads as they are (kv_num_heads=2; no Expand/Tile of K/V before them),
    and the parity gate passes with padded batches."""
    import onnx

    model = tiny_llama()
    inputs = padded_batch([12, 7], 12)
    result = export_onnx(model, inputs, tmp_path / "llama.onnx")
    proto = onnx.load(str(result.path))
    nodes = [n for n in proto.graph.node if n.op_type == "FusedAttention"]
    assert len(nodes) == 2
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["num_heads"], attrs["kv_num_heads"]) == (8, 2)
        assert [repeats_feeding(proto, node.input[i]) for i in (1, 2)] == [[], []], node.name
    report = validate(model, result.path, inputs)
    assert report.passed, report.failures


@pytest.mark.slow  # end to end (the module's HF exports): make test-fast leaves it out
def test_the_parity_gate_fails_when_padding_is_ignored(exported, monkeypatch):
    """Left padding: GPT-2's causal mask alone would let valid tokens see the padded ones (right
    padding sits after every valid token, where causality already hides it)."""
    model, _, result = exported["gpt2"]
    inputs = padded_batch([12, 7], 12, left=True)
    monkeypatch.setattr(hf.interface, "to_operator_masks", lambda mask, batch, length: (None, None))
    report = validate(model, result.path, inputs)
    assert not report.passed
    failed = {(c.case, c.backend) for c in report.cases if c.status == "failed"}
    assert ("example", "pytorch-replaced") in failed
    assert not any(backend == "onnxruntime" for _, backend in failed)  # the file itself is right


def test_resized_attention_masks_are_padding_masks():
    from attn_export import inputs as _inputs

    batch = padded_batch([6, 3], 6)
    axes = hf.default_axes(batch)
    out = _inputs.resize(batch, axes, {"batch": 5, "seq": 9}, seed=1)
    mask = out["attention_mask"]
    assert mask.shape == (5, 9) and mask.dtype == torch.int64
    assert (mask[:, 0] == 1).all() and (mask.diff(dim=1) <= 0).all()  # 1..1 0..0, never empty
    assert (mask.sum(1) < 9).any()  # some padding
    synth = _inputs.synthesize([_inputs.parse_input_spec("attention_mask:4x8:int64"),
                                _inputs.parse_input_spec("input_ids:4x8:int64")], (0, 2),
                               int_ranges={"input_ids": (0, 97)})
    assert (synth["attention_mask"][:, 0] == 1).all() and (synth["attention_mask"].diff(dim=1) <= 0).all()
    assert int(synth["input_ids"].max()) > 1


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def _invoke(*args):
    from click.testing import CliRunner

    from attn_export.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.slow  # end to end: make test-fast leaves it out
def test_cli_converts_a_save_pretrained_folder(tmp_path):
    model = tiny_gpt2()
    model.save_pretrained(tmp_path / "gpt2-tiny")
    result = _invoke(tmp_path / "gpt2-tiny", "--to", "onnx", "--json", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "gpt2-tiny.onnx").is_file()
    payload = json.loads((tmp_path / "r.json").read_text())
    assert payload["passed"] and payload["export"]["num_attention_nodes"] == 2
    assert payload["export"]["input_names"] == ["input_ids", "attention_mask"]
    assert payload["export"]["replacement"]["num_routed"] == 2
    inspect = _invoke("inspect", tmp_path / "gpt2-tiny", "--require-all")
    assert inspect.exit_code == 0 and "will be routed" in inspect.output
    check = _invoke("validate", tmp_path / "gpt2-tiny", tmp_path / "gpt2-tiny.onnx", "--input", "input_ids:3x10:int64",
                    "--input", "attention_mask:3x10:int64")
    assert check.exit_code == 0, check.output


@pytest.mark.slow  # end to end: make test-fast leaves it out
def test_cli_builds_a_transformers_class_from_a_config(tmp_path):
    config = tiny_vit().config
    config.to_json_file(tmp_path / "vit.json")
    out = tmp_path / "vit.onnx"
    result = _invoke("--model", "transformers:AutoModel", "--config", tmp_path / "vit.json", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    import onnx

    assert sum(n.op_type == "FusedAttention" for n in onnx.load(str(out)).graph.node) == 2


@pytest.mark.parametrize("args,words", [
    (["--model", "transformers:NoSuchModel", "--config", "{cfg}"], ["NoSuchModel"]),
    (["--config", "{cfg}", "--model", "pkg:factory"], ["--config goes with --model transformers:CLASS"]),
    (["{dir}"], ["without config.json"]),
])
def test_cli_errors_are_one_line(tmp_path, args, words):
    tiny_vit().config.to_json_file(tmp_path / "c.json")
    (tmp_path / "empty").mkdir()
    args = [a.format(cfg=tmp_path / "c.json", dir=tmp_path / "empty") for a in args]
    result = _invoke("inspect", *args)
    assert result.exit_code == 2
    assert any(line.startswith("error: ") and all(w in line for w in words) for line in result.stderr.splitlines()), \
        result.stderr


# --------------------------------------------------------------------------------------------
# The documented examples run as written
# --------------------------------------------------------------------------------------------

def _python_blocks(path, section=None):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / path).read_text()
    if section is not None:
        start = text.index(section)
        end = text.find("\n## ", start + len(section))
        text = text[start:end if end != -1 else None]
    return re.findall(r"```python\n(.*?)```", text, re.S)


# README.md's own example (a plain nn.TransformerEncoder) runs in tests/test_docs.py.
@pytest.mark.parametrize("path,section", [("docs/huggingface.md", "## Using it")])
@pytest.mark.slow  # end to end: make test-fast leaves it out
def test_documented_example_runs_as_written(path, section, tmp_path, monkeypatch, capsys):
    if not HF5:
        pytest.skip("the examples use BERT, which dispatches through AttentionInterface from transformers 5")
    block = _python_blocks(path, section)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(block, f"{path} example", "exec"), {"__name__": "__doc_example__"})
    assert (tmp_path / "bert.onnx").is_file()
    if "print(report.summary())" in block:
        assert "2 found, 2 routed, 0 skipped" in capsys.readouterr().out
