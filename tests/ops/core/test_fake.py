"""The fake kernels (exporter/attn_export/ops/fake.py) must reject what the C++ kernels reject, with the
same message, and otherwise describe the real outputs exactly."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attn_export

ops = torch.ops.attn_export


def _error(fn, *args):
    with pytest.raises(RuntimeError) as info:
        fn(*args)
    return str(info.value).splitlines()[0]


def _same_error_real_and_fake(op, *args):
    real = _error(op, *args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = _error(op, *fake_args)
    assert real == fake
    return real


q = torch.randn(2, 3, 5, 8)
k = torch.randn(2, 3, 7, 8)
v = torch.randn(2, 3, 7, 8)

BAD_CORE = {
    "rank": ((q[0], k, v, None, None), "must be 4-D"),
    "dtype": ((q.double(), k, v, None, None), "share one floating dtype"),
    "integer": ((q.long(), k.long(), v.long(), None, None), "share one floating dtype"),
    "batch": ((q[:1], k, v, None, None), "agree in batch"),
    "heads": ((q[:, :1], k, v, None, None), "key and value heads must divide the query heads"),
    "heads not dividing": ((torch.randn(2, 4, 5, 8), k, v, None, None), "H % Hkv == 0"),
    "key and value heads": ((q, k, v[:, :1], None, None), "key and value heads must divide"),
    "kv length": ((q, k, v[:, :, :3], None, None), "same sequence length"),
    "head_dim": ((q[..., :4], k, v, None, None), "same head_dim"),
    "mask dtype": ((q, k, v, torch.zeros(5, 7, dtype=torch.long), None), "bool or floating"),
    "mask shape": ((q, k, v, torch.zeros(7, 5, dtype=torch.bool), None), "attn_mask must be"),
    "mask 3d": ((q, k, v, torch.zeros(4, 5, 7, dtype=torch.bool), None), "attn_mask must be"),
    "mask 4d": ((q, k, v, torch.zeros(2, 2, 5, 7, dtype=torch.bool), None), "attn_mask must be"),
    "padding shape": ((q, k, v, None, torch.zeros(2, 5, dtype=torch.bool)), "key_padding_mask must be"),
    "padding dtype": ((q, k, v, None, torch.zeros(2, 7, dtype=torch.int32)), "bool or floating"),
}


@pytest.mark.parametrize("case", list(BAD_CORE))
def test_core_checks_agree(case):
    (query, key, value, mask, padding), words = BAD_CORE[case]
    message = _same_error_real_and_fake(ops.attention, query, key, value, mask, padding)
    assert words in message
    assert "got" in message  # messages quote what was received


@pytest.mark.parametrize("softcap", [-2.0, -1e-30, float("nan"), float("inf")])
def test_softcap_checks_agree(softcap):
    for op, args in ((ops.attention, (q, k, v, None, None, False, None, softcap)),
                     (ops._attention_forward, (q, k, v, None, None, False, None, False, softcap))):
        message = _same_error_real_and_fake(op, *args)
        assert "softcap must be finite and >= 0" in message and "got" in message


@pytest.mark.parametrize("alignment", [2, -1, 7])
def test_causal_alignment_checks_agree(alignment):
    for op, args in ((ops.attention, (q, k, v, None, None, True, None, 0.0, alignment)),
                     (ops._attention_forward, (q, k, v, None, None, True, None, False, 0.0, alignment))):
        message = _same_error_real_and_fake(op, *args)
        assert message == ("attention: causal_alignment must be 0 or 1 (0 = top-left: query i sees keys j <= i; "
                           f"1 = bottom-right: keys j <= i + Lk - Lq); got {alignment}")


@pytest.mark.parametrize("is_causal,window,words", [
    (False, 3, "attention: window > 0 needs is_causal=True (the window ends at the causal diagonal); got window=3 "
               "with is_causal=False: pass is_causal=True, or window=0 and a boolean attn_mask"),
    (True, -1, "attention: window must be finite and >= 0 (0 = no window; w > 0 = each query sees its last w keys "
               "up to the causal diagonal); got -1")])
def test_window_checks_agree(is_causal, window, words):
    for op, args in ((ops.attention, (q, k, v, None, None, is_causal, None, 0.0, 0, window)),
                     (ops._attention_forward, (q, k, v, None, None, is_causal, None, False, 0.0, 0, window))):
        assert _same_error_real_and_fake(op, *args) == words


SPEC = attn_export.spec.load()
RANGES = {r.name: r for r in SPEC.attribute_ranges}


def _outside(name):
    """Values of the attribute's type just outside its range (kAttributeRanges); a FLOAT also nan."""
    r = RANGES[name]
    values = [r.min - 1, *([] if r.max is None else [r.max + 1])]
    if SPEC.attribute[name].type_name == "INT":
        return [int(x) for x in values]
    return [*values, float("nan")]


@pytest.mark.parametrize("name", list(RANGES))
def test_every_restricted_attribute_is_refused_in_the_spec_words(name):
    """The binding's one check and the fake kernels' word each refusal from the spec's range:
    "attention: <name> must be <rule>; got <value>", for the forward and the backward too."""
    lse = torch.zeros(2, 3, 5)
    calls = ((ops.attention, (q, k, v)),
             (ops._attention_forward, (q, k, v, None, None, False, None, False)),
             (ops._attention_backward, (torch.zeros_like(q), None, q, k, v, lse, None, None, False, None)))
    for value in _outside(name):
        for op, args in calls:
            message = _same_error_real_and_fake(lambda *a, op=op: op(*a, **{name: value}), *args)
            assert message == f"attention: {RANGES[name].refusal(value)}"


E, H = 8, 2
x = torch.randn(2, 5, E)
w_in, b_in, w_out, b_out = torch.randn(3 * E, E), torch.randn(3 * E), torch.randn(E, E), torch.randn(E)
BAD_LAYER = {
    "rank": ((x[0], x, x, H, w_in, b_in, w_out, b_out), "all be 3-D"),
    "heads": ((x, x, x, 3, w_in, b_in, w_out, b_out), "not divisible by num_heads"),
    "kdim": ((x, x[..., :4], x, H, w_in, b_in, w_out, b_out), "kdim/vdim are not supported"),
    "key vs value": ((x, x, x[:, :3], H, w_in, b_in, w_out, b_out), "same length and batch"),
    "batch": ((x, x[:1], x[:1], H, w_in, b_in, w_out, b_out), "same batch size"),
    "in_proj_weight": ((x, x, x, H, w_in[:E], b_in, w_out, b_out), "in_proj_weight must be"),
    "in_proj_bias": ((x, x, x, H, w_in, b_in[:E], w_out, b_out), "in_proj_bias must be"),
    "out_proj_weight": ((x, x, x, H, w_in, b_in, w_out[:, :2], b_out), "out_proj_weight must be"),
    "out_proj_bias": ((x, x, x, H, w_in, b_in, w_out, b_out[:2]), "out_proj_bias must be"),
    "dtype": ((x, x, x, H, w_in.double(), b_in, w_out, b_out), "query's dtype"),
}


@pytest.mark.parametrize("case", list(BAD_LAYER))
def test_layer_checks_agree(case):
    args, words = BAD_LAYER[case]
    message = _same_error_real_and_fake(
        lambda *a: ops.multi_head_attention(*a, None, None, True, True, False, True), *args
    )
    assert words in message


def test_layer_mask_checks_agree():
    bad_padding = torch.zeros(2, 4, dtype=torch.bool)
    message = _same_error_real_and_fake(
        lambda *a: ops.multi_head_attention(*a, None, bad_padding, True, True, False, True),
        x, x, x, H, w_in, b_in, w_out, b_out,
    )
    assert "key_padding_mask must be" in message
    bad_mask = torch.zeros(1, 1, 5, 5, dtype=torch.bool)
    message = _same_error_real_and_fake(
        lambda *a: ops.multi_head_attention(*a, bad_mask, None, True, True, False, True),
        x, x, x, H, w_in, b_in, w_out, b_out,
    )
    assert "attn_mask must be 2-D" in message


def test_fake_outputs_describe_real_outputs():
    """Shapes, dtypes and strides of every output, under several argument combinations."""
    cases = [
        (ops._attention_forward, (q, k, v, None, None, False, None, True)),
        (ops._attention_forward, (q.bfloat16(), k.bfloat16(), v.bfloat16(), None, None, True, None, False)),
        (ops._attention_forward, (q, k, v, None, None, True, None, True, 2.5)),
        (ops.multi_head_attention, (x, x, x, H, w_in, b_in, w_out, b_out, None, None, True, False, False, True)),
        (ops.multi_head_attention, (x, x, x, H, w_in, None, w_out, None, None, None, True, True, False, False)),
        (ops.multi_head_attention, (x[0], x[0], x[0], H, w_in, b_in, w_out, b_out, None, None, True, True, False, False)),
        (ops.multi_head_attention, (x, x, x, H, w_in, b_in, w_out, b_out, None, None, False, True, False, False)),
    ]
    for op, args in cases:
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        for r, f in zip(real, fake):
            assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def test_unbuilt_extension_is_reported_with_the_fix(monkeypatch):
    import importlib

    from attn_export.ops import library as _library

    monkeypatch.setattr(_library, "_loaded", False)
    real_import = importlib.import_module

    def fake_import(name, *a, **kw):
        if name == "attn_export._C":
            raise ImportError("libfoo.so: cannot open shared object file")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    with pytest.raises(_library.ExtensionNotBuiltError, match="pip install --no-build-isolation -e ."):
        _library.load_library()
    assert attn_export.attention is not None


def test_check_softcap_keeps_its_message():
    """The module-level check_softcap (kept for callers of the name) refuses as the operator does."""
    from attn_export.ops.fake import check_softcap

    check_softcap(0.0)
    check_softcap(30.0)
    with pytest.raises(RuntimeError, match=r"^attention: softcap must be finite and >= 0 \(0 = off\); got -2$"):
        check_softcap(-2.0)
