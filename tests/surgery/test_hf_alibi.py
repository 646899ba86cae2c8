"""Bloom and MPT (issue 60): their attention routed by the ``alibi`` route, the ALiBi bias as the
operator's per-head slopes. Tiny random-weight models (4 heads, and 6, where MPT's slopes are
interleaved), a left-padded batch: the routed model's logits at valid positions against the stock
model's on each prompt alone, in float64 and float32, for a prefill and a decode step with the
cache; the report names the route at every layer, with the slopes transformers' own functions
give; a Bloom padding mask with a hole between valid keys, and a call asking for the attention
weights, run the stock module (counted)."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install 'attn-export[hf]'")

import attn_export  # noqa: E402
from attn_export.surgery import fused_calls  # noqa: E402

from helpers import assert_parity  # noqa: E402
from hf_models import HF5, padded_batch  # noqa: E402

# Slow tier (make test-fast leaves it out, ~20 s of a worker): the operator's ALiBi has its fast tests
# in tests/ops/core/test_alibi.py.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HF5, reason="checked with transformers 5's Bloom and MPT")]
transformers.utils.logging.set_verbosity_error()

VOCAB = 128
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Relative to the logits' largest magnitude. Both stock modules take their softmax in float32 whatever
# the model's dtype (Bloom: softmax(dtype=float32), MPT: scores.float()), so float64 is compared at
# float32's level too.
TOL = {torch.float64: 1e-6, torch.float32: 1e-5}


def build(name: str, heads: int = 4):
    torch.manual_seed(0)
    hidden = 16 * heads
    if name == "bloom":
        config = transformers.BloomConfig(hidden_size=hidden, n_layer=2, n_head=heads, vocab_size=VOCAB, **SPECIAL)
        return transformers.BloomForCausalLM(config).eval()
    config = transformers.MptConfig(d_model=hidden, n_layers=2, n_heads=heads, vocab_size=VOCAB, max_seq_len=128,
                                    **SPECIAL)
    return transformers.MptForCausalLM(config).eval()


def attention_modules(model):
    return [m for m in model.modules() if type(m).__name__ in ("BloomAttention", "MptAttention")]


def model_slopes(name: str, model) -> list:
    """The slopes of the stock model's own ALiBi tensor (what its forward adds), per head."""
    if name == "bloom":
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor

        bias = build_alibi_tensor(torch.ones(1, 3, dtype=torch.int64), model.config.n_head, torch.float64)
        return (bias[:, 0, 2] - bias[:, 0, 1]).tolist()
    bias = model.transformer.build_mpt_alibi_tensor(model.config.n_heads, model.config.max_seq_len)
    return (bias[:, 0, -1] - bias[:, 0, -2]).double().tolist()


def step(model, ids, mask, cache=None):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    return out.logits, out.cache


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name,heads", [("bloom", 4), ("mpt", 4), ("bloom", 6), ("mpt", 6)])
def test_routed_bloom_and_mpt_give_the_stock_logits_on_a_left_padded_batch_with_the_cache(name, heads, dtype):
    """The reference is the stock model on each prompt alone: stock Bloom in float64 turns a
    left-padded batch into NaN (its padding rows' scores, finfo.min plus the bias, overflow to
    -inf, and the NaN rows' values reach the valid ones)."""
    stock = build(name, heads).to(dtype)
    routed = copy.deepcopy(stock)
    report = attn_export.replace_attention(routed)
    rows = [layer for layer in report.layers if layer.found == "alibi"]
    assert [layer.status for layer in rows] == ["routed", "routed"], str(report)
    assert all(layer.num_heads == heads for layer in rows), str(report)

    batch = padded_batch((9, 5, 2), 9, vocab=VOCAB, left=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    new = torch.tensor([[5], [6], [7]])
    got, cache = step(routed, ids, mask)
    got_next, _ = step(routed, new, torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1), cache)
    for row in range(len(ids)):
        alone = ids[row][mask[row].bool()][None]
        want, cache = step(stock, alone, torch.ones_like(alone))
        want_next, _ = step(stock, new[row:row + 1], torch.ones(1, alone.shape[1] + 1, dtype=torch.int64), cache)
        assert_parity(got[row][mask[row].bool()], want[0], TOL[dtype], f"{name}: prefill, row {row}")
        assert_parity(got_next[row], want_next[0], TOL[dtype], f"{name}: decode, row {row}")
    assert [fused_calls(m).fused for m in attention_modules(routed)] == [2, 2]
    assert [fused_calls(m).unfused for m in attention_modules(routed)] == [{}, {}]


@pytest.mark.parametrize("name", ["bloom", "mpt"])
def test_the_report_names_the_alibi_route_and_the_models_own_slopes(name):
    model = build(name, heads=6)
    report = attn_export.inspect_attention(model)
    rows = [layer for layer in report.layers if "Attention" in layer.cls]
    assert [(layer.found, layer.status) for layer in rows] == [("alibi", "will be routed")] * 2, str(report)
    slopes = ", ".join(f"{s:g}" for s in model_slopes(name, model))
    assert all(f"[{slopes}]" in " ".join(layer.notes) for layer in rows), (slopes, [layer.notes for layer in rows])


def test_a_bloom_padding_mask_with_a_hole_runs_the_stock_module_and_is_counted():
    stock = build("bloom")
    routed = copy.deepcopy(stock)
    attn_export.replace_attention(routed)
    ids = padded_batch((6,), 6, vocab=VOCAB)["input_ids"]
    mask = torch.tensor([[1, 1, 0, 1, 1, 1]])
    with torch.no_grad():
        want, got = stock(input_ids=ids, attention_mask=mask).logits, routed(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want)
    counts = [fused_calls(m) for m in attention_modules(routed)]
    assert [c.fused for c in counts] == [0, 0] and all(len(c.unfused) == 1 for c in counts), counts
    assert "holes between valid keys" in next(iter(counts[0].unfused))


def test_bloom_asked_for_its_attention_weights_runs_the_stock_module_and_is_counted():
    stock = build("bloom")
    routed = copy.deepcopy(stock)
    attn_export.replace_attention(routed)
    batch = padded_batch((6, 4), 6, vocab=VOCAB)
    with torch.no_grad():
        want, got = stock(**batch, output_attentions=True), routed(**batch, output_attentions=True)
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.attentions, want.attentions)
    counts = [fused_calls(m) for m in attention_modules(routed)]
    assert [c.fused for c in counts] == [0, 0] and all("output_attentions=True" in next(iter(c.unfused))
                                                       for c in counts), counts
