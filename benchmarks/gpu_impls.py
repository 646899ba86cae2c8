"""How each column of the GPU benchmark runs a case: attn_export's operator, each SDPA backend
pinned with ``torch.nn.attention.sdpa_kernel``, and (layer rows) the three layers of
benchmarks/layers.py. ``prepare`` returns the call to time and the context to time it in; a
backend that cannot run the case raises, and benchmarks/gpu_timing.py turns that into "n/a"."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, ContextManager, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attn_export
from benchmarks.gpu_cases import Case
from benchmarks.layers import REFERENCE, Shape, layer_statement

OURS = "attn_export"
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
ATTENTION_IMPLS = (OURS,) + tuple(SDPA_BACKENDS)
LAYER_IMPLS = {OURS: "fused", REFERENCE: REFERENCE, "sdpa": "sdpa"}  # column -> layers.py's name
MATH_MAX_SCORES = 2 ** 30  # the math backend materializes B x H x Lq x Lk scores (fp32): past this, not cheap


class NotApplicable(Exception):
    """The column does not run this case, for the reason given (not a failure)."""


@dataclasses.dataclass
class Prepared:
    call: Callable[[], object]
    context: Callable[[], ContextManager] = contextlib.nullcontext
    note: Optional[str] = None  # said in the row, e.g. that K/V were expanded


def impls_for(case: Case):
    return tuple(LAYER_IMPLS) if case.group in ("layer", "small") else ATTENTION_IMPLS


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@functools.lru_cache(maxsize=None)
def operator_takes_gqa(device: str) -> bool:
    """Whether attn_export.attention accepts fewer key/value heads than query heads (one try)."""
    q = torch.randn(1, 4, 8, 16, device=device)
    kv = torch.randn(1, 2, 8, 16, device=device)
    try:
        attn_export.attention(q, kv, kv)
        return True
    except RuntimeError:
        return False


def make_inputs(case: Case, device: str):
    """q [B, H, Lq, D], k and v [B, Hkv, Lk, D] and the key-padding mask (True = padding)."""
    torch.manual_seed(0)
    grad = case.mode == "forward+backward"
    dtype = torch_dtype(case.dtype)
    q = torch.randn(case.batch, case.heads, case.q_len, case.head_dim, device=device, dtype=dtype, requires_grad=grad)
    k, v = (torch.randn(case.batch, case.n_kv_heads, case.kv_len, case.head_dim, device=device, dtype=dtype,
                        requires_grad=grad) for _ in range(2))
    padding = None
    if case.pad_lengths is not None:
        lengths = torch.tensor(case.valid_lengths(), device=device)
        padding = torch.arange(case.kv_len, device=device)[None, :] >= lengths[:, None]
    return q, k, v, padding


def attention_call(impl: str, case: Case, q, k, v, padding):
    """(the forward call, a note) for one column."""
    groups = case.heads // case.n_kv_heads
    if impl == OURS:
        note = None
        if groups > 1 and not operator_takes_gqa(str(q.device)):
            note = "K/V expanded to every query head inside the timed call (the operator refuses GQA)"
            return (lambda: attn_export.attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                                  key_padding_mask=padding, is_causal=case.causal)), note
        return (lambda: attn_export.attention(q, k, v, key_padding_mask=padding, is_causal=case.causal)), note
    mask = None if padding is None else ~padding[:, None, None, :]  # SDPA: True = may attend
    extra = dict(enable_gqa=True) if groups > 1 else {}
    return (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=case.causal, **extra)), None


def with_backward(forward, q, k, v):
    grad = torch.randn_like(forward())
    return lambda: torch.autograd.grad(forward(), (q, k, v), grad)


def score_count(case: Case) -> int:
    return case.batch * case.heads * case.q_len * case.kv_len


def declines_early(impl: str, case: Case) -> bool:
    """The math backend is run only where its B x H x Lq x Lk scores are cheap."""
    return impl == "math" and score_count(case) > MATH_MAX_SCORES


def prepare_attention(impl: str, case: Case, device: str) -> Prepared:
    if declines_early(impl, case):
        raise NotApplicable(f"not run: the math backend would hold {score_count(case) / 2 ** 30:.1f} Gi scores "
                            f"(limit {MATH_MAX_SCORES / 2 ** 30:.2f} Gi)")
    q, k, v, padding = make_inputs(case, device)
    backend = SDPA_BACKENDS.get(impl)
    context = (lambda: sdpa_kernel(backend)) if backend is not None else contextlib.nullcontext
    with context():
        forward, note = attention_call(impl, case, q, k, v, padding)
        if case.mode == "forward+backward":
            return Prepared(with_backward(forward, q, k, v), context, note)
    return Prepared(forward, lambda: _stacked(context(), torch.no_grad()), note)


def _stacked(*contexts) -> ContextManager:
    stack = contextlib.ExitStack()
    for c in contexts:
        stack.enter_context(c)
    return stack


def prepare_layer(impl: str, case: Case, device: str) -> Prepared:
    shape = Shape(case.batch, case.q_len, case.heads * case.head_dim, case.heads)
    return Prepared(layer_statement(LAYER_IMPLS[impl], case.mode, shape, device, torch_dtype(case.dtype)))


def prepare(impl: str, case: Case, device: str) -> Prepared:
    if case.group in ("layer", "small"):
        return prepare_layer(impl, case, device)
    return prepare_attention(impl, case, device)
