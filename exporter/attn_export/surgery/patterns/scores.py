"""From the softmax's input back to the scores' product: the constant scale, the additive biases,
the masks (``masked_fill``/``where`` with ``-inf`` or a large negative), casts and views, each
term with the shape it was added in."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from attn_export.surgery.patterns.graph import (
    CASTS, Constants, NoMatch, Node, aten, cast_dtype, finite_nonzero, only_user, same, val,
)
from attn_export.surgery.patterns.products import SCORE_PRODUCTS

# A fill at or below this replaces a score by a value whose exp underflows to 0 in float32 next to
# any real score (exp(-1e4 + s) == 0 for s < ~9900): the same as an additive -inf except in a row
# whose keys are all masked.
LARGE_NEGATIVE = -1.0e4
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_IDENTITIES = (aten.clone.default, aten.contiguous.default, aten.alias.default)
_SCALES = (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar)
_MASK_FILLS = (aten.masked_fill.Scalar, aten.masked_fill.Tensor)
_WHERES = (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf)
# Ops that mix values across the head axis when they sit between the two products.
_MIXING = (aten.conv2d.default, aten.convolution.default, aten.conv1d.default, aten.einsum.default,
           aten.matmul.default, aten.bmm.default, aten.linear.default)


@dataclass
class Term:
    """A bias (floating, added) or a mask (boolean, ``True`` = masked out after ``invert``) and the
    view whose output shape it was added in (None: the product's own shape)."""

    node: Node
    site: Optional[Node] = None  # the add / masked_fill / where that applies it
    region: Optional[Node] = None
    negate: bool = False  # scores - bias
    invert: bool = False  # where(keep, scores, fill): the mask is ~keep


@dataclass
class Chain:
    product: Node
    scale: float = 1.0
    biases: List[Term] = field(default_factory=list)
    masks: List[Term] = field(default_factory=list)
    casts: List[torch.dtype] = field(default_factory=list)
    nodes: List[Node] = field(default_factory=list)  # outermost first, the product excluded
    shape_readers: List[Node] = field(default_factory=list)  # x.expand_as(scores) of a mask
    row_max: List[Node] = field(default_factory=list)  # scores.amax(-1, keepdim=True)[.detach()]


def _passes(node) -> bool:
    """Ops the scores flow through on their way to the softmax (for finding the product)."""
    return isinstance(node, Node) and (
        node.target in (aten.add.Tensor, aten.sub.Tensor) + _SCALES + _MASK_FILLS + _WHERES + VIEWS + _IDENTITIES
        + CASTS)


def products(node, depth: int = 40) -> List[Node]:
    """The scores' products upstream of ``node`` along ops the scores flow through, nearest first."""
    frontier, seen, found = [node], set(), []
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if not isinstance(n, Node) or n in seen:
                continue
            seen.add(n)
            if n.target in SCORE_PRODUCTS:
                found.append(n)
            elif _passes(n):
                nxt.extend(a for a in n.args[:3] if isinstance(a, Node))
        frontier = nxt
    return found


def reaches(node, target: Node, through_any: bool, limit: int = 400) -> bool:
    """Whether ``target`` is upstream of ``node`` (along score ops only, or along any op)."""
    stack, seen = [node], set()
    while stack and len(seen) < limit:
        n = stack.pop()
        if n is target:
            return True
        if not isinstance(n, Node) or n in seen:
            continue
        seen.add(n)
        if through_any or _passes(n):
            stack.extend(a for a in n.all_input_nodes)
    return False


def walk(softmax_input: Node, product: Node, constants: Constants) -> Chain:
    """The terms between ``product`` and the softmax, or NoMatch naming the idiom that stops it."""
    chain = Chain(product)
    node = softmax_input
    scaled_by = None  # a scale met on the way in is outside every term met after it
    while node is not product:
        if not isinstance(node, Node):
            raise NoMatch("the scores are not computed in the graph")
        only_user(node, chain.shape_readers, chain.row_max)
        chain.nodes.append(node)
        t = node.target
        if t in CASTS:
            chain.casts.append(cast_dtype(node))
            node = node.args[0]
        elif t in _IDENTITIES or (t in VIEWS):
            node = node.args[0]
        elif t in _SCALES:
            node, scaled_by = _scale(node, chain, constants), node
        elif t in (aten.add.Tensor, aten.sub.Tensor, *_MASK_FILLS, *_WHERES) and scaled_by is not None:
            raise NoMatch(f"{scaled_by.target} by a constant after a bias or mask was added (the operator scales "
                          "the scores before the masks)")
        elif t in (aten.add.Tensor, aten.sub.Tensor):
            node = _added(node, chain, product)
        elif t in _MASK_FILLS:
            _check_fill(node, constants.number(node.args[2]), "masked_fill")
            _check_mask(node.args[1], node)
            _same_shape(node, node.args[0])
            chain.masks.append(Term(node.args[1], node))
            node = node.args[0]
        elif t in _WHERES:
            node = _where(node, chain, product, constants)
        elif t in _MIXING:
            raise NoMatch(f"{t} of the scores between the scores and the softmax mixes them across heads "
                          "(talking-heads attention; the operator keeps heads apart)")
        else:
            raise NoMatch(f"{t} between the scores and the softmax")
    _assign_regions(chain)
    return chain


def _scale(node, chain: Chain, constants: Constants):
    a, b = node.args[:2]
    if node.target in (aten.mul.Tensor, aten.mul.Scalar) and constants.number(a) is not None:
        a, b = b, a
    c = constants.number(b)
    if c is None:
        raise NoMatch(f"{node.target} by a tensor that is not a constant between the scores and the softmax")
    if not finite_nonzero(c):
        raise NoMatch(f"{node.target} of the scores by {c} (a zero or infinite scale)")
    chain.scale *= c if node.target in (aten.mul.Tensor, aten.mul.Scalar) else 1.0 / c
    return a


def _added(node, chain: Chain, product: Node):
    """``scores + bias`` (either side) or ``scores - bias``: records the bias, returns the scores."""
    a, b = node.args[:2]
    if node.kwargs.get("alpha", 1) != 1 or len(node.args) > 2:
        raise NoMatch(f"{node.target} with alpha (a scaled bias)")
    on_a, on_b = reaches(a, product, False), reaches(b, product, False)
    if on_a and on_b:
        raise NoMatch(f"{node.target} of the scores and a term computed from them between the scores and the softmax")
    if node.target == aten.sub.Tensor and not on_a:
        raise NoMatch("aten.sub.Tensor of the scores from a tensor (the scores are negated)")
    scores, bias = (a, b) if on_a else (b, a)
    if node.target == aten.sub.Tensor and _row_max(bias, scores, chain):
        return scores  # softmax(s - max(s)) == softmax(s): the stabilizer written by hand
    if not isinstance(bias, Node):
        raise NoMatch(f"{node.target} of the number {bias} to the scores")
    if reaches(bias, product, True):
        mixing = _mixing_op(bias, product)
        if mixing is not None:
            raise NoMatch(f"{mixing} of the scores is added to them (talking-heads attention mixes the scores "
                          "across heads; the operator keeps heads apart)")
        raise NoMatch(f"{node.target} of a term computed from the scores themselves")
    bias_val = val(bias)
    if bias_val is None or not bias_val.dtype.is_floating_point:
        raise NoMatch(f"{node.target} of a {getattr(bias_val, 'dtype', 'non-tensor')} term to the scores "
                      "(a floating bias is added)")
    _same_shape(node, scores)
    chain.biases.append(Term(bias, node, negate=node.target == aten.sub.Tensor))
    return scores


def _row_max(term, scores, chain: Chain) -> bool:
    """``term`` is ``scores.amax(-1, keepdim=True)`` (or its ``.detach()``, or ``max(-1)[0]``
    kept): records its nodes as part of the match."""
    nodes = []
    if isinstance(term, Node) and term.target in (aten.detach.default, aten.alias.default):
        nodes.append(term)
        term = term.args[0]
    if not (isinstance(term, Node) and term.target == aten.amax.default and term.args[0] is scores):
        return False
    dims = list(term.args[1]) if len(term.args) > 1 else []
    keep = term.args[2] if len(term.args) > 2 else term.kwargs.get("keepdim", False)
    rank = val(scores).dim()
    if [d % rank for d in dims] != [rank - 1] or not keep:
        return False
    chain.row_max.append(term)
    chain.nodes.extend(nodes + [term])
    return True


def _mixing_op(bias, product):
    """The op of ``_MIXING`` on the path from ``product`` to ``bias``, if any."""
    stack, seen = [bias], set()
    while stack:
        n = stack.pop()
        if not isinstance(n, Node) or n in seen or n is product:
            continue
        seen.add(n)
        if n.target in _MIXING and any(reaches(a, product, True) for a in n.all_input_nodes):
            return n.target
        stack.extend(n.all_input_nodes)
    return None


def _where(node, chain: Chain, product: Node, constants: Constants):
    """``where(keep, scores, fill)`` or ``where(masked, fill, scores)``."""
    cond, a, b = node.args[:3]
    on_a = reaches(a, product, False) if isinstance(a, Node) else False
    scores, fill = (a, b) if on_a else (b, a)
    if not isinstance(scores, Node) or not reaches(scores, product, False):
        raise NoMatch("aten.where between the scores and the softmax whose branches are not the scores and a fill")
    _check_fill(node, constants.number(fill), "where")
    _check_mask(cond, node)
    _same_shape(node, scores)
    chain.masks.append(Term(cond, node, invert=on_a))
    return scores


def _check_fill(node, value, what: str) -> None:
    if value is None:
        raise NoMatch(f"{what} of the scores with a value that is not a constant")
    if not (value == -math.inf or value <= LARGE_NEGATIVE):
        raise NoMatch(f"{what} of the scores with {value} (only -inf or a fill at most {LARGE_NEGATIVE:g} masks: "
                      "another value replaces the scores)")


def _check_mask(mask, node) -> None:
    if val(mask) is None or val(mask).dtype != torch.bool:
        raise NoMatch(f"{node.target} with a mask that is not boolean")


def _same_shape(node, scores) -> None:
    """A term may not broadcast the scores to a larger shape."""
    out, inner = val(node), val(scores)
    if out.dim() != inner.dim() or not all(same(x, y) for x, y in zip(out.shape, inner.shape)):
        raise NoMatch(f"{node.target} broadcasts the scores {list(inner.shape)} to {list(out.shape)}")


def _assign_regions(chain: Chain) -> None:
    """Each term lives in the shape of the nearest view inside it (towards the product)."""
    position = {n: i for i, n in enumerate(chain.nodes)}
    for t in chain.biases + chain.masks:
        inner_views = [n for n in chain.nodes[position[t.site] + 1:] if n.target in VIEWS]
        t.region = inner_views[0] if inner_views else None


def region_sizes(view: Node, term: Node) -> list:
    """The sizes ``view`` produced, for expanding a term added in its shape; an inferred (-1) size
    must be static or the term's own size there."""
    out = val(view).shape
    sizes = list(view.args[1])
    rank = len(sizes)
    term_shape = [1] * (rank - val(term).dim()) + list(val(term).shape)
    for i, s in enumerate(sizes):
        if isinstance(s, int) and s == -1:
            if isinstance(out[i], int):
                sizes[i] = out[i]
            elif not same(term_shape[i], out[i]):
                raise NoMatch(f"{view.target} with an inferred symbolic size before a term added through it")
    return sizes
