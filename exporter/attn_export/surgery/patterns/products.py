"""The two products of attention: the scores ``q k^T`` (``matmul``, ``bmm``, ``baddbmm``,
``einsum``) and the output ``p v`` (``matmul``, ``bmm``, ``einsum``), read as operands in the
operator's layout ``[*batch, L, D]`` and the steps that bring them there."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple


from attn_export.surgery.patterns.graph import Constants, NoMatch, Node, aten, cast_dtype, finite_nonzero, val

SCORE_PRODUCTS = (aten.matmul.default, aten.bmm.default, aten.baddbmm.default, aten.einsum.default)
VALUE_PRODUCTS = (aten.matmul.default, aten.bmm.default, aten.einsum.default)
_SCALES = (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar)


@dataclass
class Operand:
    """A graph tensor and how it becomes ``[*batch, L, D]``: ``perm`` first, then new axes at
    ``unsqueeze`` (batch axes it broadcasts over); axes of size 1 are then expanded to the
    query's batch."""

    node: Node
    perm: Optional[List[int]] = None
    unsqueeze: List[int] = field(default_factory=list)


@dataclass
class Scores:
    q: Operand
    k: Operand
    scale: float  # constant factors on q, k and the product (baddbmm's alpha)
    bias: Optional[Node] = None  # baddbmm's input (beta = 1), added after the scale
    steps: List[Node] = field(default_factory=list)  # nodes between the operands and the product


def scaled(node, constants: Constants, steps: List[Node]) -> Tuple[Node, float]:
    """Strips constant multiplications and divisions, and casts to the dtype a tensor already has,
    from ``node``: (the tensor inside, the product of the factors)."""
    factor = 1.0
    while isinstance(node, Node):
        if node.target in _SCALES:
            a, b = node.args[:2]
            if node.target in (aten.mul.Tensor, aten.mul.Scalar) and constants.number(a) is not None:
                a, b = b, a
            c = constants.number(b)
            if not isinstance(a, Node) or c is None:
                return node, factor
            if not finite_nonzero(c):
                raise NoMatch(f"{node.target} by {c} (a zero or infinite scale)")
            factor *= c if node.target in (aten.mul.Tensor, aten.mul.Scalar) else 1.0 / c
            inner = a
        elif cast_dtype(node) is not None and cast_dtype(node) == val(node.args[0]).dtype:
            inner = node.args[0]  # v.to(p.dtype) where v already has that dtype
        else:
            return node, factor
        steps.append(node)
        node = inner
    return node, factor


def _transposed(kt, constants: Constants, steps: List[Node]) -> Tuple[Operand, float]:
    """``k`` of ``q @ X``: ``X^T``, read through a ``transpose``/``mT``/``permute`` of the keys
    when ``X`` is one (with constant scalings on either side of it)."""
    kt, factor = scaled(kt, constants, steps)
    if not isinstance(kt, Node) or val(kt) is None:
        raise NoMatch("the second operand of the scores' product is not a tensor of the graph")
    rank = val(kt).dim()
    if kt.target == aten.transpose.int:
        order = list(range(rank))
        a, b = (d % rank for d in kt.args[1:3])
        order[a], order[b] = order[b], order[a]
    elif kt.target == aten.mT.default:
        order = list(range(rank - 2)) + [rank - 1, rank - 2]
    elif kt.target == aten.permute.default:
        order = [d % rank for d in kt.args[1]]
    else:  # q @ X for any X: the keys are X^T
        return Operand(kt, list(range(rank - 2)) + [rank - 1, rank - 2]), factor
    steps.append(kt)
    k, inner = scaled(kt.args[0], constants, steps)
    return Operand(k, _identity_none(order[:-2] + [order[-1], order[-2]])), factor * inner


def _broadcast(k: Operand, rank: int) -> Operand:
    """matmul's broadcasting: a key of lower rank gains leading axes."""
    missing = rank - val(k.node).dim()
    k.unsqueeze = list(range(missing))
    return k


def score_product(node, constants: Constants) -> Scores:
    """The operands of the scores ``node`` (a product of :data:`SCORE_PRODUCTS`)."""
    steps: List[Node] = []
    if node.target == aten.einsum.default:
        return _score_einsum(node, constants, steps)
    if node.target == aten.baddbmm.default:
        bias, a, b = node.args[:3]
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        if len(node.args) > 3:
            beta = node.args[3]
        if len(node.args) > 4:
            alpha = node.args[4]
        if beta not in (0, 1):
            raise NoMatch(f"baddbmm with beta={beta} (its input is added as it is, or ignored with beta=0)")
    else:
        a, b = node.args[:2]
        bias, beta, alpha = None, 0, 1
    q, q_factor = scaled(a, constants, steps)
    k, k_factor = _transposed(b, constants, steps)
    rank = val(node).dim()
    if val(q).dim() != rank:
        raise NoMatch(f"the query is {val(q).dim()}-D and the scores {rank}-D (the query broadcasts)")
    return Scores(Operand(q), _broadcast(k, rank), q_factor * k_factor * float(alpha),
                  bias if beta == 1 else None, steps)


def _subscripts(equation: str, operands: int) -> Tuple[List[str], str]:
    eq = equation.replace(" ", "")
    if "..." in eq or "->" not in eq:
        raise NoMatch(f"einsum {equation!r} (an explicit output without '...' is read)")
    inputs, out = eq.split("->")
    parts = inputs.split(",")
    if len(parts) != operands or any(len(set(p)) != len(p) for p in parts + [out]):
        raise NoMatch(f"einsum {equation!r} (two operands, no repeated index)")
    return parts, out


def _score_einsum(node, constants: Constants, steps: List[Node]) -> Scores:
    """``einsum('b h i d, b h j d -> b h i j', q, k)`` and its spellings (any axis order of q
    and k; keys without the head axis broadcast)."""
    equation, (a, b) = node.args[0], node.args[1]
    (qs, ks), out = _subscripts(equation, 2)
    contracted = [c for c in qs if c in ks and c not in out]
    if len(contracted) != 1 or len(out) < 3 or out[-2] not in qs or out[-2] in ks or out[-1] not in ks \
            or out[-1] in qs:
        raise NoMatch(f"einsum {equation!r} is not q k^T over one feature axis with the key axis last")
    batch, d = out[:-2], contracted[0]
    if set(qs) != set(batch) | {out[-2], d} or not set(ks) <= set(batch) | {out[-1], d}:
        raise NoMatch(f"einsum {equation!r} sums over more than the feature axis")
    q, q_factor = scaled(a, constants, steps)
    k, k_factor = scaled(b, constants, steps)
    q_order = [qs.index(c) for c in batch + out[-2] + d]
    k_letters = [c for c in batch if c in ks] + [out[-1], d]
    k_order = [ks.index(c) for c in k_letters]
    missing = [i for i, c in enumerate(batch) if c not in ks]
    return Scores(Operand(q, _identity_none(q_order)),
                  Operand(k, _identity_none(k_order), missing), q_factor * k_factor, None, steps)


def _identity_none(order: List[int]) -> Optional[List[int]]:
    return None if order == list(range(len(order))) else order


@dataclass
class Values:
    v: Operand
    out_perm: Optional[List[int]]  # the axes order of the output (einsum), from [*batch, Lq, Dv]
    steps: List[Node]


def value_product(out, probs, constants: Constants) -> Values:
    """The values of ``out = probs @ v`` (matmul, bmm or einsum)."""
    steps: List[Node] = []
    if out.target == aten.einsum.default:
        equation, (a, b) = out.args[0], out.args[1]
        if a is not probs:
            raise NoMatch("the probabilities are the second operand of the einsum with the values")
        (ps, vs), res = _subscripts(equation, 2)
        batch, i, j = ps[:-2], ps[-2], ps[-1]
        extra = [c for c in vs if c not in ps]
        if len(extra) != 1 or j not in vs or j in res or not set(vs) <= set(batch) | {j} | set(extra) \
                or sorted(res) != sorted(batch + i + extra[0]):
            raise NoMatch(f"einsum {equation!r} is not p @ v over the key axis")
        v = _values_tensor(b, constants, steps)
        letters = [c for c in batch if c in vs] + [j, extra[0]]
        canonical = batch + i + extra[0]
        return Values(Operand(v, _identity_none([vs.index(c) for c in letters]),
                              [n for n, c in enumerate(batch) if c not in vs]),
                      _identity_none([canonical.index(c) for c in res]), steps)
    a, b = out.args[:2]
    if a is not probs:
        raise NoMatch("the probabilities are the second operand of the product with the values")
    v = _values_tensor(b, constants, steps)
    return Values(_broadcast(Operand(v), val(out).dim()), None, steps)


def _values_tensor(node, constants: Constants, steps: List[Node]) -> Node:
    """The values as the operator takes them: no-op casts dropped; a scaled ``v`` stays the
    tensor it is (``p @ (c v)`` is attention over those values)."""
    inner: List[Node] = []
    v, factor = scaled(node, constants, inner)
    if factor != 1.0:
        return node
    steps.extend(inner)
    return v
