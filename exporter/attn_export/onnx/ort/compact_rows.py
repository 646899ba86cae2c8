"""One graph for padded and unpadded batches, without an ``If``: each row's tokens compacted at
the start of its cache, as ONNX Runtime GenAI's model builder lays a batch out.

attention.py writes each cached layer as an ``If`` on "some key is padded": an unpadded batch
runs GroupQueryAttention at full speed, a padded one with the padding as a bias over
transformers' layout (row ``j`` of the cache is column ``j`` of the mask). ONNX Runtime runs an
``If`` as a subgraph call of its own, which on a small decoder costs 10-15% of a decode step.
GroupQueryAttention expresses padding without a bias when each row's tokens come first
(``seqlens_k[b]`` = the row's token count - 1): it writes the new tokens at the row's count,
attends to the first ``count`` keys and rotates at positions counted from the row's start.
Here every layer runs that form, and the graph makes its batch fit it:

* the call's new tokens of each row are put in the order of the mask's new columns, kept ones
  first (one ``TopK`` of those columns, ties to the lower index; the identity for a
  right-padded or unpadded row and at a decode step): a left-padded prompt (transformers'
  convention) becomes right-padded, what GenAI already passes;
* ``seqlens_k`` = ``ReduceSum(attention_mask) - 1`` per row, the total = the mask's length;
* the outputs with a sequence axis are put back in the caller's order (the inverse order, a
  second ``TopK``), so position ``j`` of the logits is the caller's position ``j``; the
  last-logits head (last_logits.rows_last) reads each row's last token of the call at
  ``count - 1``;
* positions come from the mask (GroupQueryAttention counts them from ``seqlens_k``, what
  ``generate()`` computes from the mask); a ``position_ids`` input still read by the graph (a
  learned position embedding, a RotaryEmbedding) is reordered with the tokens.

The cache holds each row's tokens compacted (the builder's layout, not transformers'): a present
fed back as the next past is all a caller does with it. Applies when every attention of the file
is such a layer and every input and output outside the cache has the call's sequence axis;
otherwise the graph keeps its ``If`` nodes (returns 0).
"""
from __future__ import annotations

from typing import Dict, List

import onnx
from onnx import TensorProto

from attn_export.cache_contract import ATTENTION_MASK, INPUT_IDS, CacheContract
from attn_export.onnx.editing import (NodeBuilder, count_attention_nodes, read_names, remove_unused, replace_nodes,
                                     value_dims)
from attn_export.onnx.last_logits import INT64_MAX, ROWS_LAST
from attn_export.onnx.ort.nodes import MS_DOMAIN

GQA, MHA = "GroupQueryAttention", "MultiHeadAttention"
POSITION_INPUT = 9  # GroupQueryAttention's position_ids: left out, the operator counts from seqlens_k


def compact_rows(model: onnx.ModelProto) -> int:
    """Rewrites, in place; returns how many layers lost their ``If`` (0: the graph is left as it was)."""
    layers = _layers(model)
    if not layers or not _applies(model, layers):
        return 0
    dims = value_dims(model)
    sequence = dims[INPUT_IDS][1]
    b = NodeBuilder("ort_compact")
    length = b.op("Shape", [INPUT_IDS], "length", start=1, end=2)
    new = b.op("Slice", [ATTENTION_MASK, b.op("Neg", [length], "from_end"), b.const("to_end", [INT64_MAX]),
                         b.const("axis1", [1])], "new_columns")
    # Each row's kept columns in order, then its pads: TopK breaks ties by the lower index.
    order = b.name("order")
    b.op("TopK", [new, length], "order", outputs=[b.name("kept_first"), order], axis=1, largest=1, sorted=1)
    counts = b.op("ReduceSum", [ATTENTION_MASK, b.const("axes1", [1])], "counts", keepdims=0)
    seqlens = b.op("Cast", [b.op("Sub", [counts, b.const("one1", [1])], "last")], "seqlens_k", to=TensorProto.INT32)
    total = b.op("Squeeze", [b.op("Cast", [b.op("Shape", [ATTENTION_MASK], "total64", start=1, end=2)], "total1",
                                  to=TensorProto.INT32)], "total_sequence_length")

    reordered = _reorder_inputs(model, b, order, dims)
    _rename_reads(model.graph, reordered)  # before the new nodes join: they read the inputs themselves
    body = [_dense(node, seqlens, total) if node.op_type == "If" and node.output[0] in layers else node
            for node in model.graph.node]

    back = NodeBuilder("ort_compact/back")
    for node in body:
        if node.name.endswith(ROWS_LAST):
            # The row's kept tokens come first, where TopK's sorted columns are 1: the last 1 is
            # the last token (no kept token: the last position, as GatherND reads -1).
            last = back.op("ArgMax", [b.name("kept_first")], "last_kept", axis=1, keepdims=1, select_last_index=1)
            node.input[1] = back.op("Unsqueeze", [last, back.const("axis2", [2])], "last_index")
    restored = []
    for output in model.graph.output:
        if CacheContract.is_present(output.name) or dims.get(output.name, [None, None])[1] != sequence:
            continue
        if not restored:  # the caller's position of each compacted one: the order's own order
            inverse = back.name("inverse")
            back.op("TopK", [order, length], "inverse", outputs=[back.name("sorted"), inverse], axis=1, largest=0,
                    sorted=1)
            restored.append(back.op("Unsqueeze", [inverse, back.const("axis2_inverse", [2])], "inverse_index"))
        restored.append(_put_back(body, output.name, back, restored[0]))
    # The index nodes read only the mask and the inputs' shapes; each output's GatherND reads its
    # producer's result: the first go first, the others last.
    gathers = [n for n in back.nodes if n.op_type == "GatherND"]
    replace_nodes(model, [*b.nodes, *[n for n in back.nodes if n.op_type != "GatherND"], *body, *gathers])
    remove_unused(model)
    return len(layers)


def _layers(model: onnx.ModelProto) -> Dict[str, onnx.NodeProto]:
    """The ``If``'s first output -> its unpadded branch's GroupQueryAttention, for each layer ``If`` of attention.py
    (the else-branch one GroupQueryAttention, the then-branch holding one too)."""
    out = {}
    for node in model.graph.node:
        if node.op_type != "If":
            continue
        branches = {a.name: list(a.g.node) for a in node.attribute}
        dense, exact = branches.get("else_branch", []), branches.get("then_branch", [])
        if len(dense) == 1 and dense[0].op_type == GQA and dense[0].domain == MS_DOMAIN \
                and any(n.op_type == GQA for n in exact):
            out[node.output[0]] = dense[0]
    return out


def _applies(model: onnx.ModelProto, layers: Dict[str, onnx.NodeProto]) -> bool:
    dims = value_dims(model)
    inputs = {v.name: dims.get(v.name, []) for v in model.graph.input}
    outputs = {v.name: dims.get(v.name, []) for v in model.graph.output}
    if INPUT_IDS not in inputs or ATTENTION_MASK not in inputs or count_attention_nodes(model):
        return False
    sequence = inputs[INPUT_IDS][1] if len(inputs[INPUT_IDS]) > 1 else None
    if not isinstance(sequence, str):
        return False
    # Every attention is a layer If: a GroupQueryAttention or MultiHeadAttention outside one (or
    # in another If) reads transformers' layout.
    if any(_attention_within(n) for n in model.graph.node if not (n.op_type == "If" and n.output[0] in layers)):
        return False
    if _mask_read_beyond_the_layers(model, layers):
        return False  # the mask's columns stay in the caller's order: a reader of them would misalign
    initializers = {i.name for i in model.graph.initializer}
    for dense in layers.values():
        rotary = len(dense.input) > 8 and any(a.name == "do_rotary" and a.i for a in dense.attribute)
        if rotary and not (dense.input[7] in initializers and dense.input[8] in initializers):
            return False  # caches built per call from the graph's positions (gqa_rotary.py)
    for name, dims in inputs.items():
        if name in (ATTENTION_MASK,) or CacheContract.is_past(name):
            continue
        if len(dims) < 2 or dims[1] != sequence:
            return False
    for name, dims in outputs.items():
        if CacheContract.is_present(name):
            continue
        if len(dims) < 2 or (dims[1] != sequence and not _last_logits(model, dims)):
            return False
    return True


def _attention_within(node: onnx.NodeProto) -> bool:
    if node.domain == MS_DOMAIN and node.op_type in (GQA, MHA):
        return True
    return any(_attention_within(inner) for a in node.attribute
               for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs) for inner in sub.node)


def _mask_read_beyond_the_layers(model: onnx.ModelProto, layers: Dict[str, onnx.NodeProto]) -> bool:
    """Whether a node the rewritten graph keeps reads the attention mask: the nodes the graph's
    outputs need once each layer If is its unpadded operator, whose lengths come from the mask
    through nodes of this module's own."""
    producer = {o: n for n in model.graph.node for o in n.output if o}
    stack, seen = [o.name for o in model.graph.output], set()
    while stack:
        name = stack.pop()
        node = producer.get(name)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type == "If" and node.output[0] in layers:
            dense = layers[node.output[0]]
            reads = [i for k, i in enumerate(dense.input[:POSITION_INPUT]) if k not in (5, 6)]
        elif node.name.endswith(ROWS_LAST):
            reads = [node.input[0]]  # its index is rewritten from the mask's new columns
        else:
            reads = list(read_names(onnx.helper.make_graph([node], "n", [], [])))
        if ATTENTION_MASK in reads:
            return True
        stack.extend(i for i in reads if i)
    return False


def _last_logits(model: onnx.ModelProto, dims) -> bool:
    """An output of one position per row picked by last_logits.rows_last."""
    return dims[1] == 1 and any(n.name.endswith(ROWS_LAST) for n in model.graph.node)


def _reorder_inputs(model: onnx.ModelProto, b: NodeBuilder, order: str, dims) -> Dict[str, str]:
    """Each input with the call's sequence axis that some node reads -> its copy in ``order``
    ([B, S] positions) along that axis."""
    reads = set(read_names(model.graph))
    reordered = {}
    for value in model.graph.input:
        name = value.name
        if name == ATTENTION_MASK or CacheContract.is_past(name) or name not in reads:
            continue
        if len(dims[name]) == 2:
            reordered[name] = b.op("GatherElements", [name, order], f"{name}_compact", axis=1)
        else:
            index = b.op("Unsqueeze", [order, b.const(f"{name}_axis2", [2])], f"{name}_index")
            reordered[name] = b.op("GatherND", [name, index], f"{name}_compact", batch_dims=1)
    return reordered


def _dense(node: onnx.NodeProto, seqlens: str, total: str) -> onnx.NodeProto:
    """The layer's unpadded GroupQueryAttention, writing the ``If``'s outputs, with the rows' own
    lengths and no position ids."""
    dense = next(a.g.node[0] for a in node.attribute if a.name == "else_branch")
    out = onnx.NodeProto()
    out.CopyFrom(dense)
    inputs = list(out.input[:POSITION_INPUT])
    inputs[5], inputs[6] = seqlens, total
    del out.input[:]
    out.input.extend(inputs)
    del out.output[:]
    out.output.extend(node.output)
    return out


def _rename_reads(graph: onnx.GraphProto, names: Dict[str, str]) -> None:
    """Every read of ``names`` (main graph and branches) -> the new name."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = names.get(name, name)
        for a in node.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                _rename_reads(sub, names)


def _put_back(nodes: List[onnx.NodeProto], name: str, b: NodeBuilder, inverse: str) -> str:
    """The graph output ``name`` in the caller's order: its producer writes ``name/compact``."""
    for node in nodes:
        for i, out in enumerate(node.output):
            if out == name:
                node.output[i] = f"{name}/compact"
    return b.op("GatherND", [f"{name}/compact", inverse], f"{name}_back", outputs=[name], batch_dims=1)
