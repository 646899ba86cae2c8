"""The rest of the graph fused for ONNX Runtime by a maintained library: onnxscript's
``onnxscript.rewriter.ort_fusions.optimize_for_ort`` (onnxscript is torch.onnx's own exporter's
dependency), which rewrites RMSNorm and LayerNorm with their residual Add into
``SimplifiedLayerNormalization`` / ``SkipSimplifiedLayerNormalization`` / ``SkipLayerNormalization``,
the rotary embedding into ``RotaryEmbedding``, GELU forms into ``Gelu``/``FastGelu``/``BiasGelu``,
and whatever else its rule set matches. No pattern code of our own: what it does not match
stays as exported, and the counts say what it did.

The norms it writes name their optional statistics outputs (mean, inverse standard deviation),
which nothing reads; ONNX Runtime's kernels compute and allocate an output only where the node
names it, so the unread ones are left unnamed (as ONNX Runtime GenAI's builder writes them).
"""
from __future__ import annotations

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass, field
from typing import Dict, Optional

import onnx

from attn_export.onnx.editing import read_names

# Each norm's optional statistics outputs, by index (ONNX Runtime's contrib schemas, ONNX's).
STATISTICS = {"SkipLayerNormalization": (1, 2), "SkipSimplifiedLayerNormalization": (1, 2),
              "SimplifiedLayerNormalization": (1,), "LayerNormalization": (1, 2)}


@dataclass
class OrtFusions:
    counts: Dict[str, int] = field(default_factory=dict)  # fusion rule -> times it reports applied (non-zero)
    ops: Dict[str, int] = field(default_factory=dict)  # op type the graph gained -> count in the result
    error: Optional[str] = None  # the rewriter failed: the model is left as it was

    def note(self) -> str:
        if self.error:
            return f"onnxscript's ONNX Runtime fusions were not applied: {self.error}"
        done = ", ".join(f"{name} x{n}" for name, n in sorted(self.counts.items())) or "nothing matched"
        left = ", ".join(f"{op} x{n}" for op, n in sorted(self.ops.items())) or "none"
        return f"fused for ONNX Runtime by onnxscript's ort_fusions: {done} (fused nodes in the file: {left})"


def fuse_for_ort(model: onnx.ModelProto) -> OrtFusions:
    """Runs ``optimize_for_ort`` on ``model`` and writes the result back in place; on any error
    the model is left untouched and the outcome says why."""
    try:
        import onnx_ir as ir
        from onnxscript.rewriter.ort_fusions import optimize_for_ort
    except ImportError as exc:
        return OrtFusions(error=f"onnxscript with ort_fusions is not installed ({exc})")
    metadata = list(model.metadata_props)
    before = _op_counts(model)
    try:
        with _quiet():
            fused, counts = optimize_for_ort(ir.serde.deserialize_model(model))
            proto = ir.serde.serialize_model(fused)
    except Exception as exc:  # noqa: BLE001 - the rewriter is optional; the export stands without it
        return OrtFusions(error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    model.CopyFrom(proto)
    if not model.metadata_props and metadata:
        model.metadata_props.extend(metadata)
    unname_unread_statistics(model)
    after = _op_counts(model)
    gained = {op: n for op, n in after.items() if op not in before}
    return OrtFusions(counts={k: int(v) for k, v in counts.items() if v}, ops=gained)


def unname_unread_statistics(model: onnx.ModelProto) -> int:
    """The norms' statistics outputs that no node and no graph output reads, unnamed (trailing
    ones dropped); returns how many."""
    read = set(read_names(model.graph)) | {o.name for o in model.graph.output}
    count = 0
    for node in model.graph.node:
        for i in STATISTICS.get(node.op_type, ()):
            if i < len(node.output) and node.output[i] and node.output[i] not in read:
                node.output[i] = ""
                count += 1
        while len(node.output) > 1 and not node.output[-1]:
            node.output.pop()
    return count


def _op_counts(model: onnx.ModelProto) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


@contextlib.contextmanager
def _quiet():
    logger = logging.getLogger("onnxscript")
    level = logger.level
    try:
        logger.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
