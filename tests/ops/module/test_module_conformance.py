"""FusedMultiheadAttention conforms to torch.nn.MultiheadAttention: for constructor options the
stock module accepts x forward options, ``FusedMultiheadAttention.from_module(ref)`` matches
``ref`` in output values, attention weights, the gradients of every parameter and input, result
dtypes, and the exception types raised for invalid inputs. Then the module's state: state_dict
keys both ways, to_module, deepcopy, torch.save / torch.load(weights_only=True),
quantize_dynamic.

The one documented difference in values: a query whose keys are all masked gets a zero
attention output (the layer output is ``out_proj.bias``) and zero weights from the fused layer,
NaN from the stock one. Those rows are compared on the fused side only, and the stock
gradients, which that NaN poisons, are not compared in such cases (the fused ones must be
finite).

The sample is the product of CONFIGS with FORWARD_CASES, each case chosen so that every option
value appears; ``-m slow`` adds the full product of the configurations, mask kinds and weights
options (each in float32 or float64, alternating, so that every configuration meets every mask
kind in both).
"""
import copy
import io
import itertools

import pytest
import torch
from torch import nn

from attn_export import FusedMultiheadAttention
from attn_export.loading import ALLOWED_GLOBALS, load_model
from helpers import assert_rel_close

pytestmark = pytest.mark.kernels  # stock's rounding depends on the CPU's instruction set too

EMBED, HEADS, BATCH = 16, 2, 3

CONFIGS = {
    "packed": {},
    "packed-nobias-bf": {"bias": False, "batch_first": True},
    "kvdim-bf": {"kdim": 8, "vdim": 12, "batch_first": True},
    "kdim-nobias": {"kdim": 8, "vdim": 8, "bias": False},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn-bf": {"add_zero_attn": True, "batch_first": True},
    "all-bf": {"add_bias_kv": True, "add_zero_attn": True, "kdim": 6, "vdim": 10, "batch_first": True},
    "bias_kv-nobias-bf": {"add_bias_kv": True, "bias": False, "batch_first": True},
}

MASK_KINDS = [
    "none", "bool_2d", "float_2d", "bool_3d", "float_3d", "padding_bool", "padding_float",
    "bool_2d+padding_bool", "float_3d+padding_float", "causal", "causal+padding_bool", "fully_masked",
]
WEIGHTS = [(True, True), (True, False), (False, True)]  # (need_weights, average_attn_weights)

# (mask kind, need_weights, average, unbatched, training, self-attention): every option value
# appears at least once, the masks with each weights option over the sample.
FORWARD_CASES = [
    (mask, *WEIGHTS[i % 3], False, i % 4 == 3, i % 5 == 0) for i, mask in enumerate(MASK_KINDS)
] + [
    ("none", True, False, True, False, False),
    ("bool_3d", True, True, True, True, False),
    ("padding_bool", False, True, True, False, True),
    ("causal", True, True, True, False, False),
    ("float_2d", True, False, False, True, True),
]


def _reference(config, dtype):
    ref = nn.MultiheadAttention(EMBED, HEADS, dtype=dtype, **config)
    with torch.no_grad():  # non-zero biases, so that their gradients are exercised
        for name, p in ref.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.3)
    return ref


def _masks(kind, unbatched, seqlen_q, seqlen_k, dtype):
    """(attn_mask, key_padding_mask, is_causal). Random masks keep key 0 visible to every query,
    except in "fully_masked": query 1 sees nothing, and batch element 1 has every key padded."""
    batch = 1 if unbatched else BATCH
    causal = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).triu(1)

    def random_bool(*lead):
        m = torch.rand(*lead, seqlen_q, seqlen_k) < 0.4
        m[..., 0] = False
        return m

    padding = torch.zeros(batch, seqlen_k, dtype=torch.bool)
    for b in range(batch):
        padding[b, max(1, seqlen_k - 2 * b):] = True
    float_padding = torch.zeros(batch, seqlen_k, dtype=dtype).masked_fill(padding, -1e4)
    attn_mask, key_padding_mask, is_causal = None, None, False
    if kind.startswith("bool_2d"):
        attn_mask = random_bool()
    elif kind == "float_2d":
        attn_mask = torch.randn(seqlen_q, seqlen_k, dtype=dtype)
    elif kind == "bool_3d":
        attn_mask = random_bool(batch * HEADS)
    elif kind.startswith("float_3d"):
        attn_mask = torch.randn(batch * HEADS, seqlen_q, seqlen_k, dtype=dtype)
    elif kind.startswith("causal"):
        attn_mask, is_causal = causal, True
    elif kind == "fully_masked":
        attn_mask = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool)
        attn_mask[1] = True
        key_padding_mask = torch.zeros(batch, seqlen_k, dtype=torch.bool)
        key_padding_mask[-1] = True
    if kind.endswith("padding_bool"):
        key_padding_mask = padding
    elif kind.endswith("padding_float"):
        key_padding_mask = float_padding
    if unbatched and key_padding_mask is not None:
        key_padding_mask = key_padding_mask[0]
    return attn_mask, key_padding_mask, is_causal


def _inputs(ref, unbatched, self_attention, seqlen_q, seqlen_k, dtype):
    def make(length, width):
        if unbatched:
            shape = (length, width)
        else:
            shape = (BATCH, length, width) if ref.batch_first else (length, BATCH, width)
        return torch.randn(shape, dtype=dtype, requires_grad=True)

    if self_attention and ref._qkv_same_embed_dim:
        x = make(seqlen_q, EMBED)
        return (x, x, x), [x]
    q, k, v = make(seqlen_q, EMBED), make(seqlen_k, ref.kdim), make(seqlen_k, ref.vdim)
    return (q, k, v), [q, k, v]


def _rel(dtype):
    return 5e-6 if dtype == torch.float32 else 1e-12


def _run_case(config, dtype, mask_kind, need_weights, average, unbatched, training, self_attention):
    ref = _reference(config, dtype).train(training)
    fused = FusedMultiheadAttention.from_module(ref)
    seqlen_q = 5
    seqlen_k = 5 if mask_kind.startswith("causal") or self_attention else 6
    (q, k, v), leaves = _inputs(ref, unbatched, self_attention, seqlen_q, seqlen_k, dtype)
    attn_mask, key_padding_mask, is_causal = _masks(mask_kind, unbatched, seqlen_q, seqlen_k, dtype)
    kwargs = dict(attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
                  need_weights=need_weights, average_attn_weights=average)
    out_ref, w_ref = ref(q, k, v, **kwargs)
    out, w = fused(q, k, v, **kwargs)
    assert out.dtype == out_ref.dtype == dtype and out.shape == out_ref.shape
    if not need_weights:
        assert w is None and w_ref is None
    else:
        assert w.dtype == w_ref.dtype and w.shape == w_ref.shape
    rel = _rel(dtype)

    # Rows (query positions) that saw no key: NaN in stock, zeros (output = out_proj.bias) fused.
    dead = torch.isnan(out_ref).any(dim=-1)
    if dead.any():
        attention_output = out - (0 if fused.out_proj.bias is None else fused.out_proj.bias)
        assert torch.equal(attention_output[dead], torch.zeros_like(attention_output[dead]))
        if not dead.all():
            assert_rel_close(out[~dead], out_ref[~dead], rel, "output rows with a visible key")
        if need_weights:
            nan = torch.isnan(w_ref)
            assert torch.equal(w[nan], torch.zeros_like(w[nan]))
            if not nan.all():
                assert_rel_close(w[~nan], w_ref[~nan], rel, "weights of rows with a visible key")
        grads = torch.autograd.grad(out.sum() + (w.sum() if need_weights else 0), leaves + list(fused.parameters()))
        assert all(torch.isfinite(g).all() for g in grads)
        return
    assert_rel_close(out, out_ref, rel, "output")
    if need_weights:
        assert_rel_close(w, w_ref, rel, "weights")

    params = list(ref.parameters())
    names = [f"input {i}" for i in range(len(leaves))] + [n for n, _ in ref.named_parameters()]
    grad_out = torch.randn_like(out_ref)

    def loss(o, weights):
        return (o * grad_out).sum() + ((weights * weights).sum() if need_weights else 0)

    got = torch.autograd.grad(loss(out, w), leaves + params)
    want = torch.autograd.grad(loss(out_ref, w_ref), leaves + params)
    # A gradient can be zero up to rounding (every query sees only the add_bias_kv key: the
    # output does not depend on the query): the case's gradients together give the scale.
    n = max(EMBED, BATCH * seqlen_k)
    for g, g_ref, name in zip(got, want, names):
        assert g.dtype == g_ref.dtype, name
        assert_rel_close(g, g_ref, rel, f"grad {name}", scale=want, n=n)


@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: "-".join(str(x) for x in c))
@pytest.mark.parametrize("config", list(CONFIGS), ids=str)
def test_matches_stock_module(config, case):
    # float64 for every other case: each configuration runs in both dtypes.
    dtype = torch.float64 if FORWARD_CASES.index(case) % 2 else torch.float32
    _run_case(CONFIGS[config], dtype, *case)


@pytest.mark.slow
@pytest.mark.parametrize("weights", WEIGHTS, ids=str)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("config", list(CONFIGS), ids=str)
def test_matches_stock_module_full_sweep(config, mask_kind, weights):
    # One dtype per (config, mask, weights), alternating, so that every configuration meets every
    # mask kind in both float32 and float64 (over the weights options) at half the cost of both.
    position = list(CONFIGS).index(config) + MASK_KINDS.index(mask_kind) + WEIGHTS.index(weights)
    dtype = (torch.float32, torch.float64)[position % 2]
    for unbatched, training in itertools.product((False, True), repeat=2):
        _run_case(CONFIGS[config], dtype, mask_kind, *weights, unbatched, training, False)


@pytest.mark.parametrize("config", ["packed", "kvdim-bf", "all-bf"])
def test_dropout_in_training_uses_the_stock_path_with_the_same_randomness(config):
    ref = _reference({**CONFIGS[config], "dropout": 0.5}, torch.float32).train()
    fused = FusedMultiheadAttention.from_module(ref)
    (q, k, v), _ = _inputs(ref, False, False, 4, 6, torch.float32)
    results = []
    for layer in (ref, fused):
        torch.manual_seed(7)
        results.append(layer(q, k, v))
    assert_rel_close(results[1][0], results[0][0], 1e-6, "output")
    assert_rel_close(results[1][1], results[0][1], 1e-6, "weights")


def test_causal_without_a_mask_is_the_documented_extension():
    """nn.MultiheadAttention insists on a mask with is_causal=True; the fused layer applies the
    causal mask itself, for every configuration, and agrees with stock given the mask."""
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    for config in ("packed", "kvdim-bf", "zero_attn-bf"):
        ref = _reference(CONFIGS[config], torch.float32)
        fused = FusedMultiheadAttention.from_module(ref)
        (q, k, v), _ = _inputs(ref, False, False, 5, 5, torch.float32)
        with pytest.raises(RuntimeError, match="Need attn_mask"):
            ref(q, k, v, is_causal=True)
        out, _ = fused(q, k, v, is_causal=True, need_weights=False)
        assert_rel_close(out, ref(q, k, v, attn_mask=causal, is_causal=True, need_weights=False)[0], 5e-6, config)


# Invalid inputs: (name, function of (ref, q, k, v) -> call arguments).
def _bad_inputs(ref, q, k, v):
    seq_dim = 1 if ref.batch_first else 0
    longer = torch.cat([k, k], dim=seq_dim)
    return {
        "rank mismatch": ((q, k[0], v[0]), {}),
        "4-D query": ((q[None], k[None], v[None]), {}),
        "query width": ((q[..., :-1], k, v), {}),
        "key width": ((q, k[..., :-1], v[..., :-1] if ref._qkv_same_embed_dim else v), {}),
        "key/value lengths": ((q, longer, v), {}),
        "batch mismatch": ((q, k.narrow(1 - seq_dim, 0, 1), v.narrow(1 - seq_dim, 0, 1)), {}),
        "padding mask shape": ((q, k, v), {"key_padding_mask": torch.zeros(BATCH, 2, dtype=torch.bool)}),
        "padding mask rank": ((q, k, v), {"key_padding_mask": torch.zeros(BATCH, 1, 6, dtype=torch.bool)}),
        "attn_mask 2-D shape": ((q, k, v), {"attn_mask": torch.zeros(2, 2, dtype=torch.bool)}),
        "attn_mask 3-D shape": ((q, k, v), {"attn_mask": torch.zeros(2, 5, 6, dtype=torch.bool)}),
        "attn_mask 4-D": ((q, k, v), {"attn_mask": torch.zeros(BATCH, HEADS, 5, 6, dtype=torch.bool)}),
        "integer attn_mask": ((q, k, v), {"attn_mask": torch.zeros(5, 6, dtype=torch.int64)}),
        "integer padding mask": ((q, k, v), {"key_padding_mask": torch.zeros(BATCH, 6, dtype=torch.int64)}),
        "float64 query": ((q.double(), k, v), {}),
    }


def _raised(layer, args, kwargs):
    try:
        layer(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return exc
    return None


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("config", ["packed", "packed-nobias-bf", "kvdim-bf", "bias_kv", "all-bf"])
def test_invalid_inputs_raise_the_stock_exception_types(config, training):
    ref = _reference(CONFIGS[config], torch.float32).train(training)
    fused = FusedMultiheadAttention.from_module(ref)
    (q, k, v), _ = _inputs(ref, False, False, 5, 6, torch.float32)
    for name, (args, kwargs) in _bad_inputs(ref, q, k, v).items():
        want, got = _raised(ref, args, kwargs), _raised(fused, args, kwargs)
        assert want is not None, f"{name}: the stock module accepts it"
        assert got is not None, f"{name}: stock raises {type(want).__name__}, fused accepts it"
        assert isinstance(got, type(want)), f"{name}: stock {type(want).__name__}, fused {type(got).__name__}: {got}"


@pytest.mark.parametrize("config", ["packed", "all-bf"])
def test_a_single_3d_mask_broadcasts_over_batch_and_heads(config):
    """The one invalid input the fused layer accepts: nn.MultiheadAttention refuses an attn_mask
    of shape [1, Lq, Lk] (RuntimeError); the fused operators broadcast it, the same as [Lq, Lk]."""
    ref = _reference(CONFIGS[config], torch.float32)
    fused = FusedMultiheadAttention.from_module(ref)
    (q, k, v), _ = _inputs(ref, False, False, 5, 6, torch.float32)
    mask = torch.randn(5, 6)
    with pytest.raises(RuntimeError):
        ref(q, k, v, attn_mask=mask[None])
    for got, want in zip(fused(q, k, v, attn_mask=mask[None]), ref(q, k, v, attn_mask=mask)):
        assert_rel_close(got, want, 5e-6, config)


@pytest.mark.parametrize("config", ["packed", "kvdim-bf"])
def test_nested_tensors_raise_assertion_error_naming_the_fix(config):
    ref = _reference({**CONFIGS[config], "batch_first": True}, torch.float32).eval()
    fused = FusedMultiheadAttention.from_module(ref)
    nested = torch.nested.nested_tensor([torch.randn(3, EMBED), torch.randn(5, EMBED)], layout=torch.jagged)
    kv = nested if ref._qkv_same_embed_dim else torch.nested.nested_tensor(
        [torch.randn(3, 8), torch.randn(5, 8)], layout=torch.jagged)
    v = nested if ref._qkv_same_embed_dim else torch.nested.nested_tensor(
        [torch.randn(3, 12), torch.randn(5, 12)], layout=torch.jagged)
    with torch.no_grad():
        with pytest.raises(AssertionError):
            ref(nested, kv, v, need_weights=False)
        with pytest.raises(AssertionError, match="to_padded_tensor"):
            fused(nested, kv, v, need_weights=False)


# --- state, classes and serialization ---------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS), ids=str)
def test_attributes_classes_and_state_dict_match(config):
    ref = nn.MultiheadAttention(EMBED, HEADS, **CONFIGS[config])
    fused = FusedMultiheadAttention(EMBED, HEADS, **CONFIGS[config])
    for name in ("embed_dim", "kdim", "vdim", "_qkv_same_embed_dim", "num_heads", "dropout", "batch_first",
                 "head_dim", "add_zero_attn"):
        assert getattr(fused, name) == getattr(ref, name), name
    for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
                 "bias_k", "bias_v"):
        mine, theirs = getattr(fused, name), getattr(ref, name)
        assert (mine is None) == (theirs is None), name
        assert mine is None or (type(mine) is type(theirs) and mine.shape == theirs.shape), name
    assert type(fused.out_proj) is type(ref.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert list(fused.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in ref.named_parameters()]
    # Both directions, strictly; then the two compute the same thing.
    fused.load_state_dict(ref.state_dict())
    back = nn.MultiheadAttention(EMBED, HEADS, **CONFIGS[config])
    back.load_state_dict(fused.state_dict())
    (q, k, v), _ = _inputs(ref, False, False, 4, 6, torch.float32)
    assert_rel_close(fused(q, k, v)[0], ref(q, k, v)[0], 5e-6, "after loading stock into fused")
    assert_rel_close(back(q, k, v)[0], ref(q, k, v)[0], 5e-6, "after loading fused into stock")


@pytest.mark.parametrize("config", ["packed", "kvdim-bf", "all-bf"])
def test_to_module_returns_the_stock_module_with_the_same_parameters(config):
    fused = FusedMultiheadAttention(EMBED, HEADS, **CONFIGS[config]).eval()
    stock = fused.to_module()
    assert type(stock) is nn.MultiheadAttention and not stock.training
    for (name, p), (name_ref, p_ref) in zip(fused.named_parameters(), stock.named_parameters()):
        assert name == name_ref and p is p_ref
    (q, k, v), _ = _inputs(stock, False, False, 4, 6, torch.float32)
    assert_rel_close(fused(q, k, v)[0], stock(q, k, v)[0], 5e-6, "to_module output")
    again = FusedMultiheadAttention.from_module(stock)
    assert list(again.state_dict()) == list(fused.state_dict())


@pytest.mark.parametrize("config", ["packed", "all-bf"])
def test_deepcopy_and_torch_save_load_weights_only(config, tmp_path):
    fused = FusedMultiheadAttention(EMBED, HEADS, **CONFIGS[config]).eval()
    (q, k, v), _ = _inputs(fused, False, False, 4, 6, torch.float32)
    expected = fused(q, k, v)[0]
    copied = copy.deepcopy(fused)
    assert all(a is not b for a, b in zip(copied.parameters(), fused.parameters()))
    path = tmp_path / "layer.pt"
    torch.save(fused, path)
    # The project's loader (an audited allowlist of globals), and plain torch.load with it.
    loaded = load_model(path)
    with torch.serialization.safe_globals(ALLOWED_GLOBALS):
        plain = torch.load(path, weights_only=True)
    buffer = io.BytesIO()
    torch.save(fused.state_dict(), buffer)
    buffer.seek(0)
    from_state = FusedMultiheadAttention(EMBED, HEADS, **CONFIGS[config]).eval()
    from_state.load_state_dict(torch.load(buffer, weights_only=True))
    for layer in (copied, loaded, plain, from_state):
        assert type(layer) is FusedMultiheadAttention
        assert_rel_close(layer(q, k, v)[0], expected, 1e-7, "after copy / save / load")


@pytest.mark.parametrize("config", ["packed", "kvdim-bf", "all-bf"])
def test_quantize_dynamic_leaves_it_working_like_the_stock_module(config):
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(EMBED, EMBED))
    stock.append(nn.MultiheadAttention(EMBED, HEADS, **CONFIGS[config]))
    fused = copy.deepcopy(stock)
    fused[1] = FusedMultiheadAttention.from_module(fused[1])
    quantized = [torch.ao.quantization.quantize_dynamic(m.eval(), {nn.Linear}) for m in (stock, fused)]
    for model in quantized:
        assert type(model[1].out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
        assert type(model[0]) is not nn.Linear  # the plain Linear was quantized
    (q, k, v), _ = _inputs(stock[1], False, False, 4, 6, torch.float32)
    out_stock = quantized[0][1](quantized[0][0](q), k, v)[0]
    out_fused = quantized[1][1](quantized[1][0](q), k, v)[0]
    assert_rel_close(out_fused, out_stock, 5e-6, "quantized model")


@pytest.mark.parametrize("config", ["packed", "packed-nobias-bf", "kvdim-bf", "bias_kv"])
def test_result_dtypes_follow_the_stock_module(config):
    """Uniform float64 runs in float64. A float16 in_proj_bias on a float64 layer: stock runs
    (float64) where F.linear promotes, with batch_first (non-contiguous) inputs, and raises
    RuntimeError where it does not; the fused layer does the same."""
    ref = _reference({**CONFIGS[config], "bias": True}, torch.float64)
    fused = FusedMultiheadAttention.from_module(ref)
    (q, k, v), _ = _inputs(ref, False, False, 4, 6, torch.float64)
    for out, weights in (ref(q, k, v), fused(q, k, v)):
        assert out.dtype == weights.dtype == torch.float64
    ref.in_proj_bias = nn.Parameter(ref.in_proj_bias.detach().half())
    fused.in_proj_bias = ref.in_proj_bias
    for training in (False, True):
        ref.train(training), fused.train(training)
        want = _raised(ref, (q, k, v), {})
        if want is not None:
            assert isinstance(_raised(fused, (q, k, v), {}), type(want))
            continue
        for got, expected in zip(fused(q, k, v), ref(q, k, v)):
            assert got.dtype == expected.dtype == torch.float64
            assert_rel_close(got, expected, 1e-12, "float16 bias")
