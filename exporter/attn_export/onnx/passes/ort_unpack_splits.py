"""ort_unpack_splits: a packed projection that no operator reads packed (an MLP's gate and up,
once GroupQueryAttention took the packed Q/K/V) back as one MatMul per part, without its Split
(attn_export.onnx.ort.packed_split.split_as_matmuls). ONNX Runtime copies a Split's outputs:
at a prompt that copy costs more than the wider MatMul saves, at a decode step as much
(docs/benchmarks.md, run 8). After the GroupQueryAttention rotary pass, before the quantizer."""
from __future__ import annotations

from attn_export.onnx.ort.packed_split import split_as_matmuls
from attn_export.onnx.passes.base import CountingPass


class OrtUnpackSplits(CountingPass):
    name = "ort_unpack_splits"
    flavors = ("ort",)
    rewrite = staticmethod(split_as_matmuls)
    note = "packed projections no operator reads packed (gate/up) as one MatMul per part, no Split: {} rewrite(s)"
