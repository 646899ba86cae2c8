"""Compact masks for transformers decoders (issue 49): a plain causal mask reaches the operator as
``is_causal`` aligned bottom-right plus a key-padding mask, never as a ``[B, 1, L, L]`` tensor;
sliding-window layers too, with the layer's window as the operator's ``window``.

Tiny random-weight configs of GPT-2, Llama, Mistral, Qwen2 (with and without its sliding
window), Gemma 2, Phi and Phi-3 (nothing downloaded), each with a left-padded batch of prompts
of different lengths (the generation case): the routed model's logits at valid positions
against the stock eager model in float64 on each prompt alone; greedy generation with a
key/value cache, routed against stock; an export without the cache run in ONNX Runtime; and
torch.export with a cache. The mask function's compact forms are checked against transformers'
own ``sdpa`` mask for the same arguments."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install 'attn-export[hf]'")

import attn_export  # noqa: E402
from attn_export.onnx import export_onnx  # noqa: E402
from attn_export.surgery import transformers as hf  # noqa: E402
from attn_export.surgery.transformers import masks  # noqa: E402

from helpers import assert_parity, ci_sample, max_rel_err  # noqa: E402
from hf_models import HF5, padded_batch, repeats_feeding  # noqa: E402

pytestmark = pytest.mark.skipif(not HF5, reason="the compact causal mask is built for transformers 5's mask interface")
transformers.utils.logging.set_verbosity_error()

TOL = 1e-5  # float32 against a float64 reference, relative to the logits' largest magnitude
VOCAB = 99
WINDOW = 4  # sliding windows shorter than the prompts, so that they matter
_DECODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# name -> (model_type, config, the layers with a sliding window: the operator's window on them)
FAMILIES = {
    "gpt2": ("gpt2", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2), 0),
    "llama": ("llama", _DECODER, 0),
    "mistral": ("mistral", dict(_DECODER, sliding_window=WINDOW), 2),
    "qwen2": ("qwen2", _DECODER, 0),
    "qwen2-sliding": ("qwen2", dict(_DECODER, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), 1),
    "gemma2": ("gemma2", dict(_DECODER, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                              final_logit_softcapping=None, query_pre_attn_scalar=8), 1),
    "phi": ("phi", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2), 0),
    "phi3": ("phi3", _DECODER, 0),
}
PROMPTS = ([9, 5, 2], 9)  # valid lengths, left-padded to 9 tokens


def stock(name):
    """The family's causal LM with random weights on transformers' eager attention."""
    model_type, config, _ = FAMILIES[name]
    config = transformers.AutoConfig.for_model(model_type, **config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval()


def routed(model):
    model = copy.deepcopy(model)
    report = attn_export.replace_attention(model)
    assert report.num_replaced == 2 and not report.skipped, report
    return model


def prompts(seed=0):
    lengths, seq = PROMPTS
    return padded_batch(lengths, seq, vocab=VOCAB, left=True, seed=seed)


class MaskSpy:
    """Records, per call of the registered attention function, the mask's rank (2: compact
    causal, 4: materialized, 0: none) and (Lq, Lk); and in ``windows`` the window each call passes
    to the operator (0: none)."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.windows = []
        original = hf.interface._operator_masks

        def spy(query, k_length, attention_mask, causal, kwargs):
            rank = 0 if attention_mask is None else attention_mask.dim()
            self.calls.append((rank, query.shape[2], k_length))
            result = original(query, k_length, attention_mask, causal, kwargs)
            self.windows.append(result[3])
            return result

        monkeypatch.setattr(hf.interface, "_operator_masks", spy)

    def ranks(self):
        return {rank for rank, _, _ in self.calls}


# --------------------------------------------------------------------------------------------
# The mask function against transformers' own sdpa mask
# --------------------------------------------------------------------------------------------

def _mask_kwargs(q_length, q_offset, padding, **extra):
    from transformers import masking_utils

    kwargs = dict(batch_size=padding.shape[0], q_length=q_length, kv_length=q_offset + q_length, q_offset=q_offset,
                  kv_offset=0, mask_function=masking_utils.causal_mask_function, attention_mask=padding,
                  allow_is_causal_skip=False, dtype=torch.float32, device=torch.device("cpu"), use_vmap=False)
    kwargs.update(extra)
    return kwargs


@pytest.mark.parametrize("q_length,q_offset", [(7, 0), (1, 6), (3, 4), (1, 0)])
def test_compact_causal_mask_is_transformers_mask(q_length, q_offset):
    """No cache (offset 0) and a DynamicCache (offset = past length): the 2-D padding mask the
    function returns, crossed with bottom-right causality, is transformers' sdpa mask."""
    from transformers import masking_utils

    total = q_offset + q_length
    padding = (torch.arange(total)[None, :] >= torch.tensor([0, total - 2, 1])[:, None])  # left padding
    kwargs = _mask_kwargs(q_length, q_offset, padding)
    compact = hf.attention_mask(**kwargs)
    assert compact.shape == (3, total) and compact.dtype == torch.bool
    want = masking_utils.sdpa_mask(**kwargs)
    got = masks.materialized(compact, True, q_length, total, padding.device)
    assert torch.equal(got.expand_as(want), want)
    assert hf.attention_mask(**dict(kwargs, attention_mask=None)) is None  # no padding: the causal flag alone


def test_compact_mask_keeps_the_last_keys_of_a_longer_padding_mask():
    from transformers import masking_utils

    padding = torch.arange(8)[None, :] >= torch.tensor([[2], [5]])
    kwargs = _mask_kwargs(3, 2, padding)  # kv_length 5: the last 5 of the 8 keys
    compact = hf.attention_mask(**kwargs)
    assert torch.equal(compact, padding[:, 3:])
    flash = masking_utils.flash_attention_mask(**kwargs)  # transformers' own compact (FA2) form
    assert flash is not None and torch.equal(compact, flash)


def _overlay(batch_idx, head_idx, q_idx, kv_idx):
    return kv_idx >= 0


@pytest.mark.parametrize("q_length,q_offset,kv_offset", [(7, 0, 0), (1, 6, 0), (3, 4, 0), (1, 0, 0), (1, 9, 7),
                                                           (2, 8, 6)])
def test_compact_sliding_window_mask_is_transformers_mask(q_length, q_offset, kv_offset):
    """A sliding-window causal mask (window 3, shorter than the prompts) over no cache, a full
    DynamicCache and a sliding-window cache (kv_offset > 0: the keys kept are the last kv_length
    positions): the compact 2-D padding mask, crossed with bottom-right causality and the window
    as the operator applies them, is transformers' sdpa mask."""
    from transformers import masking_utils

    total = q_offset + q_length
    padding = (torch.arange(total)[None, :] >= torch.tensor([0, total - 2, 1])[:, None])  # left padding
    kwargs = _mask_kwargs(q_length, q_offset, padding, kv_offset=kv_offset, kv_length=total - kv_offset,
                          mask_function=masking_utils.sliding_window_causal_mask_function(3), local_size=3)
    compact = hf.attention_mask(**kwargs)
    assert compact.shape == (3, total - kv_offset) and compact.dtype == torch.bool
    want = masking_utils.sdpa_mask(**kwargs)
    got = masks.materialized(compact, True, q_length, total - kv_offset, padding.device, window=3)
    assert torch.equal(got.expand_as(want), want)
    if kv_offset == 0 and total > 3:  # keys past the window: without it the mask differs (the check can fail)
        plain = masks.materialized(compact, True, q_length, total, padding.device)
        assert not torch.equal(plain.expand_as(want), want)


@pytest.mark.parametrize("case", ["tensor offset", "key offset", "sliding window overlay", "window mismatch",
                                  "overlay", "padding shorter", "prefix"])
def test_masks_the_compact_form_cannot_express_are_transformers_sdpa_mask(case):
    """Static caches (a tensor offset), a key offset, a sliding window with an overlay or whose
    window is not the layer's local size, overlays and keys before
    the queries without a cache offset (PEFT's prefix tuning: top-left causal) keep the
    materialized [B, 1, Lq, Lk] mask, equal to transformers' sdpa mask."""
    from transformers import masking_utils

    padding = torch.arange(6)[None, :] >= torch.tensor([[0], [3]])
    kwargs = _mask_kwargs(2, 4, padding)
    if case == "tensor offset":
        kwargs["q_offset"] = torch.tensor(4)
    elif case == "key offset":
        kwargs.update(kv_offset=1, kv_length=5)
    elif case == "sliding window overlay":
        kwargs["mask_function"] = masking_utils.and_masks(masking_utils.sliding_window_causal_mask_function(3),
                                                          _overlay)
        kwargs["local_size"] = 3
    elif case == "window mismatch":
        kwargs["mask_function"] = masking_utils.sliding_window_causal_mask_function(3)
        kwargs["local_size"] = 2
    elif case == "overlay":
        kwargs["mask_function"] = masking_utils.or_masks(masking_utils.causal_mask_function, _overlay)
    elif case == "prefix":
        kwargs["q_offset"] = 0
    else:
        kwargs["attention_mask"] = padding[:, 1:]
        kwargs["kv_length"] = 6
        kwargs.update(q_offset=4)
    got = hf.attention_mask(**kwargs)
    want = masking_utils.sdpa_mask(**kwargs)
    assert got.dim() == 4 and torch.equal(got, want)


def test_bottom_right_causal_without_a_mask_matches_float64_attention():
    """A causal call with more keys than queries and no mask (a cache, no padding): query i sees
    keys j <= i + Lk - Lq; one query sees every key."""
    from torch import nn

    module = nn.Module()
    module.is_causal = True
    torch.manual_seed(0)
    for q_length in (3, 1):
        q, k, v = torch.randn(2, 4, q_length, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
        got, _ = hf.attention_forward(module, q, k, v, None, scaling=0.3)
        kk, vv = (t.double().repeat_interleave(2, dim=1) for t in (k, v))
        allowed = masks.causal_bool(q_length, 7, q.device)
        scores = (q.double() @ kk.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf"))
        want = (scores.softmax(-1) @ vv).transpose(1, 2)
        assert_parity(got.double(), want, 1e-6, f"Lq={q_length}")


# --------------------------------------------------------------------------------------------
# Decoders: parity at valid positions, cached generation
# --------------------------------------------------------------------------------------------

def each_prompt_alone(original, batch):
    """The stock eager model in float64 on each prompt alone (its valid tokens, no padding): the
    logits [B, L, V] at the valid positions, NaN elsewhere."""
    reference = copy.deepcopy(original).double()
    valid = batch["attention_mask"].bool()
    out = torch.full(valid.shape + (VOCAB,), float("nan"), dtype=torch.float64)
    with torch.no_grad():
        for row in range(valid.shape[0]):
            out[row, valid[row]] = reference(input_ids=batch["input_ids"][row, valid[row]][None]).logits[0]
    return out


def generation_positions(mask):
    """position_ids as transformers' generate() builds them: cumsum(mask) - 1, clipped at 0."""
    return (mask.cumsum(-1) - 1).clamp_min(0)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_left_padded_logits_match_each_prompt_alone_in_float64(name, monkeypatch):
    """The left-padded batch (positions counted from each prompt's first token, as generate()
    does) against the stock eager model in float64 run on each prompt without padding."""
    original = stock(name)
    model = routed(original)
    batch = prompts()
    spy = MaskSpy(monkeypatch)
    with torch.no_grad():
        got = model(**batch, position_ids=generation_positions(batch["attention_mask"])).logits
    want = each_prompt_alone(original, batch)
    valid = batch["attention_mask"].bool()
    assert torch.isfinite(got).all()  # fully padded query rows give zeros, not NaN
    assert_parity(got[valid].double(), want[valid], TOL, name)
    sliding = FAMILIES[name][2]
    assert [rank for rank, _, _ in spy.calls] == [2, 2]  # every layer compact, sliding windows too
    assert sorted(spy.windows) == [0] * (2 - sliding) + [WINDOW] * sliding


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generation_with_the_cache_gives_the_stock_tokens(name, monkeypatch):
    """The prefill (several queries, left padding) and every decode step (one query over the
    cache: bottom-right causal plus the padding) give the stock model's tokens."""
    original = stock(name)
    model = routed(original)
    batch = prompts(seed=1)
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = original.generate(**batch, **options)
        spy = MaskSpy(monkeypatch)
        got = model.generate(**batch, **options)
    assert torch.equal(got, want), f"{name}: routed {got[:, -8:].tolist()} != stock {want[:, -8:].tolist()}"
    decode = [(lk, window) for (rank, lq, lk), window in zip(spy.calls, spy.windows) if lq == 1 and rank == 2]
    assert len(decode) == 7 * 2 and spy.ranks() == {2}  # prefill and every decode step: the compact mask
    # Global layers see the whole cache; sliding ones (a sliding-window cache) the window's keys.
    assert all(lk > PROMPTS[1] for lk, window in decode if not window)
    assert [window for _, window in decode].count(WINDOW) == 7 * FAMILIES[name][2]


def test_generation_fails_when_decoding_ignores_the_padding(monkeypatch):
    """The generation check can fail: dropping the key-padding mask at decode steps (left padding
    then leaks into every new token) changes the tokens."""
    original = stock("llama")
    model = routed(original)
    batch = prompts(seed=1)
    original_masks = hf.interface.to_operator_masks

    def no_padding_when_decoding(mask, batch_size, key_length):
        attn_mask, key_padding_mask = original_masks(mask, batch_size, key_length)
        return attn_mask, (None if mask is not None and mask.shape[-1] > PROMPTS[1] else key_padding_mask)

    monkeypatch.setattr(hf.interface, "to_operator_masks", no_padding_when_decoding)
    with torch.no_grad():
        got = model.generate(**batch, max_new_tokens=8, do_sample=False, pad_token_id=0)
        want = original.generate(**batch, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert not torch.equal(got, want)


@pytest.mark.skipif(not hasattr(transformers, "GptOssConfig"), reason="transformers without GPT-OSS")
def test_calls_left_on_eager_attention_get_the_compact_mask_materialized():
    """GPT-OSS's attention sinks run transformers' eager attention: its global layer's compact
    mask is crossed with bottom-right causality for it, at the prefill and at every decode step,
    and greedy generation gives the stock tokens."""
    config = transformers.AutoConfig.for_model(
        "gpt_oss", **dict(_DECODER, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=WINDOW,
                          layer_types=["sliding_attention", "full_attention"]))
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model = copy.deepcopy(original)
    hf.register()
    model.set_attn_implementation(hf.IMPLEMENTATION)  # its layers are skipped by the report, routed here by hand
    batch = prompts(seed=1)
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got, want = model.generate(**batch, **options), original.generate(**batch, **options)
    assert torch.equal(got, want)
    counts = [sum(hf.unfused_calls(layer.self_attn).values()) for layer in model.model.layers]
    assert counts == [8, 8]  # the prefill and 7 decode steps, per layer


# --------------------------------------------------------------------------------------------
# Export without the cache
# --------------------------------------------------------------------------------------------

def _attributes(node):
    import onnx

    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _ort_logits(path, batch):
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return torch.from_numpy(session.run(None, {n: batch[n].numpy() for n in names})[0])


@pytest.mark.slow  # an ONNX export per family; CI: gpt2, mistral, qwen2-sliding, phi (every mask kind)
@pytest.mark.parametrize("name", ci_sample(list(FAMILIES)))
def test_export_has_no_materialized_causal_mask_and_runs_in_onnx_runtime(name, tmp_path):
    """Every layer: FusedAttention with is_causal=1, causal_alignment=1, the padding as its
    key-padding mask, no [B, 1, L, L] mask and no Expand/Tile of K/V; sliding-window layers carry
    their window (shorter than the prompts) as the window attribute. ONNX Runtime matches PyTorch on new left-padded batches, and
    every input's batch axis is the one `batch` symbol."""
    import onnx

    original = stock(name)
    result = export_onnx(original, prompts(), tmp_path / f"{name}.onnx")
    proto = onnx.load(str(result.path))
    nodes = [n for n in proto.graph.node if n.op_type == "FusedAttention"]
    assert len(nodes) == 2
    kv_heads = 4 if name in ("gpt2", "phi") else 2
    compact = [n for n in nodes if _attributes(n)["has_attn_mask"] == 0]
    assert len(compact) == 2
    assert sorted(_attributes(n)["window"] for n in nodes) == [0] * (2 - FAMILIES[name][2]) + [WINDOW] * FAMILIES[
        name][2]
    for node in compact:
        attrs = _attributes(node)
        assert (attrs["is_causal"], attrs["causal_alignment"], attrs["has_key_padding_mask"]) == (1, 1, 1), node.name
    for node in nodes:
        assert _attributes(node)["kv_num_heads"] == kv_heads
        assert [repeats_feeding(proto, node.input[i]) for i in (1, 2)] == [[], []], node.name
    batch_dims = {i.name: i.type.tensor_type.shape.dim[0].dim_param for i in proto.graph.input}
    assert set(batch_dims.values()) == {"batch"}, batch_dims
    for lengths, seq, seed in (([11, 4, 7, 1], 11, 3), ([5], 5, 4)):
        batch = padded_batch(lengths, seq, vocab=VOCAB, left=True, seed=seed)
        with torch.no_grad():
            want = original(**batch).logits
        got = _ort_logits(result.path, batch)
        valid = batch["attention_mask"].bool()
        assert torch.isfinite(got).all()
        assert_parity(got[valid], want[valid], TOL, f"{name}: lengths {lengths}")


@pytest.mark.slow
def test_onnx_runtime_parity_would_catch_a_dropped_padding_mask(tmp_path):
    """The export's comparison can fail: the same left-padded batch without its padding
    (every key valid) gives different logits at the valid positions."""
    original = stock("llama")
    result = export_onnx(original, prompts(), tmp_path / "llama.onnx")
    batch = prompts(seed=5)
    unpadded = dict(batch, attention_mask=torch.ones_like(batch["attention_mask"]))
    valid = batch["attention_mask"].bool()
    got, leaked = _ort_logits(result.path, batch), _ort_logits(result.path, unpadded)
    with torch.no_grad():
        want = original(**batch).logits
    assert_parity(got[valid], want[valid], TOL)
    assert max_rel_err(leaked[valid], want[valid]) > 1e-3


# --------------------------------------------------------------------------------------------
# torch.export with a key/value cache (what the cached ONNX export traces)
# --------------------------------------------------------------------------------------------

class WithPast(torch.nn.Module):
    """A decoder called with its past keys/values as tensors (a DynamicCache built from them):
    returns the logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, past):
        from transformers import DynamicCache

        cache = DynamicCache()
        for i in range(len(past) // 2):
            cache.update(past[2 * i], past[2 * i + 1], i)
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=cache, use_cache=True).logits


def _with_past_inputs(model, batch, seq, past, seed):
    """Random past keys/values, a left-padded mask over past + new tokens, generate()'s positions."""
    config = model.config
    gen = torch.Generator().manual_seed(seed)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    past_kv = [torch.randn(batch, kv_heads, past, head_dim, generator=gen) for _ in range(2 * config.num_hidden_layers)]
    total = past + seq
    lengths = torch.tensor([total, max(1, total - 4), max(1, total - 1)][:batch])
    mask = (torch.arange(total)[None, :] >= total - lengths[:, None]).long()
    ids = torch.randint(3, VOCAB, (batch, seq), generator=gen)
    positions = generation_positions(mask)[:, past:].clone()
    return dict(input_ids=ids, attention_mask=mask, position_ids=positions, past=past_kv)


@pytest.mark.slow  # a torch.export per family
@pytest.mark.parametrize("name", ["gpt2", "llama", "phi"])
def test_torch_export_with_a_cache_keeps_the_compact_mask_without_length_guards(name):
    """Dynamic batch, sequence, past and total lengths (the total its own Dim): the capture has
    no [B, 1, L, L] mask (the operator gets is_causal, bottom-right, and the [B, past + seq]
    padding), adds no guard that splits the lengths, and the program runs prefill (past 0) and
    decode shapes it was not traced with, matching the stock eager model with the same cache."""
    original = stock(name)
    wrapper = WithPast(routed(original)).eval()
    batch, seq, past = (torch.export.Dim(n) for n in ("batch", "sequence", "past_sequence"))
    layers = original.config.num_hidden_layers
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: torch.export.Dim("total_sequence")},
               "position_ids": {0: batch, 1: seq}, "past": [{0: batch, 2: past}] * (2 * layers)}
    with torch.no_grad():
        program = torch.export.export(wrapper, (), kwargs=_with_past_inputs(original, 2, 3, 5, seed=0),
                                      dynamic_shapes=dynamic, strict=False)
    calls = [n for n in program.graph.nodes if n.target is torch.ops.attn_export.attention.default]
    assert len(calls) == layers
    for call in calls:
        query, key, _, attn_mask, key_padding_mask, is_causal = call.args[:6]
        assert attn_mask is None and is_causal is True and call.args[-1] == 1  # causal_alignment: bottom-right
        assert key_padding_mask.meta["val"].shape[-1] == key.meta["val"].shape[2]  # [B, past + seq]
    reference = WithPast(original).eval()
    for shape in ((3, 1, 7), (3, 4, 0), (1, 5, 2)):  # decode, prefill, one longer prompt over a short past
        inputs = _with_past_inputs(original, *shape, seed=sum(shape))
        with torch.no_grad():
            got, want = program.module()(**inputs), reference(**inputs)
        valid = inputs["attention_mask"][:, -shape[1]:].bool()
        assert_parity(got[valid], want[valid], TOL, f"{name}: batch, sequence, past {shape}")
