"""One attention site, from its softmax: the softmax and what follows it up to ``p @ v``, the
scores' chain and both products, checked against what the operator computes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from attn_export.surgery.patterns.graph import (
    CASTS, Constants, NoMatch, Node, aten, cast_dtype, only_user, same, users, val,
)
from attn_export.surgery.patterns.products import (
    VALUE_PRODUCTS, Operand, Scores, Values, score_product, value_product,
)
from attn_export.surgery.patterns.scores import (
    _MIXING, _SCALES, VIEWS, Chain, _passes, products, region_sizes, walk,
)

SOFTMAXES = (aten.softmax.int, aten._softmax.default, aten._safe_softmax.default)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PASS_THROUGH = (aten.clone.default, aten.contiguous.default, aten.alias.default) + CASTS + VIEWS


@dataclass
class Match:
    scores: Scores
    chain: Chain
    values: Values
    out: Node
    scale: float
    batch: List  # the scores' batch sizes (fake values): [N] or [B, H]
    probs_batch: List  # the batch of the probabilities at the values' product
    regions: Dict[int, list] = field(default_factory=dict)  # id(term) -> the sizes it is expanded to
    erase: List[Node] = field(default_factory=list)


def is_site(softmax: Node, depth: int = 6) -> bool:
    """A softmax whose result reaches the first operand of a product within a few ops that keep
    it probabilities (copies, casts, views, dropout, a mixing across heads)."""
    frontier = [softmax]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in users(n):
                if u.target in VALUE_PRODUCTS and (u.args[0] is n or (u.target == aten.einsum.default
                                                                        and u.args[1][0] is n)):
                    return True
                if u.target in _PASS_THROUGH + _MIXING + (aten.dropout.default, aten.mul.Tensor):
                    nxt.append(u)
        frontier = nxt
    return False


def _softmax_dtype(softmax: Node) -> Optional[torch.dtype]:
    if softmax.target == aten._softmax.default:
        return torch.float32 if softmax.args[2] else None
    return softmax.args[2] if len(softmax.args) > 2 else softmax.kwargs.get("dtype")


def _to_values(softmax: Node, nodes: List[Node], casts: List[torch.dtype]):
    """From the softmax to the product with the values, through casts, copies, views and
    dropout in eval mode: (the probabilities there, the product)."""
    node = softmax
    while True:
        user = only_user(node)
        if user.target in VALUE_PRODUCTS:
            first = user.args[1][0] if user.target == aten.einsum.default else user.args[0]
            if first is node and not _keeps_keys(user):
                return node, user
        if user.target == aten.dropout.default:
            if user.args[2] and user.args[1] != 0:
                raise NoMatch(f"aten.dropout.default with p={user.args[1]} in training mode on the probabilities "
                              "(the operator has no dropout)")
        elif user.target in CASTS:
            casts.append(cast_dtype(user))
        elif user.target in _MIXING and user.target != aten.einsum.default or _keeps_keys(user):
            raise NoMatch(f"{user.target} of the probabilities between the softmax and the values mixes them across "
                          "heads (talking-heads attention; the operator keeps heads apart)")
        elif user.target not in _PASS_THROUGH:
            raise NoMatch(f"{user.target} between the softmax and the product with the values")
        nodes.append(user)
        node = user


def _keeps_keys(product: Node) -> bool:
    """An einsum of the probabilities whose result still has the key axis: it maps them to other
    probabilities (mixing heads), it does not multiply them by values."""
    if product.target != aten.einsum.default:
        return False
    eq = product.args[0].replace(" ", "")
    if "->" not in eq:
        return False
    inputs, out = eq.split("->")
    first = inputs.split(",")[0]
    return bool(first) and first[-1] in out


def _blocker(node) -> str:
    while _passes(node):
        node = next(a for a in node.args if isinstance(a, Node))
    return f"{getattr(node, 'target', node)} where the scores' product (q @ k^T) should be"


def _scores(x: Node, constants: Constants):
    """The nearest product upstream of the softmax that is ``q k^T`` (an einsum that mixes heads
    may sit nearer)."""
    candidates = products(x)
    if not candidates:
        raise NoMatch(_blocker(x))
    first = None
    for product in candidates:
        try:
            return product, score_product(product, constants)
        except NoMatch as exc:
            first = first or exc
    raise first


def _canonical_shape(op: Operand) -> list:
    shape = list(val(op.node).shape)
    if op.perm is not None:
        shape = [shape[i] for i in op.perm]
    for axis in op.unsqueeze:
        shape.insert(axis, 1)
    return shape


def _agree(xs, ys) -> bool:
    return len(xs) == len(ys) and all(same(x, y) for x, y in zip(xs, ys))


def _broadcasts(xs, ys) -> bool:
    return len(xs) == len(ys) and all(same(x, 1) or same(x, y) for x, y in zip(xs, ys))


def match(softmax: Node, constants: Constants) -> Match:
    """The site of ``softmax``, or NoMatch with the idiom that stops it."""
    x = softmax.args[0]
    rank = val(x).dim()
    if softmax.args[1] % rank != rank - 1:
        raise NoMatch(f"softmax along axis {softmax.args[1]}, not the last")
    after: List[Node] = []
    casts: List[torch.dtype] = [d for d in [_softmax_dtype(softmax)] if d is not None]
    probs, out = _to_values(softmax, after, casts)
    product, scores = _scores(x, constants)
    chain = walk(x, product, constants)
    if scores.bias is not None and any(n.target in _SCALES for n in chain.nodes):
        raise NoMatch("a scale applied after baddbmm added its input (the operator scales before the masks)")
    values = value_product(out, probs, constants)
    m = _checked(scores, chain, values, probs, out, x, casts)
    for reader in chain.shape_readers:
        if not _agree(list(val(reader).shape), list(val(product).shape)):
            raise NoMatch(f"{reader.target} of a viewed shape of the scores")
    for term in chain.biases + chain.masks:
        if term.region is not None:
            m.regions[id(term)] = region_sizes(term.region, term.node)
    m.erase = [out] + after + [softmax] + chain.nodes + [product] + scores.steps + values.steps
    return m


def _checked(scores: Scores, chain: Chain, values: Values, probs, out, softmax_input, prob_casts) -> Match:
    """Shapes and dtypes the operator takes; the Match with its scale."""
    shape = list(val(chain.product).shape)
    if len(shape) not in (3, 4):
        raise NoMatch(f"{len(shape)}-D scores (3-D [batch*heads, Lq, Lk] and 4-D [batch, heads, Lq, Lk] are rewritten)")
    batch, lq, lk = shape[:-2], shape[-2], shape[-1]
    q, k, v = (_canonical_shape(o) for o in (scores.q, scores.k, values.v))
    if not _agree(q[:-1], batch + [lq]):
        raise NoMatch(f"the query {q} does not give the scores' batch and length {shape}")
    if not (_broadcasts(k[:-2], batch) and same(k[-2], lk) and same(k[-1], q[-1])):
        raise NoMatch(f"the keys {k} do not match the query {q} (batch, heads or head size)")
    if not same(val(softmax_input).shape[-1], lk):
        raise NoMatch("a view between the scores and the softmax moves the key axis")
    p = list(val(probs).shape)
    probs_batch = p[:-2]
    if not (_agree(p[-2:], [lq, lk]) and same(_numel(probs_batch), _numel(batch))):
        raise NoMatch(f"a view between the softmax and the values changes the probabilities {shape} to {p}")
    if not (_broadcasts(v[:-2], probs_batch) and same(v[-2], lk)):
        raise NoMatch(f"the values {v} do not match the probabilities {p}")
    if not _agree(probs_batch, batch) and not _agree(v[:-2], probs_batch):
        raise NoMatch(f"the values {v} broadcast over a batch the probabilities were viewed to ({p})")
    dtype = val(scores.q.node).dtype
    if dtype not in DTYPES or val(scores.k.node).dtype != dtype or val(values.v.node).dtype != dtype:
        raise NoMatch(f"dtype {dtype} (the operator takes float32, float16, bfloat16, the same for q, k and v)")
    odd = [d for d in chain.casts + prob_casts if d not in (dtype, torch.float32)]
    if odd:
        raise NoMatch(f"a cast of the scores or probabilities to {odd[0]} (casts between {dtype} and float32 "
                      "change rounding only)")
    if val(out).dtype != dtype:
        raise NoMatch(f"the output is {val(out).dtype} from {dtype} inputs (the operator returns the inputs' dtype)")
    return Match(scores, chain, values, out, scores.scale * chain.scale, batch, probs_batch)


def _numel(sizes):
    n = 1
    for s in sizes:
        n = n * s
    return n
