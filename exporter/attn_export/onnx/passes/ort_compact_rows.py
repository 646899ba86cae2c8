"""ort_compact_rows: the layers' ``If`` on "some key is padded" replaced by their unpadded
GroupQueryAttention over rows compacted at the start of the cache, the call's tokens put
kept-first and the outputs put back (attn_export.onnx.ort.compact_rows). After the last-logits pass
(it rewrites that pass's per-row pick) and before the quantizer.

The operator counts the positions from the per-row lengths, so where nothing else reads
``position_ids`` (a learned position embedding would) the file no longer takes it, as the
builder's files do not: ONNX Runtime GenAI then computes and binds none at each step (about 3%
of a small decoder's token; docs/benchmarks.md, run 8), and the cache's contract says so."""
from __future__ import annotations

import onnx

from attn_export.cache_contract import POSITION_IDS
from attn_export.onnx.editing import drop_unread_input
from attn_export.onnx.ort.compact_rows import compact_rows
from attn_export.onnx.passes.base import GraphPass, PassContext, PassOutcome


class OrtCompactRows(GraphPass):
    name = "ort_compact_rows"
    flavors = ("ort",)

    def run(self, model: onnx.ModelProto, context: PassContext) -> PassOutcome:
        layers = compact_rows(model)
        if not layers:
            return PassOutcome(0, ())
        notes = [f"each row's tokens compacted at the start of its cache (ONNX Runtime GenAI's layout): no If, "
                 f"padding as GroupQueryAttention's per-row lengths in {layers} layers"]
        if drop_unread_input(model, POSITION_IDS):
            context.position_ids = False
            context.labels.pop(POSITION_IDS, None)
            notes.append("position_ids: no longer an input (the operator counts the positions from the attention mask)")
        return PassOutcome(layers, tuple(notes))
