"""Hand-written attention in a captured graph, ``softmax(q k^T * scale + biases, masks) @ v``,
rewritten to ``attn_export::attention`` in a ``torch.export`` program (before it is translated
to ONNX, or to run in PyTorch: :mod:`attn_export.surgery.fuse`).

A site is a softmax whose result (through a few ops) is the first operand of a product. It is
rewritten only when it is exactly the operator's computation, up to rounding:

* the scores are ``q @ X`` (``matmul``, ``bmm``, ``baddbmm``) or an ``einsum`` that sums over one
  feature axis, with the key axis last; the keys are ``X^T`` (a ``transpose``/``mT``/``permute``
  of them is read through); any axis order of ``einsum`` operands is permuted into place;
* 3-D ``[N, L, D]`` (run as ``[N, 1, L, D]``) or 4-D ``[B, H, L, D]`` scores; keys and values
  that broadcast over batch or heads (matmul's broadcasting, an ``einsum`` without the head axis:
  multi-query attention) are expanded, as the product broadcasts them; keys repeated for grouped
  heads (``repeat``/``expand`` + ``reshape``, ``repeat_interleave``) are ordinary keys;
* the scale: every constant multiplication or division (a number, ``torch.full([], c)``,
  ``torch.tensor(c)``) on ``q``, on ``k`` or ``k^T``, on the scores before any bias or mask, and
  ``baddbmm``'s ``alpha``, multiplied together; none means 1 (a scale after a bias or mask is
  not the operator's order and is left alone);
* biases: floating terms added (or subtracted) anywhere between the product and the softmax,
  ``baddbmm``'s input with ``beta=1`` (``beta=0`` ignores it); their sum is the operator's float
  mask. A term added in a
  viewed shape of the scores (``S.view(V) + b`` then viewed back: torchvision's shifted-window
  mask, segment-anything's decomposed relative position, a ``[B*H, L, L]`` product viewed as
  ``[B, H, L, L]``) is expanded to ``V`` and reshaped to the scores' shape, which is the same sum;
* masks: ``masked_fill(mask, c)`` and ``where(keep, scores, c)`` / ``where(mask, c, scores)``
  with a boolean condition and ``c`` = ``-inf`` or at most ``-1e4`` (``-finfo.max``, ``-1e9``);
  their union masks the operator's pairs. A finite fill replaces a score by a value whose
  ``exp`` underflows to 0 beside any real score, which is what ``-inf`` gives;
* ``scores - scores.amax(-1, keepdim=True)`` (also ``.detach()``-ed): the stabilizer written by
  hand, which the softmax does itself (softmax is unchanged by a shift along its axis);
* casts between the inputs' dtype and float32 on the scores and the probabilities
  (``.float()``, ``.to(q.dtype)``, ``softmax(dtype=float32)``): the operator accumulates half
  types in float32, so they change rounding only; the output keeps the inputs' dtype;
* ``softmax``/``_softmax``/``_safe_softmax`` over the last axis, then copies, casts, views of the
  batch axes and dropout in eval mode (or ``p=0``), then ``p @ v`` (``matmul``, ``bmm``,
  ``einsum``, whose output axis order is restored with a permute); values scaled or computed by
  anything are values;
* q, k, v of one dtype the operator takes (float32, float16, bfloat16), and every intermediate
  tensor has no other user (attention weights also returned or reused keep the graph as written);
  a copy nothing reads and ``mask.expand_as(scores)`` (read as the scores' shape) do not count.

With ``needs_grad`` (a graph run for training), a site whose float bias is computed from a
placeholder that needs gradients is left alone.

Anything else is left alone, and the site is reported with the idiom that stopped the match
(talking-heads attention, a convolution or product mixing the scores or the probabilities across
heads, is one). Where the result differs: a query whose keys are all masked gets zeros from the
operator, where the written graph gives NaN (``-inf``), the mean of the values (a finite fill) or
zeros (``_safe_softmax``, the same); biases are summed before they are added and the scale is
applied once (rounding differs by an ulp or so); float masks are detached (the operator treats
masks as constants).
"""
from attn_export.surgery.patterns.rewrite import PatternSite, rewrite

__all__ = ["PatternSite", "rewrite"]
