"""The rotary embedding as ONNX Runtime's ``com.microsoft.RotaryEmbedding``: the chain the
exporter writes for HF's ``apply_rotary_pos_emb`` (per layer, for the query and the key,
``x * cos + cat(-x2, x1) * sin`` over ``x = Transpose(Reshape(projection))``, 12 nodes) becomes
one node reading the projection as it comes out of its MatMul ([B, S, heads * D]) and the
graph's ``position_ids``, so a left-padded row rotates by its own positions, and the
Transpose/Reshape pair back to the attention's layout goes with it.

onnxscript's rotary rule matches this chain, but its cos/sin-cache rule expects the
frequencies as ``MatMul(inv_freq[1, E, 1], positions)`` and a Transpose, where our graph has
``positions[B, S, 1] * inv_freq[E]``, so its fusion is undone; this rewrite reads that form.

The caches [N, D/2] are the model's own: ``inv_freq`` (an initializer) times the positions,
cosine and sine, times the attention scaling where the graph multiplies by one. Where the
model's position limit is known (``max_positions``, its config's ``max_position_embeddings``)
and the caches fit in :data:`MAX_CACHE_BYTES`, they are initializers of that many rows, read
at the graph's own position ids (what ONNX Runtime GenAI's builder writes: no work per call; a
position past the limit is the operator's error, "position_ids value ... out of range").
Otherwise they are computed once per call, for the call's positions only (N = B * S, row ``i``
for the i-th position id; the operator is given ``0 .. B*S-1`` as its position ids): nothing
about the maximum length has to be known and a decode step computes B rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from attn_export.onnx.editing import (GraphIndex, NodeBuilder, attr_int, attr_ints, remove_unused, replace_nodes,
                                     value_types)
from attn_export.onnx.ort.nodes import MS_DOMAIN, import_ms_domain

ROTARY = "RotaryEmbedding"
_BNSH = [0, 2, 1, 3]
MAX_CACHE_BYTES = 64 << 20  # both caches; past it (a limit of millions of positions) they are computed per call


@dataclass
class _Rotary:
    add: onnx.NodeProto  # the chain's last node
    projection: str  # [B, S, heads * D]
    head_dim: int
    positions: str
    inv_freq: str
    scale: float  # the attention scaling the cos/sin are multiplied by (1.0: none)
    output: str  # the value the node writes: the attention's [B, S, heads * D] input, or the Add's output
    layout_back: bool  # the output must be turned back into the chain's [B, heads, S, D]
    replaces: tuple = ()  # the Transpose and Reshape back to [B, S, heads * D] the node takes the place of


def fuse_rotary(model: onnx.ModelProto, max_positions: Optional[int] = None) -> int:
    """Rewrites, in place, each rotary chain found; returns how many. ``max_positions``: the
    model's position limit, for caches written as initializers (None: computed per call)."""
    index, types = GraphIndex(model), value_types(model)
    found = [r for r in (_match(index, n) for n in model.graph.node if n.op_type == "Add") if r is not None]
    if not found:
        return 0
    caches: Dict[tuple, tuple] = {}
    by_add = {id(r.add): r for r in found}
    gone = {id(n) for r in found for n in r.replaces}
    nodes: List[onnx.NodeProto] = []
    for node in model.graph.node:
        rotary = by_add.get(id(node))
        if rotary is None:
            if id(node) not in gone:
                nodes.append(node)
            continue
        key = (rotary.positions, rotary.inv_freq, rotary.scale)
        if key not in caches:
            b = NodeBuilder(f"ort_rotary_cache_{len(caches)}")
            elem = types.get(rotary.projection) or _elem_type(index, rotary.projection)
            fixed = _fixed_caches(model, b, index, rotary, elem, max_positions, types)
            caches[key] = fixed if fixed is not None else _caches(b, rotary, elem)
            nodes.extend(b.nodes)
        nodes.extend(_rotary_nodes(rotary, *caches[key]))
    replace_nodes(model, nodes)
    import_ms_domain(model)
    remove_unused(model)
    return len(found)


def _caches(b: NodeBuilder, r: _Rotary, elem: Optional[int]) -> tuple:
    """(position ids 0 .. B*S-1 shaped as the positions, cos cache, sin cache) for this call."""
    flat = b.op("Reshape", [r.positions, b.const("column", [-1, 1])], "flat")
    angles = b.op("Mul", [b.op("Cast", [flat], "flat_f", to=TensorProto.FLOAT), r.inv_freq], "angles")
    cos, sin = b.op("Cos", [angles], "cos"), b.op("Sin", [angles], "sin")
    if r.scale != 1.0:
        scale = b.const("scale", [r.scale], dtype=TensorProto.FLOAT, dims=[])
        cos, sin = b.op("Mul", [cos, scale], "cos_scaled"), b.op("Mul", [sin, scale], "sin_scaled")
    if elem not in (None, TensorProto.FLOAT):
        cos, sin = b.op("Cast", [cos], "cos_t", to=elem), b.op("Cast", [sin], "sin_t", to=elem)
    count = b.op("Size", [r.positions], "count")
    rows = b.op("Range", [b.const("zero", [0], dims=[]), count, b.const("one", [1], dims=[])], "rows")
    ids = b.op("Reshape", [rows, b.op("Shape", [r.positions], "shape")], "position_ids")
    return ids, cos, sin


def _fixed_caches(model: onnx.ModelProto, b: NodeBuilder, index: GraphIndex, r: _Rotary, elem: Optional[int],
                  max_positions: Optional[int], types) -> Optional[tuple]:
    """(the graph's position ids as int64, cos cache, sin cache) as initializers of
    ``max_positions`` rows, or None where the limit is unknown or the caches too large."""
    half = int(index.initializers[r.inv_freq].dims[-1])
    dtype = np.float16 if elem == TensorProto.FLOAT16 else np.float32
    if not max_positions or elem not in (None, TensorProto.FLOAT, TensorProto.FLOAT16) \
            or 2 * max_positions * half * np.dtype(dtype).itemsize > MAX_CACHE_BYTES:
        return None
    inv_freq = numpy_helper.to_array(index.initializers[r.inv_freq]).astype(np.float32)
    # float32 as transformers computes them (positions.float() @ inv_freq), then the scaling.
    angles = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    scale = np.float32(r.scale)
    tables = []
    for what, fn in (("cos", np.cos), ("sin", np.sin)):
        table = numpy_helper.from_array((fn(angles) * scale).astype(dtype), b.name(what))
        model.graph.initializer.append(table)
        tables.append(table.name)
    ids = r.positions
    if types.get(ids) not in (None, TensorProto.INT64):
        ids = b.op("Cast", [ids], "position_ids", to=TensorProto.INT64)
    return (ids, *tables)


def _rotary_nodes(r: _Rotary, ids: str, cos: str, sin: str) -> List[onnx.NodeProto]:
    name = r.add.name or r.add.output[0]
    out = f"{name}/rotary" if r.layout_back else r.output
    nodes = [helper.make_node(ROTARY, [r.projection, ids, cos, sin], [out], name=f"{name}/rotary",
                              domain=MS_DOMAIN, interleaved=0)]  # the head size: 2 x the caches' width
    if r.layout_back:  # [B, S, heads * D] -> [B, heads, S, D] for the chain's other readers
        shape = numpy_helper.from_array(np.array([0, 0, -1, r.head_dim], dtype=np.int64), f"{name}/rotary_shape")
        nodes.append(helper.make_node("Constant", [], [shape.name], value=shape))
        nodes.append(helper.make_node("Reshape", [out, shape.name], [f"{name}/rotary_4d"]))
        nodes.append(helper.make_node("Transpose", [f"{name}/rotary_4d"], [r.output], perm=_BNSH))
    return nodes


def _match(index: GraphIndex, add: onnx.NodeProto) -> Optional[_Rotary]:
    """The rotary chain ending at ``add``, or None."""
    muls = [index.made_by(i, "Mul") for i in add.input]
    if len(muls) != 2 or None in muls:
        return None
    for plain, rotated in (muls, muls[::-1]):
        for x, cos4 in _pairs(plain):
            for half, sin4 in _pairs(rotated):
                if _is_rotate_half(index, half, x):
                    found = _rotary(index, add, x, cos4, sin4)
                    if found is not None:
                        return found
    return None


def _pairs(mul: onnx.NodeProto):
    yield mul.input[0], mul.input[1]
    yield mul.input[1], mul.input[0]


def _is_rotate_half(index: GraphIndex, name: str, x: str) -> bool:
    """``name`` = Concat(Neg(x[..., h:]), x[..., :h]) along the last axis."""
    concat = index.made_by(name, "Concat")
    if concat is None or len(concat.input) != 2 or attr_int(concat, "axis") not in (-1, 3):
        return False
    neg, first = index.made_by(concat.input[0], "Neg"), index.made_by(concat.input[1], "Slice")
    second = index.made_by(neg.input[0], "Slice") if neg is not None else None
    if first is None or second is None or first.input[0] != x or second.input[0] != x:
        return False
    a, b = _slice(index, first), _slice(index, second)
    return a is not None and b is not None and a[0] == 0 and a[1] == b[0] and b[1] >= 2 * a[1]


def _slice(index: GraphIndex, node: onnx.NodeProto) -> Optional[tuple]:
    """(start, end) of a Slice of step 1 along the last axis of a 4-D value, or None."""
    values = [index.constant(i) if i else None for i in node.input[1:]]
    if len(values) < 3 or any(v is None or v.size != 1 for v in values[:3]):
        return None
    start, end, axis = (int(v.reshape(-1)[0]) for v in values[:3])
    if axis not in (-1, 3) or (len(values) > 3 and (values[3] is None or int(values[3].reshape(-1)[0]) != 1)):
        return None
    return start, end


def _rotary(index: GraphIndex, add: onnx.NodeProto, x: str, cos4: str, sin4: str) -> Optional[_Rotary]:
    transpose = index.made_by(x, "Transpose")
    reshape = index.made_by(transpose.input[0], "Reshape") if transpose is not None else None
    if reshape is None or attr_ints(transpose, "perm") != _BNSH:
        return None
    cos, sin = _angle_source(index, cos4, "Cos"), _angle_source(index, sin4, "Sin")
    if cos is None or sin is None or cos[0] != sin[0] or cos[1] != sin[1]:
        return None
    freqs = _frequencies(index, cos[0])
    if freqs is None:
        return None
    positions, inv_freq = freqs
    head_dim = 2 * int(index.initializers[inv_freq].dims[-1])
    shape = index.constant(reshape.input[1])
    if shape is not None and (shape.size != 4 or int(shape[-1]) != head_dim):
        return None
    if shape is None and not _last_is(index, reshape.input[1], head_dim):
        return None
    output, back, replaces = add.output[0], True, ()
    readers = index.consumers.get(add.output[0], [])
    if len(readers) == 1 and add.output[0] not in index.graph_outputs:
        to_seq = readers[0]
        flat = [n for n in index.consumers.get(to_seq.output[0], [])]
        if to_seq.op_type == "Transpose" and attr_ints(to_seq, "perm") == _BNSH and len(flat) == 1 \
                and flat[0].op_type == "Reshape" and _is_merge_heads(index, flat[0]):
            output, back, replaces = flat[0].output[0], False, (to_seq, flat[0])
    return _Rotary(add, reshape.input[0], head_dim, positions, inv_freq, cos[1], output, back, replaces)


def _angle_source(index: GraphIndex, name: str, op: str) -> Optional[tuple]:
    """(the angles, the scale) of Unsqueeze([Mul(] op(angles) [, scale)], axis 1)."""
    unsqueeze = index.made_by(name, "Unsqueeze")
    axes = index.constant(unsqueeze.input[1]) if unsqueeze is not None and len(unsqueeze.input) > 1 else None
    if axes is None or axes.size != 1 or int(axes.reshape(-1)[0]) != 1:
        return None
    value, scale = unsqueeze.input[0], 1.0
    mul = index.made_by(value, "Mul")
    if mul is not None:
        for a, s in _pairs(mul):
            s_value = index.constant(s)
            if index.made_by(a, op) is not None and s_value is not None and s_value.size == 1:
                value, scale = a, float(s_value.reshape(-1)[0])
                break
        else:
            return None
    trig = index.made_by(value, op)
    return (trig.input[0], scale) if trig is not None else None


def _frequencies(index: GraphIndex, angles: str) -> Optional[tuple]:
    """(position ids [B, S], inv_freq initializer [D/2]) of Concat(f, f) with
    f = Cast(Unsqueeze(position ids, -1)) * inv_freq."""
    concat = index.made_by(angles, "Concat")
    if concat is None or len(concat.input) != 2 or concat.input[0] != concat.input[1] \
            or attr_int(concat, "axis") not in (-1, 2):
        return None
    mul = index.made_by(concat.input[0], "Mul")
    for a, b in _pairs(mul) if mul is not None else ():
        cast = index.made_by(a, "Cast")
        unsqueeze = index.made_by(cast.input[0], "Unsqueeze") if cast is not None else None
        inv = index.initializers.get(b)
        if unsqueeze is None or inv is None or len(inv.dims) != 1 or inv.data_type != TensorProto.FLOAT:
            continue
        axes = index.constant(unsqueeze.input[1]) if len(unsqueeze.input) > 1 else None
        if axes is not None and axes.size == 1 and int(axes.reshape(-1)[0]) in (-1, 2):
            return unsqueeze.input[0], b
    return None


def _is_merge_heads(index: GraphIndex, reshape: onnx.NodeProto) -> bool:
    shape = index.constant(reshape.input[1])
    return shape is not None and shape.tolist() == [0, 0, -1]


def _last_is(index: GraphIndex, name: str, size: int) -> bool:
    """A shape built by Concat whose last part is the constant ``size``."""
    concat = index.made_by(name, "Concat")
    last = index.constant(concat.input[-1]) if concat is not None else None
    return last is not None and last.size == 1 and int(last.reshape(-1)[0]) == size


def _elem_type(index: GraphIndex, name: str) -> Optional[int]:
    weights = index.producer.get(name)
    if weights is not None and weights.op_type == "Split":
        weights = index.producer.get(weights.input[0])
    if weights is not None and weights.op_type == "MatMul" and weights.input[1] in index.initializers:
        return index.initializers[weights.input[1]].data_type
    return None
