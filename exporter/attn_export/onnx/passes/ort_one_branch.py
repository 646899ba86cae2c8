"""ort_one_branch: the layers' ``If`` nodes on one condition (and the bias's) merged into one
``If`` over the rest of the graph, each branch with the layers' own form inlined
(attn_export.onnx.ort.one_branch). Last of the ort passes: the quantizer and the passes before
it edit the main graph's nodes."""
from __future__ import annotations

from attn_export.onnx.ort.one_branch import merge_layer_branches
from attn_export.onnx.passes.base import CountingPass


class OrtOneBranch(CountingPass):
    name = "ort_one_branch"
    flavors = ("ort",)
    rewrite = staticmethod(merge_layer_branches)
    note = "the layers' If nodes merged into one over the rest of the graph: {} If nodes"
