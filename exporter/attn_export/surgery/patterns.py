"""Hand-written attention in a captured graph: ``softmax(q @ k^T * scale [+ bias]
[masked_fill(mask, -inf)]) @ v`` rewritten to ``attn_export::attention`` in a
``torch.export`` program, before it is translated to ONNX.

A match is rewritten only when it is exactly the operator's computation:

* the scores are ``aten.matmul(q, transpose(k, -2, -1))`` of 4-D ``[B, H, Lq, D]`` /
  ``[B, H, Lk, D]`` tensors with the same batch and head sizes (no broadcasting), one floating
  dtype the operator takes (float32, float16, bfloat16);
* the scale is a constant multiply or divide, on the scores (either side) before any bias, or on
  ``q`` before the product; none means 1;
* additive biases (``add``, either side; their sum is the operator's mask) and at most one
  ``masked_fill(mask, -inf)`` with a boolean mask, broadcastable to ``[B, H, Lq, Lk]``; also a bias
  added through a view that splits the batch axis into ``[B / W, W, H, Lq, Lk]`` and back
  (torchvision's shifted-window mask), which becomes that bias expanded and reshaped to 4-D;
* ``softmax`` along the last axis without a dtype argument, then ``matmul(p, v)`` with
  ``v`` ``[B, H, Lk, Dv]``;
* every intermediate tensor has no other user (attention weights that are also returned or
  reused keep the graph as it is).

Anything else is left alone; each softmax that looks like attention but is not rewritten is
reported with the reason. A query whose keys are all masked gets zeros from the operator where
the written-out graph gives NaN.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import List, Optional

import torch

from attn_export.surgery.sdpa_route import known_equal as _same

aten = torch.ops.aten
_SOFTMAX = (aten.softmax.int, aten._softmax.default)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


@dataclass
class PatternSite:
    path: str  # the module whose forward holds the pattern (from the node's nn_module_stack)
    cls: str
    rewritten: bool
    reason: Optional[str] = None


class _NoMatch(Exception):
    pass


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _scalar(x) -> Optional[float]:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    return None


def _single_user(node) -> None:
    if len(node.users) != 1:
        raise _NoMatch(f"{node.name} has {len(node.users)} users (the attention weights are used elsewhere)")


def _site(node):
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    if path.startswith("L['self']."):
        path = path[len("L['self']."):]
    cls = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
    return path, cls


def _is_last_two_transpose(node, rank: int) -> bool:
    if node.target == aten.transpose.int:
        dims = sorted(d % rank for d in node.args[1:3])
        return dims == [rank - 2, rank - 1]
    if node.target == aten.permute.default:
        perm = [d % rank for d in node.args[1]]
        return perm == list(range(rank - 2)) + [rank - 1, rank - 2]
    return False


def _broadcastable(mask_val, shape) -> bool:
    if mask_val is None or mask_val.dim() > len(shape):
        return False
    for m, s in zip(reversed(mask_val.shape), reversed(shape)):
        if not (_same(m, 1) or _same(m, s)):
            return False
    return True


def _match(softmax):
    """(q, k, v, scale, bias, mask, nodes to erase, the output matmul) or raises _NoMatch."""
    rank_val = _val(softmax)
    if rank_val is None:
        raise _NoMatch("no shape information")
    rank = rank_val.dim()
    probs, out, erase = _softmax_and_output(softmax, rank)
    v = out.args[1]
    node, scale, biases, mask = _walk_scores(softmax.args[0], erase)
    scores = node
    erase.append(scores)
    q, k, scale = _query_and_key(scores, rank, scale, erase)
    full = _check_operands(q, k, v, rank, biases, mask)
    return q, k, v, 1.0 if scale is None else scale, biases, mask, erase, out, full


def _softmax_and_output(softmax, rank):
    """The softmax over the last axis and the matmul(p, v) it feeds (through an eval-mode
    dropout or a clone): (probabilities, the matmul, the nodes to erase so far)."""
    dim = softmax.args[1]
    if dim % rank != rank - 1:
        raise _NoMatch(f"softmax along axis {dim}, not the last")
    if softmax.target == aten.softmax.int and (len(softmax.args) > 2 and softmax.args[2] is not None
                                              or softmax.kwargs.get("dtype") is not None):
        raise _NoMatch("softmax with a dtype argument")
    if softmax.target == aten._softmax.default and softmax.args[2]:
        raise _NoMatch("softmax with half_to_float")
    _single_user(softmax)
    (out,) = softmax.users
    erase = []
    if out.target in (aten.dropout.default, aten.clone.default) and len(out.users) == 1:
        if out.target == aten.dropout.default and out.args[2]:
            raise _NoMatch("attention dropout in training mode")
        erase.append(out)  # dropout in eval mode is the identity
        probs, (out,) = out, out.users
    else:
        probs = softmax
    if out.target != aten.matmul.default or out.args[0] is not probs:
        raise _NoMatch("the probabilities are not multiplied by the values (matmul(p, v)) directly")
    return probs, out, [out] + erase + [softmax]


def _walk_scores(node, erase):
    """From the softmax's input back to the q k^T matmul, through one -inf masked_fill, added
    biases, batch-splitting views and one scaling: (the matmul, scale or None, biases, mask)."""
    biases = []  # nodes, or ("split", bias5, windows) for a bias added through a batch-splitting view
    mask = None
    scale = None
    while True:
        if not isinstance(node, torch.fx.Node):
            raise _NoMatch("scores are not computed in the graph")
        _single_user(node)
        if node.target == aten.masked_fill.Scalar and mask is None and scale is None:
            value = _scalar(node.args[2])
            if value is None or value != -math.inf:
                raise _NoMatch(f"masked_fill with {node.args[2]} (only -inf is exact)")
            if _val(node.args[1]) is None or _val(node.args[1]).dtype != torch.bool:
                raise _NoMatch("masked_fill with a non-boolean mask")
            mask = node.args[1]
        elif node.target in _VIEWS and scale is None:
            node = _split_bias(node, biases, erase)
            continue
        elif node.target == aten.add.Tensor and scale is None and len(node.args) == 2 \
                and not node.kwargs.get("alpha", 1) != 1:
            node = _added_bias(node, biases, erase)
            continue
        elif node.target in (aten.mul.Tensor, aten.div.Tensor) and scale is None:
            a, b = node.args
            if node.target == aten.mul.Tensor and _scalar(a) is not None:
                a, b = b, a
            c = _scalar(b)
            if c is None or c == 0 or not math.isfinite(c):
                raise _NoMatch("the scores are scaled by a tensor or a zero or infinite constant")
            scale = c if node.target == aten.mul.Tensor else 1.0 / c
            erase.append(node)
            node = a
            continue
        elif node.target == aten.matmul.default:
            return node, scale, biases, mask
        else:
            raise _NoMatch(f"{node.target} between the scores and the softmax")
        erase.append(node)
        node = node.args[0]


def _added_bias(node, biases, erase):
    """``scores + bias``: records the bias and returns the scores' side."""
    a, b = node.args
    score_side = a if _is_scores(a) else b if _is_scores(b) else None
    if score_side is None or (_is_scores(a) and _is_scores(b)):
        raise _NoMatch("an addition whose operands are not the scores and a bias")
    bias = b if score_side is a else a
    if not isinstance(bias, torch.fx.Node) or not _val(bias).dtype.is_floating_point:
        raise _NoMatch("a non-tensor or non-floating bias")
    biases.append(bias)
    erase.append(node)
    return score_side


def _query_and_key(scores, rank, scale, erase):
    """q and k of ``q @ k.transpose(-2, -1)``, with a constant scaling of q folded into the scale."""
    q, kt = scores.args
    if not isinstance(kt, torch.fx.Node) or not _is_last_two_transpose(kt, rank):
        raise _NoMatch("the scores are not q @ k.transpose(-2, -1)")
    _single_user(kt)
    erase.append(kt)
    k = kt.args[0]
    if isinstance(q, torch.fx.Node) and q.target == aten.mul.Tensor and len(q.users) == 1:
        a, b = q.args
        if _scalar(a) is not None:
            a, b = b, a
        if _scalar(b) is not None and isinstance(a, torch.fx.Node):
            if scale is not None:
                raise _NoMatch("scaled twice")
            scale = _scalar(b)
            erase.append(q)
            q = a
    return q, k, scale


def _check_operands(q, k, v, rank, biases, mask):
    """What the operator takes: 4-D q, k, v of one floating dtype and matching batch, heads,
    head dims and key lengths; biases and mask broadcastable. Returns [B, H, Lq, Lk]."""
    vals = [_val(t) for t in (q, k, v)]
    if any(t is None for t in vals):
        raise _NoMatch("no shape information for q, k or v")
    qv, kv, vv = vals
    if rank != 4 or any(t.dim() != 4 for t in vals):
        raise _NoMatch(f"rank {rank} (4-D [batch, heads, seq, dim] is rewritten)")
    if qv.dtype not in _DTYPES or kv.dtype != qv.dtype or vv.dtype != qv.dtype:
        raise _NoMatch(f"dtype {qv.dtype} (the operator takes float32, float16, bfloat16)")
    if not all(_same(qv.shape[i], t.shape[i]) for t in (kv, vv) for i in (0, 1)):
        raise _NoMatch("q, k and v differ in batch or heads (broadcast)")
    if not (_same(qv.shape[3], kv.shape[3]) and _same(kv.shape[2], vv.shape[2])):
        raise _NoMatch("q/k head dims or k/v lengths differ")
    full = (qv.shape[0], qv.shape[1], qv.shape[2], kv.shape[2])
    for extra, what in [(b, "bias") for b in biases if not isinstance(b, tuple)] + [(mask, "mask")]:
        if extra is not None and not _broadcastable(_val(extra), full):
            raise _NoMatch(f"the {what} does not broadcast to [B, H, Lq, Lk]")
    return full


def _split_bias(view4, biases, erase):
    """``view(add(view(S, [B/W, W, H, Lq, Lk]), bias5), S.shape)``: records bias5 and returns S."""
    inner = view4.args[0]
    if not (isinstance(inner, torch.fx.Node) and inner.target == aten.add.Tensor and len(inner.users) == 1):
        raise _NoMatch(f"{view4.target} between the scores and the softmax")
    a, b = inner.args
    split = a if _is_split_scores(a) else b if _is_split_scores(b) else None
    if split is None or len(split.users) != 1:
        raise _NoMatch(f"{view4.target} between the scores and the softmax")
    bias5 = b if split is a else a
    scores = split.args[0]
    s4, s5, out4 = _val(scores), _val(split), _val(view4)
    windows = s5.shape[1]
    ok = (
        s4.dim() == 4 and s5.dim() == 5 and out4.dim() == 4 and isinstance(windows, int)
        and all(_same(x, y) for x, y in zip(out4.shape, s4.shape))
        and all(_same(x, y) for x, y in zip(s5.shape[2:], s4.shape[1:]))
        and _same(s5.shape[0] * windows, s4.shape[0])
        and isinstance(bias5, torch.fx.Node) and _val(bias5).dtype.is_floating_point
        and _broadcastable(_val(bias5), s5.shape)
    )
    if not ok:
        raise _NoMatch("a view of the scores that is not a batch split [B/W, W, H, Lq, Lk] with an added bias")
    biases.append(("split", bias5, windows))
    erase.extend([view4, inner, split])
    return scores


def _is_split_scores(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.target in _VIEWS and _is_scores(node.args[0])


def _is_scores(node) -> bool:
    """Whether ``node`` is ``q @ k^T``, possibly scaled or masked: the score side of an addition."""
    while isinstance(node, torch.fx.Node) and node.target in (aten.mul.Tensor, aten.div.Tensor,
                                                              aten.masked_fill.Scalar, aten.add.Tensor):
        if node.target == aten.add.Tensor:
            a, b = node.args
            node = a if _is_scores(a) else b
            continue
        node = node.args[0] if isinstance(node.args[0], torch.fx.Node) else node.args[1]
    if not (isinstance(node, torch.fx.Node) and node.target == aten.matmul.default):
        return False
    kt, val = node.args[1], _val(node)
    return isinstance(kt, torch.fx.Node) and val is not None and _is_last_two_transpose(kt, val.dim())


def _call(graph, fake_mode, target, *args):
    node = graph.call_function(target, args)
    with fake_mode:
        node.meta["val"] = target(*torch.fx.node.map_arg(args, lambda n: n.meta["val"]))
    return node


def _size(graph, node, axis):
    size = _val(node).shape[axis]
    if isinstance(size, int):
        return size
    sym = graph.call_function(aten.sym_size.int, (node, axis))
    sym.meta["val"] = size
    return sym


def _unsplit(graph, fake_mode, bias5, windows, q, k):
    """bias5 (broadcastable to [B/W, W, H, Lq, Lk]) -> the same bias on the 4-D scores [B, H|1, Lq, Lk]."""
    val = _val(bias5)
    while val.dim() < 5:
        bias5 = _call(graph, fake_mode, aten.unsqueeze.default, bias5, 0)
        val = _val(bias5)
    batch = _size(graph, q, 0)
    if isinstance(batch, int):
        groups = batch // windows
    else:
        groups = graph.call_function(operator.floordiv, (batch, windows))
        groups.meta["val"] = _val(batch) // windows
    lq, lk = _size(graph, q, 2), _size(graph, k, 2)
    heads = val.shape[2]
    expanded = _call(graph, fake_mode, aten.expand.default, bias5, [groups, windows, heads, lq, lk])
    return _call(graph, fake_mode, aten.reshape.default, expanded, [batch, heads, lq, lk])


def rewrite(exported) -> List[PatternSite]:
    """Rewrites every exact match in ``exported`` (a ``torch.export.ExportedProgram``, changed in
    place). Returns one :class:`PatternSite` per softmax that is followed by ``matmul(p, v)``."""
    from torch._guards import detect_fake_mode

    graph = exported.graph_module.graph
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if "val" in n.meta])
    sites: List[PatternSite] = []
    for softmax in [n for n in graph.nodes if n.op == "call_function" and n.target in _SOFTMAX]:
        users = list(softmax.users)
        users += [w for u in users if u.target in (aten.dropout.default, aten.clone.default) for w in u.users]
        if not any(u.target == aten.matmul.default for u in users):
            continue  # a softmax that is no attention
        path, cls = _site(softmax)
        try:
            q, k, v, scale, biases, mask, erase, out, full = _match(softmax)
        except _NoMatch as exc:
            sites.append(PatternSite(path, cls, False, str(exc)))
            continue
        with graph.inserting_before(out):
            attn_mask = None
            bias = None
            for term in biases:
                if isinstance(term, tuple):
                    term = _unsplit(graph, fake_mode, term[1], term[2], q, k)
                bias = term if bias is None else _call(graph, fake_mode, aten.add.Tensor, bias, term)
            if bias is not None and mask is not None:
                attn_mask = _call(graph, fake_mode, aten.where.ScalarSelf, mask, -math.inf, bias)
            elif bias is not None or mask is not None:
                attn_mask = bias if bias is not None else mask
            if attn_mask is not None:
                val = _val(attn_mask)
                shape = list(val.shape)
                while len(shape) < 4:
                    attn_mask = _call(graph, fake_mode, aten.unsqueeze.default, attn_mask, 0)
                    shape.insert(0, 1)
                if not (_same(shape[2], full[2]) and _same(shape[3], full[3])):
                    attn_mask = _call(graph, fake_mode, aten.expand.default, attn_mask,
                                      [shape[0], shape[1], full[2], full[3]])
                if _val(attn_mask).dtype.is_floating_point:
                    # a bias computed from parameters: the exported graph has no backward, and the
                    # operator takes masks as constants
                    attn_mask = _call(graph, fake_mode, aten.detach.default, attn_mask)
            fused = _call(graph, fake_mode, torch.ops.attn_export.attention.default, q, k, v, attn_mask, None,
                          False, scale)
        out.replace_all_uses_with(fused)
        for node in erase:
            if not node.users:
                graph.erase_node(node)
        sites.append(PatternSite(path, cls, True))
    if any(site.rewritten for site in sites):
        graph.lint()
        exported.graph_module.recompile()
    return sites
