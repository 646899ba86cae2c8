"""Translation of the operators into ONNX, run by torch's exporter in onnxscript's tracing mode
(``custom_translation_table``): ``attn_export::multi_head_attention`` becomes the projections as
plain MatMul/Add on the initializers, ONE ``attn_export.FusedAttention`` node (the attention
core, docs/onnx_node.md) and the output projection; ``attn_export::attention`` becomes the node
between a head merge and a head split.

Why the projections sit outside the node: runtimes fuse and tune plain MatMul/Gemm on
initializers well (and can quantize them), and the TensorRT plugin then implements only the
attention core, the same kernels as the PyTorch operator.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from attn_export.onnx import node as onnx_node
from attn_export import spec as _spec
from attn_export.errors import ExportError
from attn_export.ops import signatures

def _ops():
    import onnxscript

    s = _spec.load()
    # The default-domain ops of the smallest opset the bodies are written for (the exported
    # model's own opset may be higher).
    return getattr(onnxscript, f"opset{s.min_onnx_opset}"), onnxscript.values.Opset(s.domain, s.domain_version)


def _const(op, values, dtype=np.int64):
    import onnx_ir as ir

    return op.Constant(value=ir.tensor(np.asarray(values, dtype=dtype)))


def _is_bool(value) -> bool:
    import onnx_ir as ir

    return value.dtype == ir.DataType.BOOL


def _additive_mask(op, mask):
    """bool (true = masked out) -> float32 -inf/0; floating -> float32."""
    import onnx_ir as ir

    if _is_bool(mask):
        return op.Where(mask, _const(op, -np.inf, np.float32), _const(op, 0.0, np.float32))
    if mask.dtype == ir.DataType.FLOAT:
        return mask
    return op.Cast(mask, to=ir.DataType.FLOAT)


def _static_dim(value, axis: int, what: str) -> int:
    dim = value.shape[axis] if value.shape is not None else None
    if not isinstance(dim, int):
        raise ExportError(f"{what} must be static for export; got {dim}")
    return dim


def _mask_inputs(op, key_padding_mask, attn_mask, num_heads: int):
    """The node's two mask inputs (rank 2 and rank 4, float32 additive) and their has_* flags."""
    if key_padding_mask is None:
        kpm = _const(op, np.zeros((1, 1), np.float32), np.float32)
    else:
        kpm = _additive_mask(op, key_padding_mask)
        if len(key_padding_mask.shape) == 1:  # unbatched [Lk]
            kpm = op.Unsqueeze(kpm, _const(op, [0]))
    if attn_mask is None:
        mask = _const(op, np.zeros((1, 1, 1, 1), np.float32), np.float32)
    else:
        mask = _additive_mask(op, attn_mask)
        rank = len(attn_mask.shape)
        if rank == 3 and attn_mask.shape[0] not in (1, num_heads):
            # nn.MultiheadAttention's [B*H, Lq, Lk] (the operator's reading of a 3-D mask whose
            # first dim is neither 1 nor the heads).
            tail = op.Shape(mask, start=1)
            mask = op.Reshape(mask, op.Concat(_const(op, [-1, num_heads]), tail, axis=0))
        elif rank < 4:  # broadcast from the last dim, as in F.scaled_dot_product_attention
            mask = op.Unsqueeze(mask, _const(op, list(range(4 - rank))))
        elif rank != 4:
            raise ExportError(f"attn_mask of rank {rank} is not supported; masks broadcast to [B, H, Lq, Lk]")
    return kpm, mask, key_padding_mask is not None, attn_mask is not None


def _fused_node(custom, q, k, v, kpm, mask, *, num_heads, scale, is_causal, has_kpm, has_mask, **attributes):
    attrs = onnx_node.node_attributes(num_heads, scale, is_causal, has_kpm, has_mask, **attributes)
    return getattr(custom, _spec.load().op_type)(q, k, v, kpm, mask, **attrs)


def _probabilities(op, q, k, kpm, mask, *, num_heads, scale, is_causal):
    """Attention probabilities [B, H, Lq, Lk] in standard ops (only for need_weights=True;
    removed again by the exporter's optimizer when the model does not use them)."""
    import onnx_ir as ir

    split = op.Concat(_const(op, [0, 0]), _const(op, [num_heads]), _const(op, [-1]), axis=0)
    qh = op.Transpose(op.Reshape(op.Cast(q, to=ir.DataType.FLOAT), split), perm=[0, 2, 1, 3])
    kh = op.Transpose(op.Reshape(op.Cast(k, to=ir.DataType.FLOAT), split), perm=[0, 2, 3, 1])
    s = op.Mul(op.MatMul(qh, kh), _const(op, scale, np.float32))
    s = op.Add(op.Add(s, op.Unsqueeze(kpm, _const(op, [1, 2]))), mask)
    if is_causal:
        lq = op.Shape(q, start=1, end=2)
        lk = op.Shape(k, start=1, end=2)
        ones = op.Expand(_const(op, 1.0, np.float32), op.Concat(lq, lk, axis=0))
        visible = op.Cast(op.Trilu(ones, upper=0), to=ir.DataType.BOOL)
        s = op.Where(visible, s, _const(op, -np.inf, np.float32))
    dead = op.IsInf(op.ReduceMax(s, _const(op, [-1]), keepdims=1), detect_positive=0)
    return op.Where(dead, _const(op, 0.0, np.float32), op.Softmax(s, axis=-1))


def _linear(op, x, weight, bias, rows: Optional[slice] = None):
    if rows is not None:
        start, stop = rows.start, rows.stop
        weight = op.Slice(weight, _const(op, [start]), _const(op, [stop]), _const(op, [0]))
        if bias is not None:
            bias = op.Slice(bias, _const(op, [start]), _const(op, [stop]), _const(op, [0]))
    y = op.MatMul(x, op.Transpose(weight, perm=[1, 0]))
    return y if bias is None else op.Add(y, bias)


def translate_multi_head_attention(
    query, key, value, num_heads: int, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
    attn_mask=None, key_padding_mask=None, need_weights: bool = True, average_attn_weights: bool = True,
    is_causal: bool = False, batch_first: bool = False,
):
    """``attn_export::multi_head_attention`` -> projections + one FusedAttention + output projection."""
    op, custom = _ops()
    rank = len(query.shape)
    unbatched = rank == 2
    same_qkv = query is key and key is value
    shared_kv = not same_qkv and key is value

    def to_batch_first(x):
        if unbatched:
            return op.Unsqueeze(x, _const(op, [0]))
        return x if batch_first else op.Transpose(x, perm=[1, 0, 2])

    def project(x, rows=None):
        # The input projection runs on the caller's layout and only its result is made
        # batch-first (MatMul acts on the last axis: the same math). Projecting first keeps a
        # sequence-first graph input from feeding Transpose -> MatMul directly: with fp16
        # weights that pattern segfaults ONNX Runtime 1.32 (CPU) at ORT_ENABLE_ALL while it
        # optimizes the graph (docs/onnx_node.md, "ONNX Runtime: Transpose -> MatMul on a graph
        # input"; tests/validation/test_runtime_isolation.py keeps the two-node reproduction).
        return to_batch_first(_linear(op, x, in_proj_weight, in_proj_bias, rows))

    embed_dim = _static_dim(in_proj_weight, 1, "embed_dim (in_proj_weight.shape[1])")
    scale = 1.0 / math.sqrt(embed_dim // num_heads)
    if same_qkv:
        q, k, v = op.Split(project(query), axis=-1, num_outputs=3)
    else:
        q = project(query, slice(0, embed_dim))
        if shared_kv:
            k, v = op.Split(project(key, slice(embed_dim, 3 * embed_dim)), axis=-1, num_outputs=2)
        else:
            k = project(key, slice(embed_dim, 2 * embed_dim))
            v = project(value, slice(2 * embed_dim, 3 * embed_dim))
    kpm, mask, has_kpm, has_mask = _mask_inputs(op, key_padding_mask, attn_mask, num_heads)
    attn = _fused_node(custom, q, k, v, kpm, mask, num_heads=num_heads, scale=scale, is_causal=is_causal,
                       has_kpm=has_kpm, has_mask=has_mask)
    out = _linear(op, attn, out_proj_weight, out_proj_bias)
    if unbatched:
        out = op.Squeeze(out, _const(op, [0]))
    elif not batch_first:
        out = op.Transpose(out, perm=[1, 0, 2])

    if need_weights:
        probs = _probabilities(op, q, k, kpm, mask, num_heads=num_heads, scale=scale, is_causal=is_causal)
        if average_attn_weights:
            probs = op.ReduceMean(probs, _const(op, [1]), keepdims=0)
        if unbatched:
            probs = op.Squeeze(probs, _const(op, [0]))
        weights = op.CastLike(probs, query)
    else:
        weights = op.CastLike(_const(op, np.zeros((0,), np.float32), np.float32), query)
    return out, weights


@signatures.follows_schema(_spec.load().torch_op_attention)
def translate_attention(query, key, value, attn_mask, key_padding_mask, is_causal, scale, **attributes):
    """``attn_export::attention`` (q ``[B, H, Lq, D]``, k/v ``[B, Hkv, Lk, D]``) -> one FusedAttention node
    between a head merge and a head split. Takes the operator's arguments as its schema orders
    them; each of its trailing attributes (softcap, ...) is the node attribute of the same name."""
    op, custom = _ops()
    heads = _static_dim(query, 1, "the number of heads (query.shape[1])")
    kv_heads = _static_dim(key, 1, "the number of key/value heads (key.shape[1])")
    head_dim = _static_dim(query, 3, "the head dimension (query.shape[3])")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    merge = _const(op, [0, 0, -1])

    def pack(x):  # [B, H, L, D] -> [B, L, H*D]
        return op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), merge)

    if attn_mask is not None and len(attn_mask.shape) == 4:
        kpm, _, has_kpm, _ = _mask_inputs(op, key_padding_mask, None, heads)
        mask, has_mask = _additive_mask(op, attn_mask), True
    else:
        kpm, mask, has_kpm, has_mask = _mask_inputs(op, key_padding_mask, attn_mask, heads)
    out = _fused_node(custom, pack(query), pack(key), pack(value), kpm, mask, num_heads=heads, scale=scale,
                      is_causal=is_causal, has_kpm=has_kpm, has_mask=has_mask, kv_num_heads=kv_heads, **attributes)
    split = _const(op, [0, 0, heads, -1])
    return op.Transpose(op.Reshape(out, split), perm=[0, 2, 1, 3])


def translation_table() -> dict:
    onnx_node.register_schema()
    ops = torch.ops.attn_export
    return {
        ops.multi_head_attention.default: translate_multi_head_attention,
        ops.attention.default: translate_attention,
    }
