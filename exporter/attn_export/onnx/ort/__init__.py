"""The ONNX Runtime flavor (``--onnx-attention ort``): each FusedAttention node becomes ONNX
Runtime's own contrib operator (``com.microsoft.GroupQueryAttention`` for causal self-attention
with or without its cache, ``com.microsoft.MultiHeadAttention`` for the rest it can express),
and the rest of the graph is fused for ONNX Runtime by onnxscript's maintained rewriter
(RMSNorm/LayerNorm with the residual, rotary embedding, GELU forms). For ONNX Runtime only: no
other runtime implements the ``com.microsoft`` domain (docs/onnx_consumers.md).

Each step is a function ``model -> outcome`` over the exported ModelProto, editing it in place,
run by a graph pass of its own (onnx/passes: ort_attention, ort_fusions, ort_rotary,
ort_reshapes, ort_pack_matmuls):

* :func:`lower_attention` (attention.py): the nodes to contrib ops; what is kept and why;
* :func:`fuse_for_ort` (fusions.py): onnxscript's ``optimize_for_ort``; the counts per fusion;
* :func:`fuse_rotary` (rotary.py): the rotary chains onnxscript leaves -> ``RotaryEmbedding``;
* :func:`drop_identity_reshapes` (reshapes.py): the head split/merge left around the attention;
* :func:`pack_sibling_matmuls` (packed_matmul.py): projections of one input in one MatMul.
"""
from attn_export.onnx.ort.attention import OrtLowering, lower_attention, why_not_ort  # noqa: F401
from attn_export.onnx.ort.fusions import OrtFusions, fuse_for_ort  # noqa: F401
from attn_export.onnx.ort.packed_matmul import pack_sibling_matmuls  # noqa: F401
from attn_export.onnx.ort.reshapes import drop_identity_reshapes  # noqa: F401
from attn_export.onnx.ort.rotary import fuse_rotary  # noqa: F401

from attn_export.onnx.ort.nodes import MS_DOMAIN  # noqa: F401, E402


def check_model(model, full_check: bool = True) -> None:
    """``onnx.checker.check_model(full_check=True)`` for a file of this flavor: ONNX Runtime
    registers some of its own operators in the default domain (``SimplifiedLayerNormalization``,
    which onnxscript's fusions write), which the checker does not know; they are checked as
    opaque nodes (moved to ``com.microsoft`` in a copy), the rest as always."""
    import onnx

    from attn_export.onnx.ort.nodes import import_ms_domain

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    known = {s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain == ""}

    def opaque(graph) -> None:  # the main graph and the If branches (one_branch.py)
        for node in graph.node:
            if node.domain in ("", "ai.onnx") and node.op_type not in known:
                node.domain = MS_DOMAIN
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    opaque(a.g)

    opaque(copy.graph)
    import_ms_domain(copy)
    onnx.checker.check_model(copy, full_check=full_check)
