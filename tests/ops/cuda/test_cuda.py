"""What only the GPU has: the CUDA kernels' tensor-core head dims (compiled: 32/64/96/128/192/256;
padded to the next compiled size: 40, 80) and the generic path (float32; head dim 36, not a
multiple of 8) over sequence lengths 1..4096, unequal lengths, grouped-query heads and both causal
alignments, the fake kernels' strides on CUDA tensors, strided inputs on a side stream, and
agreement with the CPU operator.

The tests that hold on every device (every mask kind, fully masked rows, weights and their
gradient, float64 gradcheck, opcheck; the layer against nn.MultiheadAttention) take a `device`
parameter in tests/ops/core/test_attention_op.py and tests/ops/module/test_module_parity.py; their CUDA variants
carry the `cuda` marker too (`pytest -m cuda tests/` runs them all).

Every test carries the `cuda` marker and is skipped without a GPU (conftest.py). On a GPU,
scripts/gpu_check.sh builds the extension for the device and runs this file twice: as dispatched
by default (only the paths verified on a GPU; grouped-query heads and the bottom-right alignment
rewritten for them, csrc/ops/verified_inputs.h), and with ATTN_EXPORT_CUDA_PREVIEW=1, where the same
tests run the paths that wait for a GPU: the flash kernels at head dims 96/192/256 and padded
ones, grouped-query heads and the causal shift in the kernels, split-KV decoding, the forward's
128-row blocks (docs/cuda.md "Preview"). Both runs must pass.

Tolerances are derived, FlashAttention style: the fused result's error against a float64
reference may be at most twice the error of the same computation done the plain way in the
same dtype (matmul, softmax, matmul; or the stock nn.MultiheadAttention), plus a slack of the
dtype's rounding (helpers.assert_within).
"""
from __future__ import annotations

import os

import pytest
import torch

import attn_export
from helpers import EPS, MASKS, assert_parity, assert_within, check_core, padding_mask, qkv, reference_attention, scaled_err
import sm90_gpu

pytestmark = pytest.mark.cuda

ops = torch.ops.attn_export
DEVICE = "cuda"
# Read once by the kernels' host code as well (csrc/kernels/cuda/dispatch_policy.h).
PREVIEW = os.environ.get("ATTN_EXPORT_CUDA_PREVIEW") == "1"


def _require_cuda_kernels():
    if not torch._C._dispatch_has_kernel_for_dispatch_key("attn_export::attention", "CUDA"):
        raise RuntimeError(
            "attn_export was built without its CUDA kernels; rebuild with ATTN_EXPORT_CUDA=1 "
            "(scripts/gpu_check.sh does)"
        )


def _core_check(B, H, Lq, Lk, D, dtype, masks, backward=True):
    _require_cuda_kernels()
    check_core(DEVICE, dtype, B, H, Lq, Lk, D, masks, backward=backward)


def assert_output_within(out, q, k, v, masks, dtype, n):
    """The operator's output `out` against the float64 reference, within the rounding of a `dtype`
    computation of it (n: the longest reduction)."""
    exact, _ = reference_attention(q, k, v, **masks)
    plain, _ = reference_attention(q, k, v, dtype=dtype, **masks)
    assert out.shape == exact.shape and torch.isfinite(out).all()
    assert_within(out, plain, exact, dtype, "output", n)
    return exact, plain


# ---- The attention core ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256, 40, 80, 36])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [1, 7, 97, 128, 1025])
def test_core_matches_reference(dtype, head_dim, causal, seqlen):
    _core_check(2, 3, seqlen, seqlen, head_dim, dtype, {"is_causal": causal})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("alignment", [0, 1], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("Lq,Lk", [(97, 1025), (1025, 97), (1, 4096)])
def test_grouped_query_heads_and_causal_alignment(dtype, head_dim, group, alignment, Lq, Lk):
    """Key/value heads read in place by each group of query heads (dK/dV summed over the group),
    and causality top-left or bottom-right (Lq > Lk leaves rows with no key: zeros)."""
    _require_cuda_kernels()
    H = 8
    make = lambda *shape: torch.randn(*shape, dtype=dtype, device=DEVICE, requires_grad=True)  # noqa: E731
    q, k, v = make(2, H, Lq, head_dim), make(2, H // group, Lk, head_dim), make(2, H // group, Lk, head_dim)
    masks = {"is_causal": True, "causal_alignment": alignment}
    out = attn_export.attention(q, k, v, **masks)
    n = max(Lq, Lk, head_dim)
    exact, plain = assert_output_within(out, q, k, v, masks, dtype, n)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(exact, (q, k, v), grad.double())
    plain_grads = torch.autograd.grad(plain, (q, k, v), grad)
    for g, p, w, t, name in zip(got, plain_grads, want, (q, k, v), "qkv"):
        assert g.shape == t.shape, f"grad {name}"
        assert_within(g, p, w, dtype, f"grad {name}", n, scale=w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads_k", [32, 8, 4])
@pytest.mark.parametrize("Lq,Lk", [(1, 4096), (4, 32768), (3, 1000)])
@pytest.mark.parametrize("mask", ["none", "padding", "bottom_right"])
def test_decode(dtype, heads_k, Lq, Lk, mask):
    """A decode step over a KV cache (B2 H32 head dim 128): split-KV with the preview switch (the
    query tiles are far fewer than the SMs), one program per query tile without it; with the
    preview, grouped heads (8 and 4 key/value heads) packed 4 and 8 to a tile (kPackGqa)."""
    _require_cuda_kernels()
    B, H, D = 2, 32, 128
    q = torch.randn(B, H, Lq, D, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(B, heads_k, Lk, D, dtype=dtype, device=DEVICE) for _ in range(2))
    masks = {}
    if mask == "padding":
        masks["key_padding_mask"] = torch.arange(Lk, device=DEVICE)[None, :] >= torch.tensor([[Lk], [Lk // 3]], device=DEVICE)
    elif mask == "bottom_right":
        masks = {"is_causal": True, "causal_alignment": 1}
    assert_output_within(attn_export.attention(q, k, v, **masks), q, k, v, masks, dtype, Lk)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Lq", [1, 5, 9])
def test_decode_packed_rows_keep_their_masks(dtype, Lq):
    """Grouped heads 8:1 (16 query heads, 2 key/value heads; packed to a tile with the preview, 72
    rows at Lq 9 span two tiles): a per-head additive mask, key padding, bottom-right causality and
    a window each index the row's own head and query."""
    _require_cuda_kernels()
    B, H, Hkv, Lk, D = 2, 16, 2, 3000, 128
    q = torch.randn(B, H, Lq, D, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(B, Hkv, Lk, D, dtype=dtype, device=DEVICE) for _ in range(2))
    masks = {"attn_mask": torch.randn(1, H, Lq, Lk, dtype=dtype, device=DEVICE),
             "key_padding_mask": padding_mask(B, Lk, device=DEVICE), "is_causal": True, "causal_alignment": 1,
             "window": 1000}
    assert_output_within(attn_export.attention(q, k, v, **masks), q, k, v, masks, dtype, Lk)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("masks", [{"is_causal": True, "causal_alignment": 1}, {"padding": True}, {}],
                         ids=["bottom-right", "key-padding", "none"])
def test_wide_forward_blocks(dtype, head_dim, masks):
    """Prefill whose 128-row blocks (batch x heads x ceil(Lq / 128)) fill the SMs: with the preview
    (and not the sm_90a forward, which takes prefill on Hopper) the sm80 forward's 128-row kernel
    (FlashFwdTraits<D, 2>: kernel_traits.h kWideFwdHeadDims, dispatch_policy.h wide_forward_tiles),
    else the 64-row one. Lq 1030 leaves the last block's second row tiles past the sequence."""
    _require_cuda_kernels()
    H, Lq, Lk = 4, 1030, 1100
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    B = -(-sms // (H * -(-Lq // 128)))
    q, k, v = qkv(B, H, Lq, Lk, head_dim, dtype, device=DEVICE)
    masks = dict(masks)  # the parametrized dict is shared by the cases
    if masks.pop("padding", False):
        masks["key_padding_mask"] = padding_mask(B, Lk, device=DEVICE)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = attn_export.attention(q, k, v, **masks)
        torch.cuda.synchronize()
    ran = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    hopper = sm90_gpu.skip_reason("the sm_90a forward") is None  # dispatched here: it takes this prefill
    wide = any(f"FlashFwdTraits<{head_dim}, 2>" in name for name in ran)
    assert wide == (PREVIEW and not hopper), sorted(ran)
    assert_output_within(out, q, k, v, masks, dtype, Lk)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_core_long_sequence(dtype, head_dim):
    _core_check(1, 2, 4096, 4096, head_dim, dtype, {"is_causal": True})
    _core_check(1, 2, 4096, 4096, head_dim, dtype, {}, backward=False)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 4096), (97, 1025), (1025, 97), (4096, 1)])
def test_core_unequal_lengths(seqlen_q, seqlen_k):
    for causal in (False, True):
        _core_check(1, 2, seqlen_q, seqlen_k, 64, torch.float16, {"is_causal": causal})


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_outputs_have_the_fake_kernels_layouts(dtype):
    """Strides and dtypes of every result are exactly those the fake kernels promise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _require_cuda_kernels()
    q, k, v = qkv(2, 3, 17, 19, 64, dtype, device=DEVICE)
    real = ops._attention_forward(q, k, v, None, padding_mask(2, 19, device=DEVICE), True, None, True)
    grads = ops._attention_backward(torch.randn_like(real[0]), None, q, k, v, real[1], None, None, True, None)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = ops._attention_forward(q, k, v, None, padding_mask(2, 19, device=DEVICE), True, None, True)
        fake_grads = ops._attention_backward(torch.randn_like(real[0]), None, q, k, v, real[1], None, None, True, None)
    for r, f in zip((*real, *grads), (*fake, *fake_grads)):
        assert (r.shape, r.stride(), r.dtype, r.device) == (f.shape, f.stride(), f.dtype, f.device)
    assert real[1].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)



def test_non_contiguous_inputs_and_a_side_stream():
    """Heads split from a packed [B, L, 3, H, D] projection (strided views), on a side stream."""
    _require_cuda_kernels()
    B, L, H, D = 2, 50, 4, 64
    packed = torch.randn(B, L, 3, H, D, dtype=torch.float16, device=DEVICE)
    q, k, v = (packed[:, :, i].transpose(1, 2) for i in range(3))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = attn_export.attention(q, k, v, is_causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    exact, _ = reference_attention(q, k, v, is_causal=True)
    plain, _ = reference_attention(q, k, v, dtype=torch.float16, is_causal=True)
    assert_within(out, plain, exact, torch.float16, "output", L)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_deterministic_algorithms_are_honoured(dtype):
    """torch.use_deterministic_algorithms(True): the flash backward (dQ by float atomics) raises as
    PyTorch's own nondeterministic ops do, and warns with warn_only=True; float32 (the generic
    kernels, dQ in a second pass) runs and gives the same bits twice."""
    _require_cuda_kernels()
    q, k, v = qkv(2, 4, 200, 200, 64, dtype, requires_grad=True, device=DEVICE)
    grad = torch.randn_like(q)

    def grads():
        out = attn_export.attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), grad)

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.use_deterministic_algorithms(True)
        hopper = PREVIEW and os.environ.get("ATTN_EXPORT_CUDA_SM90") == "1" and torch.cuda.get_device_capability()[0] == 9
        if dtype == torch.float32 or hopper:  # the Hopper backward takes its deterministic turns
            first, second = grads(), grads()
            assert all(torch.equal(a, b) for a, b in zip(first, second))
            return
        with pytest.raises(RuntimeError, match="attn_export's attention backward"):
            grads()
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="attn_export's attention backward"):
            grads()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_the_cpu_operator(dtype):
    _require_cuda_kernels()
    B, H, Lq, Lk = 2, 3, 41, 29
    masks = MASKS["causal+padding+float"](B, H, Lq, Lk, DEVICE)
    q, k, v = qkv(B, H, Lq, Lk, 64, dtype, requires_grad=True, device=DEVICE)
    cpu = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    cpu_masks = {n: (m.cpu() if isinstance(m, torch.Tensor) else m) for n, m in masks.items()}
    out, out_cpu = attn_export.attention(q, k, v, **masks), attn_export.attention(*cpu, **cpu_masks)
    exact, _ = reference_attention(q, k, v, **masks)
    # The CPU op computes in float32 and rounds once; the GPU op's error must stay within 2x
    # of the plain same-dtype computation, as everywhere; and for float32 the two agree closely.
    if dtype == torch.float32:
        assert_parity(out.cpu(), out_cpu, 1e-5, "output", n=Lk)
    else:
        assert_within(out, reference_attention(q, k, v, dtype=dtype, **masks)[0], exact, dtype, "output", Lk)
        assert scaled_err(out_cpu, exact.cpu()) <= EPS[dtype]
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    got_cpu = torch.autograd.grad(out_cpu, cpu, grad.cpu())
    for g, c, name in zip(got, got_cpu, "qkv"):
        assert g.shape == c.shape and g.stride() == c.stride(), name
        if dtype == torch.float32:
            assert_parity(g.cpu(), c, 1e-4, f"grad {name}", scale=got_cpu, n=max(Lq, Lk))

