"""The rewrite of one matched site: q, k, v brought to ``[B, H, L, D]``, the terms made one mask,
one ``attn_export::attention`` call, its result brought back to the layout ``p @ v`` had."""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from attn_export.surgery.patterns.graph import Builder, Node, aten, checks, same, users, val
from attn_export.surgery.patterns.match import Match
from attn_export.surgery.patterns.products import Operand


def _operand(b: Builder, op: Operand, batch_like: Optional[Node]) -> Node:
    """``op`` as ``[*batch, L, D]``; batch axes of size 1 expanded to ``batch_like``'s."""
    node = op.node
    if op.perm is not None:
        node = b.call(aten.permute.default, node, op.perm)
    for axis in op.unsqueeze:
        node = b.call(aten.unsqueeze.default, node, axis)
    if batch_like is not None:
        have, want = val(node).shape[:-2], val(batch_like).shape[:-2]
        if not all(same(x, y) for x, y in zip(have, want)):
            sizes = [b.size(batch_like, i) for i in range(len(want))] + [-1, -1]
            node = b.call(aten.expand.default, node, sizes)
    return node


def _term(b: Builder, m: Match, term, target_sizes: list) -> Node:
    node = term.node
    if term.negate:
        node = b.call(aten.neg.default, node)
    if term.invert:
        node = b.call(aten.logical_not.default, node)
    if term.region is not None:
        sizes = m.regions[id(term)]
        while val(node).dim() < len(sizes):
            node = b.call(aten.unsqueeze.default, node, 0)
        node = b.call(aten.expand.default, node, sizes)
        node = b.call(aten.reshape.default, node, target_sizes)
    return node


def _mask(b: Builder, m: Match, q: Node, k: Node) -> Optional[Node]:
    """The biases summed and the masks or-ed, as the operator's 4-D ``attn_mask``."""
    rank = len(m.batch) + 2
    target = [b.size(q, i) for i in range(rank - 2)] + [b.size(q, -2), b.size(k, -2)]
    bias = None
    for term in m.chain.biases + ([m.scores.bias] if m.scores.bias is not None else []):
        t = _term(b, m, term, target) if not isinstance(term, Node) else term
        bias = t if bias is None else b.call(aten.add.Tensor, bias, t)
    mask = None
    for term in m.chain.masks:
        t = _term(b, m, term, target)
        mask = t if mask is None else b.call(aten.logical_or.default, mask, t)
    if bias is not None and mask is not None:
        out = b.call(aten.where.ScalarSelf, mask, -math.inf, bias)
    else:
        out = bias if bias is not None else mask
    if out is None:
        return None
    while val(out).dim() < rank:
        out = b.call(aten.unsqueeze.default, out, 0)
    if rank == 3:
        out = b.call(aten.unsqueeze.default, out, 1)
    shape = list(val(out).shape)
    lq, lk = val(q).shape[-2], val(k).shape[-2]
    if not (same(shape[2], lq) and same(shape[3], lk)):
        out = b.call(aten.expand.default, out, [shape[0], shape[1], b.size(q, -2), b.size(k, -2)])
    if val(out).dtype.is_floating_point:
        # a bias computed from parameters: the operator takes masks as constants
        out = b.call(aten.detach.default, out)
    return out


def emit(graph, fake_mode, m: Match) -> Node:
    """Adds the fused call before ``m.out`` and returns the node that replaces it."""
    b = Builder(graph, fake_mode, m.out)
    q = _operand(b, m.scores.q, None)
    k = _operand(b, m.scores.k, q)
    v_batch = _operand(b, m.values.v, None)
    viewed = not all(same(x, y) for x, y in zip(m.probs_batch, m.batch)) or len(m.probs_batch) != len(m.batch)
    if viewed:  # the probabilities were viewed to another batch: the values follow them back
        batch = [b.size(q, i) for i in range(len(m.batch))]
        v = b.call(aten.reshape.default, v_batch, batch + [-1, b.size(v_batch, -1)])
    else:
        v = _expand_like(b, v_batch, q)
    _reshape_readers(b, m, q, k)
    mask = _mask(b, m, q, k)
    if len(m.batch) == 1:
        q, k, v = (b.call(aten.unsqueeze.default, t, 1) for t in (q, k, v))
    out = b.call(torch.ops.attn_export.attention.default, q, k, v, mask, None, False, m.scale)
    if len(m.batch) == 1:
        out = b.call(aten.squeeze.dim, out, 1)
    if viewed:
        out = b.call(aten.reshape.default, out,
                     [b.size(v_batch, i) for i in range(len(m.probs_batch))] + [b.size(q, -2), -1])
    if m.values.out_perm is not None:
        out = b.call(aten.permute.default, out, m.values.out_perm)
    return out


def _reshape_readers(b: Builder, m: Match, q: Node, k: Node) -> None:
    """``x.expand_as(scores)`` (a mask given the scores' shape) becomes an expand to the sizes of
    the scores as q and k give them, since the scores themselves go away."""
    rank = len(m.batch) + 2
    sizes = [b.size(q, i) for i in range(rank - 2)] + [b.size(q, -2), b.size(k, -2)]
    for reader in m.chain.shape_readers:
        new = b.call(aten.expand.default, reader.args[0], sizes)
        reader.replace_all_uses_with(new)
        for term in m.chain.biases + m.chain.masks:
            if term.node is reader:
                term.node = new
        m.erase.append(reader)


def _expand_like(b: Builder, node: Node, like: Node) -> Node:
    have, want = val(node).shape[:-2], val(like).shape[:-2]
    if all(same(x, y) for x, y in zip(have, want)):
        return node
    return b.call(aten.expand.default, node, [b.size(like, i) for i in range(len(want))] + [-1, -1])


def erase(graph, nodes: List[Node]) -> None:
    """Removes the replaced nodes that nothing reads any more (their metadata checks with them)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(nodes), key=lambda n: -order.get(n, -1)):
        if users(node):
            continue
        for check in checks(node):
            graph.erase_node(check)
        if not node.users:
            graph.erase_node(node)
