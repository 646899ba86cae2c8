"""ort_compact_rows: the layers' ``If`` on "some key is padded" replaced by their unpadded
GroupQueryAttention over rows compacted at the start of the cache, the call's tokens rotated
in and the outputs rotated back (attn_export.onnx.ort.compact_rows). After the last-logits pass
(it rewrites that pass's per-row pick) and before the quantizer."""
from __future__ import annotations

from attn_export.onnx.ort.compact_rows import compact_rows
from attn_export.onnx.passes.base import CountingPass


class OrtCompactRows(CountingPass):
    name = "ort_compact_rows"
    flavors = ("ort",)
    rewrite = staticmethod(compact_rows)
    note = ("each row's tokens compacted at the start of its cache (ONNX Runtime GenAI's layout): no If, "
            "padding as GroupQueryAttention's per-row lengths in {} layers")
