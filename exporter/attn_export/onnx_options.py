"""The ONNX export's choices, named once: how each fused layer is written (``--onnx-attention``),
where the custom nodes' bodies go (``--onnx-functions``) and the default-domain opsets. The CLI
(cli/_options.py), ``ConvertOptions`` (conversion.py) and ``export_onnx`` (onnx/pipeline.py)
read them from here. Light on purpose (no torch, no onnx at import): the CLI imports it to build
its options without loading the exporter.
"""
from __future__ import annotations

from typing import Optional

from attn_export import spec as _spec
from attn_export.errors import InputError

# How each fused layer is written: the custom FusedAttention node (with its model-local function
# and the TensorRT plugin), the standard Attention operator (docs/onnx_node.md), or ONNX
# Runtime's own contrib operators (GroupQueryAttention, MultiHeadAttention; ONNX Runtime only).
ATTENTION_FLAVORS = ("custom", "standard", "ort")
DEFAULT_ATTENTION = "custom"
# Where the custom nodes' bodies go: model-local functions called by the nodes (the TensorRT
# plugin maps the nodes), or written inline into the graph for runtimes and tools that do not
# read model-local functions (OpenVINO, onnx.version_converter; docs/onnx_consumers.md).
FUNCTION_MODES = ("local", "inline")
DEFAULT_FUNCTIONS = "local"

# Default-domain opsets: the smallest the node's function bodies are written for (the spec's
# kMinOnnxOpset), the default of a custom-node export, and the first with the standard
# Attention operator (also the default of a standard export).
MIN_OPSET = _spec.load().min_onnx_opset
DEFAULT_OPSET = 20
STANDARD_MIN_OPSET = 23


def check_choices(attention: str, functions: str) -> None:
    """InputError (exit 2) for an unknown flavor or function mode, naming the option and its values."""
    if attention not in ATTENTION_FLAVORS:
        raise InputError(f"unknown ONNX attention flavor {attention!r} "
                         f"(--onnx-attention {attention}: one of {', '.join(ATTENTION_FLAVORS)})")
    if functions not in FUNCTION_MODES:
        raise InputError(f"unknown ONNX function mode {functions!r} "
                         f"(--onnx-functions {functions}: one of {', '.join(FUNCTION_MODES)})")


def check_standard_opset(opset: Optional[int]) -> None:
    """InputError (exit 2) for an opset the standard operator does not exist in; None: the default."""
    if opset is not None and opset < STANDARD_MIN_OPSET:
        raise InputError(f"--onnx-attention standard needs --opset {STANDARD_MIN_OPSET} or later (the standard "
                         f"Attention operator is opset {STANDARD_MIN_OPSET}); got {opset}")


def export_opset(opset: Optional[int], attention: str) -> int:
    """The opset to export with: `opset`, or the flavor's default; InputError outside what the
    flavor and the installed onnx support."""
    import onnx

    standard = attention == "standard"
    if opset is None:
        opset = STANDARD_MIN_OPSET if standard else DEFAULT_OPSET
    opset = int(opset)
    if standard:
        check_standard_opset(opset)
    newest = onnx.defs.onnx_opset_version()
    if opset < MIN_OPSET or opset > newest:
        raise InputError(f"--opset {opset}: supported are {MIN_OPSET}..{newest}")
    return opset
