"""Operator fuzz: 3,000 seeded random configurations of FusedMultiheadAttention against the
stock nn.MultiheadAttention run in float64 from the same weights: forward output, attention
weights, and every gradient (query/key/value inputs, in_proj_weight, in_proj_bias,
out_proj.weight, out_proj.bias).

Covered at random: self and cross attention (key is value or not), batch_first both, bias on
and off, attention masks none / bool / float / 3-D [B*H, L, S], key padding bool / float,
causal (is_causal=True with the exact causal mask, as nn.MultiheadAttention requires), fully
masked rows, need_weights with average_attn_weights both, odd sizes, batch 1, sequence 1,
unbatched 2-D inputs, zero-size batches, lengths at and around the tile widths (16, 32),
add_bias_kv (with fully masked rows: they then see the bias key only), inputs passed as
non-contiguous views; float32 and float64, and a few bfloat16.

Each configuration is drawn from its own seed (random.Random(seed) for the configuration,
torch.Generator(seed) for the tensors), so a failure names the configuration and the seed, and
`_check(_config(seed))` reproduces it alone.

Tolerances. float32/float64: FUZZ_C x eps x sqrt(n), n the longest reduction (embed dim, key
length, batch x query length for the weight gradients), relative to each tensor's own scale
(max |reference|); for a gradient that scale is floored at the largest gradient of its kind
(the inputs' together, the parameters' together), the inputs' also at the size of one term of
their sums, |grad out| |W_out| |W_in|, whose rounding a float32 sum carries (it rules where
every input gradient is zero but for rounding: self-attention with add_bias_kv and every key
masked, whose float64 reference is exact zeros or noise by the CPU's instruction set), so that a mathematically-zero gradient (the
query input when every query sees one key, the key part of in_proj_bias, keys nobody sees) or a
nearly cancelling one (a bias gradient summed over tokens) is held to the configuration's
scale instead of its own rounding noise. bfloat16: at most 2x the error of the stock module run in
bfloat16 (the plain computation's own rounding), plus one eps.

Fully masked rows: the stock module gives NaN, the fused layer zeros. Outputs and weights are
compared where the reference is finite, and the fused ones must be finite everywhere. For the
gradients, the output gradient is zero on those rows and the reference runs with one merged
additive [B*H, L, S] mask in which those rows see key 0: in exact arithmetic nothing else
changes (rows are independent and those rows receive no gradient).
"""
import copy
import math
import random

import pytest
import torch

from attn_export import FusedMultiheadAttention
from helpers import EPS, make_pair

# Run again under every lower instruction set the CPU has (tests/ops/cpu/test_instruction_sets.py).
pytestmark = pytest.mark.kernels
pytestmark = [pytestmark, pytest.mark.slow]  # make test-fast leaves it out

CONFIGS = 3000
CHUNK = 100
BASE_SEED = 18_000
FUZZ_C = 16.0


def _config(seed):
    rng = random.Random(seed)
    heads = rng.choice([1, 1, 2, 3, 4])
    c = dict(
        seed=seed,
        heads=heads,
        embed=heads * rng.choice([1, 2, 3, 4, 5, 8, 16]),
        batch=rng.choice([1, 1, 2, 3, 5]),
        unbatched=rng.random() < 0.1,
        # At and around the kernels' tile widths (16 and 32 floats) too.
        seqlen_q=rng.choice([1, 1, 2, 3, 5, 7, 8, 11, 13, 15, 16, 17, 31, 32, 33]),
        seqlen_k=rng.choice([1, 1, 2, 3, 4, 6, 9, 12, 15, 16, 17, 32, 33, 48]),
        kind=rng.choice(["self", "self", "shared_kv", "separate"]),
        batch_first=rng.random() < 0.5,
        bias=rng.random() < 0.7,
        attn_mask=rng.choice([None, None, "bool", "float", "bool_3d", "float_3d"]),
        padding=rng.choice([None, None, "bool", "float"]),
        causal=rng.random() < 0.2,
        fully_masked=rng.random() < 0.15,
        need_weights=rng.random() < 0.5,
        average=rng.random() < 0.5,
        dtype=rng.choices([torch.float32, torch.float64, torch.bfloat16], weights=[70, 25, 5])[0],
        add_bias_kv=rng.random() < 0.15,
        strided=rng.random() < 0.2,
        zero_batch=rng.random() < 0.03,
    )
    if c["zero_batch"] and not c["unbatched"]:
        # Stock cannot reshape an empty per-batch mask ([0, ...] has no inferable dim): 2-D only.
        c.update(batch=0, padding=None, attn_mask=c["attn_mask"] and c["attn_mask"].removesuffix("_3d"))
    if c["unbatched"]:
        c["batch"] = 1
    if c["kind"] == "self":
        c["seqlen_k"] = c["seqlen_q"]
    return c


def _describe(c):
    return ", ".join(f"{k}={str(v).replace('torch.', '')}" for k, v in c.items())


def _inputs(c, gen):
    """(query, key, value, masks) in float64, nn.MultiheadAttention's conventions."""
    B, H, Lq, Lk, E = c["batch"], c["heads"], c["seqlen_q"], c["seqlen_k"], c["embed"]
    f64 = torch.float64

    def make(n):
        shape = (n, E) if c["unbatched"] else ((B, n, E) if c["batch_first"] else (n, B, E))
        return torch.randn(shape, generator=gen, dtype=f64)

    q = make(Lq)
    if c["kind"] == "self":
        k = v = q
    elif c["kind"] == "shared_kv":
        k = v = make(Lk)
    else:
        k, v = make(Lk), make(Lk)
    masks = {}
    kind = c["attn_mask"]
    if kind is not None:
        dims = (B * H, Lq, Lk) if kind.endswith("3d") else (Lq, Lk)
        if kind.startswith("float"):
            m = torch.randn(dims, generator=gen, dtype=f64)
            if c["fully_masked"]:
                m = m.masked_fill(torch.rand(dims, generator=gen) < 0.3, -math.inf)
        else:
            m = torch.rand(dims, generator=gen) < 0.3
            if not c["fully_masked"]:
                m[..., 0] = False  # key 0 stays visible
        if c["fully_masked"]:
            row = int(torch.randint(Lq, (1,), generator=gen))
            m[..., row, :] = -math.inf if m.is_floating_point() else True
        masks["attn_mask"] = m
    if c["causal"]:
        # is_causal is nn.MultiheadAttention's hint that attn_mask IS the causal mask (it may
        # drop the mask and trust the hint), so the mask must be exactly causal here.
        causal = torch.ones(Lq, Lk, dtype=torch.bool).triu(1)
        as_float = kind is not None and kind.startswith("float")
        masks["attn_mask"] = torch.zeros(Lq, Lk, dtype=f64).masked_fill(causal, -math.inf) if as_float else causal
        masks["is_causal"] = True
    if c["padding"] is not None:
        p = torch.rand(B, Lk, generator=gen) < 0.3
        if c["fully_masked"]:
            p[int(torch.randint(B, (1,), generator=gen))] = True  # a batch element sees no key
        else:
            p[:, 0] = False
        if c["padding"] == "float":
            p = torch.zeros(B, Lk, dtype=f64).masked_fill(p, -math.inf if c["fully_masked"] else -1e4)
        masks["key_padding_mask"] = p[0] if c["unbatched"] else p
    if "attn_mask" in masks and "key_padding_mask" in masks:
        # nn.MultiheadAttention deprecates mixing a bool and a float mask: keep one kind.
        am, kp = masks["attn_mask"], masks["key_padding_mask"]
        if am.is_floating_point() != kp.is_floating_point():
            masks["key_padding_mask"] = (kp != 0) if am.dtype == torch.bool else \
                torch.zeros(kp.shape, dtype=f64).masked_fill(kp, -math.inf if c["fully_masked"] else -1e4)
    return q, k, v, masks


def _merged_mask(c, masks):
    """All masks as one additive float64 [B*H, Lq, Lk] mask, and the dead [B, H, Lq] rows
    (no visible key)."""
    B, H, Lq, Lk = c["batch"], c["heads"], c["seqlen_q"], c["seqlen_k"]
    total = torch.zeros(B, H, Lq, Lk, dtype=torch.float64)

    def additive(m):
        return torch.zeros(m.shape, dtype=torch.float64).masked_fill(m, -math.inf) if m.dtype == torch.bool else m

    m = masks.get("attn_mask")
    if m is not None:
        total = total + (additive(m).reshape(B, H, Lq, Lk) if m.dim() == 3 else additive(m))
    p = masks.get("key_padding_mask")
    if p is not None:
        total = total + additive(p).reshape(B, 1, 1, Lk)
    dead = torch.isneginf(total).all(-1)
    return total, dead


def _layout(t, c):
    """[B, L, ...] per-token tensors to the module's layout (unbatched / sequence-first)."""
    if c["unbatched"]:
        return t[0]
    return t if c["batch_first"] else t.transpose(0, 1)


def _err(actual, expected, floor):
    """max |a - e| over the entries where e is finite, relative to max(max |e|, floor)."""
    a, e = actual.detach().double(), expected.detach().double()
    finite = torch.isfinite(e)
    if not finite.any():
        return 0.0
    scale = max(float(e[finite].abs().max()), floor, 1e-300)
    return float((a - e)[finite].abs().max()) / scale


def _strided(t):
    """The same values in memory of another layout (dims reversed), as a differentiable view."""
    return t.permute(*reversed(range(t.dim()))).contiguous().permute(*reversed(range(t.dim())))


def _run(module, q, k, v, c, masks, grad_out, grad_w, strided=False):
    leaves = [q] if c["kind"] == "self" else ([q, k] if c["kind"] == "shared_kv" else [q, k, v])
    args = (_strided(q), _strided(k), _strided(v)) if strided else (q, k, v)
    out, w = module(*args, need_weights=c["need_weights"], average_attn_weights=c["average"], **masks)
    loss = (out * grad_out.to(out.dtype)).sum()
    if c["need_weights"]:
        loss = loss + (w * grad_w.to(w.dtype)).sum()
    names = [f"grad {n}" for n in ("query", "key", "value")[: len(leaves)]] + \
        [f"grad {n}" for n, _ in module.named_parameters()]
    grads = torch.autograd.grad(loss, leaves + list(module.parameters()))
    return out, w, dict(zip(names, grads))


def _leaves(q, k, v, c, dtype):
    q = q.to(dtype).requires_grad_()
    if c["kind"] == "self":
        return q, q, q
    k = k.to(dtype).requires_grad_()
    return (q, k, k) if c["kind"] == "shared_kv" else (q, k, v.to(dtype).requires_grad_())


def _check(c):
    """Compare one configuration; returns the list of failures (empty when it passes)."""
    gen = torch.Generator().manual_seed(c["seed"])
    torch.manual_seed(c["seed"])
    dtype = c["dtype"]
    B, H, Lq, Lk, E = c["batch"], c["heads"], c["seqlen_q"], c["seqlen_k"], c["embed"]
    q64, k64, v64, masks64 = _inputs(c, gen)
    ref, _ = make_pair(E, H, bias=c["bias"], batch_first=c["batch_first"], dtype=torch.float64,
                       add_bias_kv=c["add_bias_kv"])
    fused = FusedMultiheadAttention(E, H, bias=c["bias"], batch_first=c["batch_first"], dtype=dtype,
                                    add_bias_kv=c["add_bias_kv"])
    fused.load_state_dict(ref.state_dict())  # also exercises state_dict compatibility
    low = {n: (m.to(dtype) if m.is_floating_point() else m) if isinstance(m, torch.Tensor) else m
           for n, m in masks64.items()}

    merged, dead = _merged_mask(c, masks64)
    if c["add_bias_kv"]:
        dead = torch.zeros_like(dead)  # every query sees the appended bias key
    dead_rows = dead.any(1)  # [B, Lq]: a query that some head sees nothing with
    grad_out = torch.randn(B, Lq, E, generator=gen, dtype=torch.float64).masked_fill(dead_rows[..., None], 0)
    Lw = Lk + c["add_bias_kv"]  # the weights cover the appended key too
    w_shape = (B, Lq, Lw) if c["average"] else (B, H, Lq, Lw)
    grad_w = torch.randn(w_shape, generator=gen, dtype=torch.float64)
    grad_w = grad_w.masked_fill(dead_rows[:, None, :, None] if not c["average"] else dead_rows[..., None], 0)
    grad_w = grad_w[0] if c["unbatched"] else grad_w
    grad_out = _layout(grad_out, c)

    out, w, grads = _run(fused, *_leaves(q64, k64, v64, c, dtype), c, low, grad_out, grad_w, c["strided"])
    kw = dict(need_weights=c["need_weights"], average_attn_weights=c["average"])
    ref_leaves = _leaves(q64, k64, v64, c, torch.float64)
    ref_masks = masks64
    if dead.any():
        with torch.no_grad():
            out_ref, w_ref = ref(*ref_leaves, **kw, **masks64)
        # The reference for the gradients: dead rows see key 0 (they receive no gradient).
        merged[..., 0] = torch.where(dead, 0.0, merged[..., 0])
        ref_masks = {"attn_mask": merged.reshape(B * H, Lq, Lk)}
        _, _, grads_ref = _run(ref, *ref_leaves, c, ref_masks, grad_out, grad_w)
    else:
        out_ref, w_ref, grads_ref = _run(ref, *ref_leaves, c, masks64, grad_out, grad_w)

    failures = []
    if out.dtype != dtype or out.shape != out_ref.shape:
        return [f"output: {out.dtype} {tuple(out.shape)} vs {tuple(out_ref.shape)}"]
    if c["need_weights"] != (w is not None) or (w is not None and w.shape != w_ref.shape):
        return [f"weights: {None if w is None else tuple(w.shape)} vs {None if w_ref is None else tuple(w_ref.shape)}"]
    results = {"output": (out, out_ref)}
    if c["need_weights"]:
        results["weights"] = (w, w_ref)
    # The configuration's scale of each kind of gradient: the inputs' together, the parameters'
    # together (a bias gradient that nearly cancels is held to its kind's scale, not its own).
    inputs = ("grad query", "grad key", "grad value")
    kind_scale = {kind: max((float(g.abs().max()) for n, g in grads_ref.items() if (n in inputs) == kind and g.numel()),
                            default=0.0) for kind in (True, False)}
    # The input gradients' sums round at the size of one term, |grad out| |W_out| |W_in|: the
    # scale where they have none of their own (add_bias_kv with every key masked: a softmax over
    # the one bias key has zero derivative).
    w_max = max(float(p.detach().abs().max()) for n, p in ref.named_parameters() if n.endswith("weight"))
    g_max = float(grad_out.abs().max()) if grad_out.numel() else 0.0
    kind_scale[True] = max(kind_scale[True], g_max * w_max ** 2)
    for name, g_ref in grads_ref.items():
        results[name] = (grads[name], g_ref)
    for name, (a, _) in results.items():
        if not torch.isfinite(a).all():
            failures.append(f"{name}: non-finite values in the fused result")

    n = max(E, Lk, B * Lq)  # the longest reduction: weight gradients sum over every token
    if dtype == torch.bfloat16:
        plain = copy.deepcopy(ref).to(dtype)
        with torch.no_grad():
            out_p, w_p = plain(*_leaves(q64, k64, v64, c, dtype), **kw, **low)
        plain_masks = {n: (m.to(dtype) if m.is_floating_point() else m) for n, m in ref_masks.items()
                       if isinstance(m, torch.Tensor)}
        plain_masks.update({n: m for n, m in ref_masks.items() if not isinstance(m, torch.Tensor)})
        _, _, grads_p = _run(plain, *_leaves(q64, k64, v64, c, dtype), c, plain_masks, grad_out, grad_w)
        plain_results = {"output": out_p, "weights": w_p, **grads_p}
    for name, (a, e) in results.items():
        floor = kind_scale[name in inputs] if name.startswith("grad") else 0.0
        err = _err(a, e, floor)
        if dtype == torch.bfloat16:
            p = plain_results[name]
            bound = 2 * _err(p, e, floor) + EPS[dtype]
        else:
            bound = FUZZ_C * EPS[dtype] * math.sqrt(n)
        if not err <= bound:
            failures.append(f"{name}: error {err:.2e} > bound {bound:.2e}")
    return failures


def _chunk_test(start):
    failed = []
    for seed in range(BASE_SEED + start, BASE_SEED + start + CHUNK):
        c = _config(seed)
        problems = _check(c)
        if problems:
            failed.append(f"seed {seed} ({_describe(c)}):\n    " + "\n    ".join(problems))
    assert not failed, f"{len(failed)} of {CHUNK} configurations failed; reproduce one with " \
        f"test_property._check(test_property._config(SEED)):\n" + "\n".join(failed[:5])


@pytest.fixture
def one_thread():
    """Tensors this small run several times faster on one thread than on contended cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("start", range(0, CONFIGS, CHUNK))
def test_fused_matches_stock_module(start, one_thread):
    _chunk_test(start)


def test_the_fuzz_covers_what_it_claims():
    """The generator reaches every kind it is meant to, in the 3,000 configurations."""
    cs = [_config(s) for s in range(BASE_SEED, BASE_SEED + CONFIGS)]
    seen = lambda key: {c[key] for c in cs}  # noqa: E731
    assert seen("kind") == {"self", "shared_kv", "separate"}
    assert seen("attn_mask") == {None, "bool", "float", "bool_3d", "float_3d"}
    assert seen("padding") == {None, "bool", "float"}
    assert seen("dtype") == {torch.float32, torch.float64, torch.bfloat16}
    for key in ("batch_first", "bias", "causal", "fully_masked", "need_weights", "average", "unbatched",
                "add_bias_kv", "strided"):
        assert seen(key) == {False, True}, key
    assert {0, 1} <= seen("batch") and 1 in seen("seqlen_q") and 1 in seen("seqlen_k")
    assert {15, 16, 17, 31, 32, 33} <= seen("seqlen_q") and {15, 16, 17, 32, 33, 48} <= seen("seqlen_k")
    both = lambda *keys: any(all(c[k] for k in keys) for c in cs)  # noqa: E731
    assert both("add_bias_kv", "fully_masked") and both("need_weights", "strided")
    assert any(c["dtype"] == torch.float64 and c["need_weights"] for c in cs)
