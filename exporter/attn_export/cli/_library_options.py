"""The flags of the library's option groups (attn_export.options), declared once: each
decorator hands the verb the library's own object (``export: ExportOptions``, ``ort:
OrtOptions``, ``engine: EngineOptions``, ``coverage: CoverageOptions``, ``gate:
GateOptions``), made from its flags, so that the command line and ``convert``/``validate``
called from Python take the same objects.
"""
from __future__ import annotations

from typing import Optional, Tuple

import click

from attn_export.cli._options import _grouped
from attn_export.options import DEFAULT_NEW_TOKENS, DEFAULT_TIMEOUT_S, EXPORT_DTYPE_NAMES, QUANTIZE_NAMES
from attn_export.options import CoverageOptions, EngineOptions, ExportOptions, GateOptions, OrtOptions
from attn_export.onnx_options import (
    ATTENTION_FLAVORS, DEFAULT_ATTENTION, DEFAULT_FUNCTIONS, DEFAULT_OPSET, FUNCTION_MODES, MIN_OPSET,
    STANDARD_MIN_OPSET,
)


def _choice(flag: str, dest: str, choices, default, help: str):
    return click.option(flag, dest, type=click.Choice(choices), default=default, show_default=True, help=help)


def _export_options(opset: Optional[int], onnx_attention: str, onnx_functions: str, dtype: Optional[str],
                    with_past: bool, no_replace: bool, quantize: Optional[str] = None,
                    last_logits: Optional[bool] = None) -> ExportOptions:
    """The export group of the flags; the verb adds what it learns from the model (the axes,
    the seed, ``quiet``)."""
    return ExportOptions(opset=opset, attention=onnx_attention, functions=onnx_functions, dtype=dtype,
                         with_past=with_past, replace=not no_replace, quantize=quantize, last_logits=last_logits)


def export_options(f):
    """What the export writes: ``export: ExportOptions``."""
    return _grouped(_export_options, "export", [
        click.option("--opset", type=int, default=None, metavar="N",
                     help=f"ONNX opset ({MIN_OPSET} and up; default {DEFAULT_OPSET}, with --onnx-attention standard "
                          f"{STANDARD_MIN_OPSET} and up, default {STANDARD_MIN_OPSET})."),
        _choice("--onnx-attention", "onnx_attention", ATTENTION_FLAVORS, DEFAULT_ATTENTION,
                "custom: one attn_export.FusedAttention node per layer (with its model-local function; TensorRT "
                f"runs it as the plugin). standard: one standard ONNX Attention node (opset {STANDARD_MIN_OPSET}; "
                f"--opset defaults to {STANDARD_MIN_OPSET}) that ONNX Runtime and TensorRT implement themselves, "
                "no plugin; a layer it cannot express keeps the custom node and the output says why."),
        _choice("--onnx-functions", "onnx_functions", FUNCTION_MODES, DEFAULT_FUNCTIONS,
                "local: each custom node calls its model-local function (ONNX Runtime inlines it, TensorRT maps the "
                "node to the plugin). inline: the bodies are written into the graph, no custom node and no function "
                "left, for runtimes and tools that do not read model-local functions (OpenVINO, "
                "onnx.version_converter); TensorRT then runs plain ops, not the plugin."),
        click.option("--dtype", type=click.Choice(EXPORT_DTYPE_NAMES), default=None,
                     help="Export in this precision (default: the model's own)."),
        click.option("--with-past", "with_past", is_flag=True,
                     help="Export a transformers decoder-only causal LM with its key/value cache (Optimum's "
                          "names): one graph for prefill and decode (--to onnx, or --to tensorrt with "
                          "--max-context)."),
        click.option("--no-replace", is_flag=True,
                     help="Export the model as it is, without fusing its attention layers."),
        click.option("--quantize", type=click.Choice(QUANTIZE_NAMES), default=None,
                     help="With --onnx-attention ort: the MatMul weights quantized (weight-only, block 32, "
                          "symmetric) by ONNX Runtime's quantizer into its MatMulNBits operator, as ONNX Runtime "
                          "GenAI's builder's -p int4; the gate compares with the model carrying the same "
                          "dequantized weights."),
        click.option("--last-logits/--all-logits", "last_logits", default=None,
                     help="With --with-past: the logits of the last position only ([batch, 1, vocab], what "
                          "generation reads), so a prompt runs one row through the language-model head instead of "
                          "one per token (ONNX Runtime GenAI's builder's prune_lm_head), or every position's "
                          "(for scoring a prompt). Default: the last position's with --genai-config, every "
                          "position's otherwise."),
    ])(f)


def ort_options(f):
    """ONNX Runtime's execution providers in the gate: ``ort: OrtOptions``."""
    return _grouped(OrtOptions, "ort", [
        click.option("--ort-provider", "providers", multiple=True, default=("cpu",), show_default=True,
                     type=click.Choice(["cpu", "cuda", "tensorrt"]),
                     help="Run the ONNX file in ONNX Runtime on this execution provider (repeatable: each is its "
                          "own row of the report, in the order given). cuda and tensorrt need onnxruntime-gpu "
                          "(pip install 'attn-export[gpu]') and an NVIDIA GPU; tensorrt also TensorRT and, for "
                          "FusedAttention nodes, the plugin library (--plugin)."),
        click.option("--ort-trt-cache", "trt_cache_dir", metavar="DIR", type=click.Path(file_okay=False),
                     help="With --ort-provider tensorrt: keep TensorRT's engines in DIR (created if missing) so "
                          "that the next run does not rebuild them."),
        click.option("--ort-trt-fp16", "trt_fp16", is_flag=True,
                     help="With --ort-provider tensorrt: let TensorRT use float16 kernels (the tolerance is "
                          "float16's then)."),
    ])(f)


_PLUGIN = click.option(
    "--plugin", "plugin", metavar="LIB.so", type=click.Path(dir_okay=False),
    help="The FusedAttention TensorRT plugin library (plugins/tensorrt). Default: $ATTN_EXPORT_TRT_PLUGIN, "
         "else build/tensorrt/libattn_export_trt_plugin.so of the source checkout.")


def plugin_option(f):
    """The plugin library alone (``plugin: str``), for a verb that builds no engine."""
    return _PLUGIN(f)


def _shapes(texts: Tuple[str, ...], which: str) -> dict:
    if not texts:
        return {}
    from attn_export.tensorrt.profiles import parse_shape_specs

    return parse_shape_specs(texts, f"--{which}-shapes")


def _engine_options(plugin: Optional[str], min_shapes: Tuple[str, ...], opt_shapes: Tuple[str, ...],
                    max_shapes: Tuple[str, ...], workspace_mib: Optional[int], max_context: Optional[int]) -> EngineOptions:
    return EngineOptions(plugin=plugin, min_shapes=_shapes(min_shapes, "min"), opt_shapes=_shapes(opt_shapes, "opt"),
                         max_shapes=_shapes(max_shapes, "max"), workspace_mib=workspace_mib, max_context=max_context)


def engine_options(f):
    """The TensorRT engine: the plugin library and the optimization profile (trtexec's
    --minShapes/--optShapes/--maxShapes): ``engine: EngineOptions``."""
    return _grouped(_engine_options, "engine", [
        _PLUGIN,
        click.option("--min-shapes", "min_shapes", multiple=True, metavar="NAME:DIMS",
                     help="Smallest shapes of the engine's inputs, NAME:DIMS (repeatable or comma-separated, e.g. "
                          "src:1x1x64). Dimensions the ONNX graph ties together take one value; the others keep "
                          "their defaults. Default: 1 for every dynamic dimension."),
        click.option("--opt-shapes", "opt_shapes", multiple=True, metavar="NAME:DIMS",
                     help="Shapes TensorRT tunes for, as --min-shapes. Default: the example inputs' shapes."),
        click.option("--max-shapes", "max_shapes", multiple=True, metavar="NAME:DIMS",
                     help="Largest shapes, as --min-shapes. Default: 4 x the example sizes, and at least every "
                          "size the validation sweeps."),
        click.option("--workspace-mib", type=click.IntRange(min=1), metavar="MIB",
                     help="TensorRT's workspace memory limit (default: TensorRT's, the GPU's memory)."),
        click.option("--max-context", "max_context", type=click.IntRange(min=2), metavar="N",
                     help="With --with-past: the longest context (past + new tokens) the engine takes; the past "
                          "axis runs from 0 to N-1, the attention mask's to N. Default: the model config's "
                          "max_position_embeddings (docs/tensorrt.md, \"Cached decoders\")."),
    ])(f)


def coverage_options(f):
    """The replacement-coverage gate: ``coverage: CoverageOptions``."""
    return _grouped(CoverageOptions, "coverage", [
        click.option("--min-replaced", type=click.IntRange(min=0), metavar="N",
                     help="Fail (exit 1) when fewer than N attention layers end up fused."),
        click.option("--require-all", is_flag=True,
                     help="Fail (exit 1) when any attention layer cannot be fused."),
    ])(f)


def _gate_options(runtime_timeout: float, new_tokens: int) -> GateOptions:
    """The gate group of the flags; the verb adds the seed (--seed, of the inputs' group)."""
    return GateOptions(runtime_timeout_s=runtime_timeout, new_tokens=new_tokens)


def gate_options(f):
    """How the parity gate runs: ``gate: GateOptions``."""
    return _grouped(_gate_options, "gate", [
        click.option("--runtime-timeout", "runtime_timeout", type=click.FloatRange(min=0, min_open=True),
                     default=DEFAULT_TIMEOUT_S, show_default=True, metavar="SECONDS",
                     help="ONNX Runtime and TensorRT load and run the model in a child process: a crash (e.g. a "
                          "segfault) or a hang longer than this is reported as a failed case (exit 1) with the "
                          "reports written."),
        click.option("--new-tokens", "new_tokens", type=click.IntRange(min=1), default=DEFAULT_NEW_TOKENS,
                     show_default=True,
                     help="A cached export (--with-past): how many greedy tokens the generation gate generates."),
    ])(f)
