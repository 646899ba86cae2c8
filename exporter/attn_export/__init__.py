"""attn-export: a fused multi-head attention operator for PyTorch, with model surgery,
ONNX export and parity validation built around it.

    >>> import attn_export
    >>> layer = attn_export.FusedMultiheadAttention(embed_dim=64, num_heads=4, batch_first=True)
    >>> out, weights = layer(x, x, x)
    >>> report = attn_export.replace_attention(model)            # in place
    >>> attn_export.restore_attention(model, report)             # undone
    >>> attn_export.export_onnx(model, {"src": x}, "model.onnx")
    >>> attn_export.validate(original, "model.onnx", {"src": x}).passed
    >>> attn_export.convert(model, {"src": x}, attn_export.ConvertOptions("model.onnx")).passed

Importing the package loads the compiled operators (``torch.ops.attn_export.*``); the ONNX
pieces (``export_onnx``, ``validate``) import onnx/onnxruntime on first use.
"""
from attn_export.ops import (  # loads the compiled operators first
    CausalAlignment,
    FusedMultiheadAttention,
    attention,
    gemm_backend,
    multi_head_attention,
    set_gemm_backend,
)
from attn_export.surgery.replace import (
    CoverageError,
    ReplacementReport,
    inspect_attention,
    replace_attention,
    restore_attention,
)

from attn_export._version import __version__

_LAZY = {
    "export_onnx": ("attn_export.onnx", "export_onnx"),
    "ExportResult": ("attn_export.onnx", "ExportResult"),
    "validate": ("attn_export.validation", "validate"),
    "ValidationReport": ("attn_export.validation", "ValidationReport"),
    "load_model": ("attn_export.loading", "load_model"),
    "heatmaps": ("attn_export.maps.heatmaps", "heatmaps"),
    "convert": ("attn_export.conversion", "convert"),
    "ConvertOptions": ("attn_export.conversion", "ConvertOptions"),
    "ConvertResult": ("attn_export.conversion", "ConvertResult"),
    # the option groups of the steps (attn_export/options.py)
    **{name: ("attn_export.options", name)
       for name in ("ExportOptions", "OrtOptions", "EngineOptions", "CoverageOptions", "GateOptions")},
    # hand-written attention fused in PyTorch; importing it registers torch.compile(backend="attn_export")
    "fuse_patterns": ("attn_export.surgery.fuse", "fuse_patterns"),
    "compile_backend": ("attn_export.surgery.fuse", "backend"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'attn_export' has no attribute {name!r}")


__all__ = [
    "FusedMultiheadAttention", "attention", "CausalAlignment", "multi_head_attention",
    "replace_attention", "inspect_attention", "restore_attention", "ReplacementReport", "CoverageError",
    "export_onnx", "ExportResult", "validate", "ValidationReport", "load_model", "heatmaps",
    "convert", "ConvertOptions", "ConvertResult", "fuse_patterns", "compile_backend",
    "ExportOptions", "OrtOptions", "EngineOptions", "CoverageOptions", "GateOptions",
    "gemm_backend", "set_gemm_backend", "__version__",
]
