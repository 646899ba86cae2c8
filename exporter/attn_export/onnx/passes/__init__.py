"""The graph passes that finish an exported model, in the order they run (:data:`PASSES`), and
the loop that runs them (:func:`run_passes`); modelled on ONNX Runtime's transformers
optimizer (one class per fusion, an ordered list). Each pass is a module of its own, named by
what it does; ``base`` says what a pass is.

A new pass is its module (a :class:`~attn_export.onnx.passes.base.GraphPass` subclass) and one
line in :data:`PASSES` (or :func:`register`, e.g. from a test or a flavor's own module). A pass
that serves some attention flavors only says so in ``flavors``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List, Optional

import onnx

from attn_export.onnx.passes.attach_functions import AttachFunctions
from attn_export.onnx.passes.base import GraphPass, PassContext, PassOutcome
from attn_export.onnx.passes.fold_past_custom import FoldPastCustom
from attn_export.onnx.passes.inline_functions import InlineFunctions
from attn_export.onnx.passes.label_axes import LabelAxes
from attn_export.onnx.passes.last_logits import LastLogits
from attn_export.onnx.passes.ort_attention import OrtAttention
from attn_export.onnx.passes.ort_compact_rows import OrtCompactRows
from attn_export.onnx.passes.ort_fusions import OrtGraphFusions
from attn_export.onnx.passes.ort_gqa_rotary import OrtGqaRotary
from attn_export.onnx.passes.ort_one_branch import OrtOneBranch
from attn_export.onnx.passes.ort_pack_matmuls import OrtPackMatMuls
from attn_export.onnx.passes.ort_quantize import OrtQuantize
from attn_export.onnx.passes.ort_reshapes import OrtReshapes
from attn_export.onnx.passes.ort_rotary import OrtRotary
from attn_export.onnx.passes.ort_unpack_splits import OrtUnpackSplits
from attn_export.onnx.passes.project_before_transpose import ProjectBeforeTranspose
from attn_export.onnx.passes.record_shapes import RecordShapes
from attn_export.onnx.passes.standard_attention import StandardAttention

PASSES: List[GraphPass] = [
    LabelAxes(),  # symbolic dims -> the requested axis labels (first: later passes keep the symbols)
    ProjectBeforeTranspose(),  # fp16 MatMul before a graph input's Transpose (an ONNX Runtime crash)
    StandardAttention(),  # standard flavor: FusedAttention -> opset-23 Attention (and its cache)
    FoldPastCustom(),  # a cached export's Concat(past, new) into the custom nodes' cache form
    OrtAttention(),  # ort flavor: the (folded) nodes -> ONNX Runtime's GroupQueryAttention / MultiHeadAttention
    OrtGraphFusions(),  # ort flavor: onnxscript's ONNX Runtime fusions over the rest of the graph
    OrtRotary(),  # ort flavor: the rotary chains onnxscript leaves -> RotaryEmbedding
    OrtReshapes(),  # ort flavor: Reshape chains that give back their source's shape dropped
    OrtPackMatMuls(),  # ort flavor: sibling projections packed into one MatMul
    OrtGqaRotary(),  # ort flavor: packed QKV + rotary read by GroupQueryAttention (do_rotary)
    OrtUnpackSplits(),  # ort flavor: what no operator reads packed (gate/up) as one MatMul per part
    LastLogits(),  # --last-logits: the language-model head on the last position only
    OrtCompactRows(),  # ort flavor: padding as per-row lengths over a compacted cache, no If
    OrtQuantize(),  # ort flavor, --quantize: the MatMul weights into ONNX Runtime's MatMulNBits
    OrtOneBranch(),  # ort flavor: the layers' If nodes as one If over the rest of the graph
    AttachFunctions(),  # each custom node's model-local function
    InlineFunctions(),  # functions="inline": the bodies into the graph
    RecordShapes(),  # last: shape inference over the finished graph
]


def register(graph_pass: GraphPass, *, before: Optional[str] = None, after: Optional[str] = None) -> None:
    """Adds ``graph_pass`` to :data:`PASSES`: before or after the pass of that name, else last."""
    names = [p.name for p in PASSES]
    if graph_pass.name in names:
        raise ValueError(f"a pass named {graph_pass.name!r} is already in the list")
    anchor = before or after
    if anchor is not None and anchor not in names:
        raise ValueError(f"no pass named {anchor!r} (passes: {', '.join(names)})")
    position = len(PASSES) if anchor is None else names.index(anchor) + (1 if after else 0)
    PASSES.insert(position, graph_pass)


def run_passes(model: onnx.ModelProto, context: PassContext,
               passes: Optional[List[GraphPass]] = None) -> List[PassOutcome]:
    """Runs, in order, each pass of ``passes`` (default :data:`PASSES`) that applies to the
    model; returns the outcome of each pass that ran, named."""
    context.model = model
    outcomes = []
    for graph_pass in PASSES if passes is None else passes:
        if graph_pass.applies(context):
            outcome = graph_pass.run(model, context)
            outcomes.append(replace(outcome, name=graph_pass.name, notes=tuple(outcome.notes)))
    return outcomes


def names() -> List[str]:
    """The names of :data:`PASSES`, in order."""
    return [p.name for p in PASSES]


__all__ = ["PASSES", "GraphPass", "PassContext", "PassOutcome", "names", "register", "run_passes"]
