"""Whether a cached export runs with ONE key/value buffer per layer, allocated at the maximum
length and written in place (ONNX Runtime GenAI's ``past_present_share_buffer: true``): when
every attention of the file is a GroupQueryAttention whose total length comes from the
attention mask (attention.py), the operator writes the new tokens at rows ``total - S ..
total - 1`` of the buffer it is given as past and returns it as the present; the portable node
and MultiHeadAttention append to a past of the past's own length instead."""
from __future__ import annotations

import onnx

from attn_export.cache_contract import ATTENTION_MASK, CacheContract
from attn_export.onnx.editing import count_attention_nodes
from attn_export.onnx.ort.attention import GQA, MHA
from attn_export.onnx.ort.nodes import MS_DOMAIN


def shares_buffer(model: onnx.ModelProto) -> bool:
    """True for an ``ort``-flavor cached export whose every attention is a GroupQueryAttention
    fed from the graph's ``attention_mask``."""
    ops = [n for n in _nodes(model.graph) if n.domain == MS_DOMAIN and n.op_type in (GQA, MHA)]
    if not ops or count_attention_nodes(model) or any(n.op_type != GQA for n in ops):
        return False
    if ATTENTION_MASK not in {i.name for i in model.graph.input}:
        return False
    return all(len(n.input) > 4 and n.input[3] and n.input[4] and _from_mask(model, n.input[6]) for n in ops)


def _nodes(graph: onnx.GraphProto):
    """The graph's nodes and those of its If branches (attention.py puts a layer's two forms there)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _nodes(attr.g)


def _from_mask(model: onnx.ModelProto, total: str) -> bool:
    """Whether the total length is computed, through Shape, from a value that depends on the
    graph's attention_mask (not on a past input)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    seen, stack = set(), [total]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name == ATTENTION_MASK:
            return True
        if CacheContract.is_past(name):
            return False
        node = producer.get(name)
        if node is not None:
            stack.extend(i for i in node.input if i)
    return False
