"""One SDPA call in the operator's terms: whether the operator can express it
(:func:`explain_refusal`, the reason when it cannot) and the call made on the operator
(:func:`sdpa_via_operator`: masks inverted, made 4-D and expanded, ``enable_gqa``'s key/value
heads passed as they are (the operator groups them), 3-D inputs run as 4-D). Sizes are compared without adding guards under
``torch.export``."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def is_one(size) -> bool:
    """A dimension that is literally 1 (a Python int), never a symbolic size compared (which
    would add a guard under torch.export)."""
    return isinstance(size, int) and size == 1


def known_equal(a, b) -> bool:
    """a == b known without adding a guard (symbolic sizes under torch.export)."""
    if a is b:
        return True
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001
        return False


def _agree(a, b) -> bool:
    """Whether two sizes that SDPA needs equal (else broadcast) are equal. Symbolic sizes (under
    torch.export) that are not known to be equal are asserted equal with ``torch._check``, as
    SDPA's own shape checks would do, unless one of them is a literal 1 (SDPA broadcasts it)."""
    if known_equal(a, b):
        return True
    if isinstance(a, int) and isinstance(b, int):
        return False
    if is_one(a) or is_one(b):
        return False
    torch._check(a == b, lambda: f"scaled_dot_product_attention: sizes {a} and {b} must agree")
    return True


def _exporting() -> bool:
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting and is_exporting())


def _device_supported(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("attn_export::_attention_forward", device.type.upper())
    except Exception:  # noqa: BLE001
        return False


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def explain_refusal(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> Optional[str]:
    """Why one SDPA call cannot run on the operator (None when it can)."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "query, key and value are not all tensors"
    if any(t.is_nested for t in tensors):
        return "nested tensors"
    if dropout_p and float(dropout_p) > 0.0:
        return f"dropout_p={dropout_p} (attention dropout is not fused)"
    if query.dtype not in SUPPORTED_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtypes {query.dtype}/{key.dtype}/{value.dtype} (the operator takes one of float32, float64, " \
               "float16, bfloat16 for all three)"
    if not (_device_supported(query.device) and key.device == query.device and value.device == query.device):
        return f"device {query.device} (the operator was not built for it)"
    rank = query.dim()
    if rank not in (3, 4) or key.dim() != rank or value.dim() != rank:
        return f"query/key/value of rank {query.dim()}/{key.dim()}/{value.dim()} (3-D or 4-D are routed)"
    if not _agree(query.shape[-1], key.shape[-1]) or not _agree(key.shape[-2], value.shape[-2]):
        return "query/key head dims or key/value lengths differ"
    if not all(_agree(query.shape[0], t.shape[0]) for t in (key, value)):
        return f"batch sizes differ (query {list(query.shape)}, key {list(key.shape)}): SDPA broadcasts them"
    if rank == 4:
        hq, hk, hv = query.shape[1], key.shape[1], value.shape[1]
        if not known_equal(hk, hv):
            return f"key and value head counts differ ({hk} vs {hv})"
        if not known_equal(hq, hk) and not is_one(hk):  # one key/value head broadcasts (multi-query)
            if not enable_gqa:
                return f"query has {hq} heads and key/value {hk} without enable_gqa"
            if not (isinstance(hq, int) and isinstance(hk, int) and hk > 0 and hq % hk == 0):
                return f"enable_gqa with {hq} query heads and {hk} key/value heads (not a whole number of groups)"
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            return "attn_mask is not a tensor"
        if is_causal:
            return "attn_mask together with is_causal=True (SDPA refuses it)"
        if not (attn_mask.dtype == torch.bool or attn_mask.dtype in SUPPORTED_DTYPES):
            return f"attn_mask of dtype {attn_mask.dtype}"
        if attn_mask.dim() > 4 or (rank == 3 and attn_mask.dim() > 3):
            return f"attn_mask of rank {attn_mask.dim()} for {rank}-D inputs"
        if attn_mask.requires_grad and torch.is_grad_enabled() and not _exporting():
            return "attn_mask requires grad (the operator treats masks as constants)"
    return None


def _operator_masks(attn_mask: torch.Tensor, batch, heads, lq, lk, rank: int):
    """SDPA's mask (broadcastable to [B, H, Lq, Lk], or [N, Lq, Lk] for 3-D inputs) -> the
    operator's (attn_mask [B|1, H|1, Lq, Lk], key_padding_mask [B, Lk]), booleans inverted."""
    mask = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask
    while mask.dim() < rank:
        mask = mask.unsqueeze(0)
    if rank == 3:
        mask = mask.unsqueeze(1)  # [N|1, 1, Lq|1, Lk|1]
    b, h, mq, mk = mask.shape
    if is_one(mq) and is_one(h):  # one row per key: the key-padding mask
        kpm = mask[:, 0, 0, :]
        if is_one(mk) and not is_one(lk):
            kpm = kpm.expand(kpm.shape[0], lk)
        if is_one(b) and not is_one(batch):
            kpm = kpm.expand(batch, kpm.shape[1])
        return None, kpm
    if (is_one(mq) and not is_one(lq)) or (is_one(mk) and not is_one(lk)):
        mask = mask.expand(b, h, lq, lk)
    return mask, None


def sdpa_via_operator(*args, **kwargs) -> Tuple[Optional[torch.Tensor], Optional[str]]:
    """One SDPA call on the operator: ``(output, None)``, or ``(None, reason)`` when the call
    must run on PyTorch's SDPA."""
    from attn_export.ops.functional import attention

    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_arguments(*args, **kwargs)
    reason = explain_refusal(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if reason is not None:
        return None, reason
    rank = query.dim()
    if rank == 3:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    batch, heads, lq, _ = query.shape
    lk = key.shape[2]
    # enable_gqa, or one key/value head broadcast to every query head: the operator reads the
    # Hkv heads in place (query head h reads h // (H / Hkv), SDPA's repeat_interleave order).
    attn, kpm = (None, None) if attn_mask is None else _operator_masks(attn_mask, batch, heads, lq, lk, rank)
    if attn is not None and attn.requires_grad:
        attn = attn.detach()  # exporting: no backward in the graph
    if kpm is not None and kpm.requires_grad:
        kpm = kpm.detach()
    out = attention(query, key, value, attn_mask=attn, key_padding_mask=kpm, is_causal=bool(is_causal),
                    scale=scale)
    return (out.squeeze(1) if rank == 3 else out), None


def repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, H, L, D] -> [B, H * groups, L, D], each head repeated ``groups`` times in place
    (``repeat_interleave`` on the head axis, as SDPA's ``enable_gqa``)."""
    b, h, l, d = x.shape
    return x[:, :, None, :, :].expand(b, h, groups, l, d).reshape(b, h * groups, l, d)
