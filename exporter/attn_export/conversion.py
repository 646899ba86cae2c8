"""The whole job of ``attn-export MODEL --to onnx|tensorrt`` as one library call.

    from attn_export import ConvertOptions, convert
    from attn_export.options import ExportOptions

    result = convert(model, {"src": torch.randn(2, 16, 64)}, ConvertOptions(output="model.onnx"))
    result = convert(model, inputs, ConvertOptions("llama.onnx", export=ExportOptions(with_past=True)))
    assert result.passed, result.failures

Steps, each of which may end the run: the TensorRT and ONNX Runtime preflight (nothing is
exported when the target could not be built or checked), the replacement plan and its coverage
gate, the export (and the gate again on what ran), the engine build, the parity validation.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping, Optional, Protocol

import torch
from torch import nn

from attn_export.errors import EXIT_MISMATCH, EXIT_OK, InputError
from attn_export.options import TARGETS, ConvertOptions, OrtOptions  # noqa: F401 - TARGETS, ConvertOptions: public here

class Progress(Protocol):
    """Where ``convert`` tells what it does; the CLI prints it, the default stays silent."""

    def step(self, what: str) -> ContextManager[Callable[[str], None]]: ...

    def note(self, message: str) -> None: ...

    def plan(self, report, after_export: bool) -> None: ...

    def exported(self, onnx_path: Path, export) -> None: ...

    def engine_built(self, engine_path: Path, info) -> None: ...


class Silent:
    def step(self, what: str):
        return contextlib.nullcontext(lambda _detail: None)

    def note(self, message: str) -> None:
        pass

    def plan(self, report, after_export: bool) -> None:
        pass

    def exported(self, onnx_path: Path, export) -> None:
        pass

    def engine_built(self, engine_path: Path, info) -> None:
        pass


@dataclass
class ConvertResult:
    """What ``convert`` did. ``coverage_problem`` set: the gate stopped the run (before the
    export when ``export`` is None). ``report``: the validation, None when skipped or stopped."""

    onnx_path: Path
    engine_path: Optional[Path]
    plan: Any  # ReplacementReport before the export
    export: Any = None  # ExportResult
    engine: Any = None  # EngineInfo
    report: Any = None  # ValidationReport
    coverage_problem: Optional[str] = None

    @property
    def passed(self) -> bool:
        return self.coverage_problem is None and (self.report is None or self.report.passed)

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.passed else EXIT_MISMATCH

    @property
    def failures(self) -> list[str]:
        if self.coverage_problem:
            return [self.coverage_problem]
        return list(self.report.failures) if self.report is not None else []

    def to_dict(self) -> dict:
        """The extra sections of the JSON report beside the validation's own."""
        out = {"export": self.export.to_dict()} if self.export is not None else {}
        if self.engine is not None:
            out["engine"] = self.engine.to_dict()
        return out


@dataclass(frozen=True)
class Target:
    """What the preflight found: the plugin library the engine and the validation load (None:
    none needed)."""

    plugin: Optional[str]


def convert(model: nn.Module, inputs: Mapping[str, torch.Tensor], options: ConvertOptions,
            progress: Optional[Progress] = None, target: Optional[Target] = None) -> ConvertResult:
    """Replace the attention of ``model`` by the fused operator, export it to ONNX (and build a
    TensorRT engine), and validate the files against the model. Raises InputError (and
    TensorRT's or ONNX Runtime's own errors) when something needed is missing; a mismatch or a
    failed coverage gate is in the result, not raised. ``target``: the result of ``preflight``
    when the caller ran it already (the CLI does, before it loads the model)."""
    progress = progress or Silent()
    onnx_path, engine_path = _paths(options)
    _check_encoder_decoder(model, options)
    plugin = (target or preflight(options, progress)).plugin

    from attn_export.surgery.replace import inspect_attention

    max_context = _max_context(model, options) if engine_path is not None and options.export.with_past else None
    result = ConvertResult(onnx_path=onnx_path, engine_path=engine_path, plan=inspect_attention(model, inputs))
    if options.export.replace:
        progress.plan(result.plan, after_export=False)
        # Modules of no known form may hold hand-written attention that the export rewrites: then
        # the gate waits for the export's report.
        undecided = any(layer.status == "skipped" and not layer.found for layer in result.plan.layers)
        if not undecided and (problem := options.coverage.problem(result.plan)):
            result.coverage_problem = problem
            return result

    result.export = _export(model, inputs, onnx_path, options, progress)
    progress.exported(onnx_path, result.export)
    final = result.export.replacement
    if final is not None:
        if [(s.path, s.status) for s in final.layers] != [(s.path, s.status) for s in result.plan.layers]:
            progress.plan(final, after_export=True)
        if problem := options.coverage.problem(final):
            result.coverage_problem = f"{problem} (when the model ran)"
            return result
    if engine_path is not None:
        result.engine = _build_engine(onnx_path, engine_path, inputs, result.export, plugin, options, progress,
                                      max_context)
        progress.engine_built(engine_path, result.engine)
    if options.validate:
        from attn_export.validation import validate

        with progress.step("validating against the original model") as update:
            result.report = validate(model, onnx_path, inputs, dynamic_axes=options.export.dynamic_axes,
                                     engine=engine_path, plugin=plugin, ort=options.ort, gate=options.gate,
                                     progress=update)
    return result


def _check_encoder_decoder(model: nn.Module, options: ConvertOptions) -> None:
    """An encoder-decoder's cached export is a pair of ONNX files checked in ONNX Runtime: no
    engine or GenAI config of the pair is built yet."""
    from attn_export.onnx.with_past import is_encoder_decoder

    if options.export.with_past and (options.to == "tensorrt" or options.genai_config) and is_encoder_decoder(model):
        raise InputError("--with-past exports an encoder-decoder as two ONNX files (docs/huggingface.md, "
                         "\"Encoder-decoders\"); a TensorRT engine or a GenAI config of the pair is not built: "
                         "drop --to tensorrt / --genai-config")


def _paths(options: ConvertOptions) -> tuple[Path, Optional[Path]]:
    """(the ONNX file, the engine or None)."""
    output = Path(options.output)
    if options.to == "onnx":
        if options.onnx_output is not None:
            raise InputError("onnx_output (--onnx-output) goes with the TensorRT target")
        return output, None
    onnx_path = Path(options.onnx_output) if options.onnx_output else output.with_suffix(".onnx")
    if onnx_path.resolve() == output.resolve():
        raise InputError(f"the ONNX file and the engine would both be {onnx_path}; give -o or --onnx-output")
    return onnx_path, output


def preflight(options: ConvertOptions, progress: Optional[Progress] = None) -> Target:
    """Everything the target and the validation need, checked before the model is touched:
    nothing is exported when the engine could not be built or the export not be checked."""
    progress = progress or Silent()
    _paths(options)
    plugin = str(options.engine.plugin) if options.engine.plugin else None
    if options.to == "tensorrt":
        from attn_export import tensorrt as attn_trt

        attn_trt.require_runtime()
        if options.export.attention == "custom" or plugin:
            plugin = attn_trt.find_plugin_library(plugin)
            attn_trt.check_plugin_library(plugin)
        else:
            progress.note("note: standard attention: TensorRT's ONNX parser maps each Attention node to its own "
                          "attention layer; the engine is built without the FusedAttention plugin")
    if options.validate:
        require_providers(options.ort, options.gate.runtime_timeout_s, plugin)
        from attn_export.validation.runners import prestart_onnxruntime

        prestart_onnxruntime(options.gate.runtime_timeout_s)  # ONNX Runtime's process starts while the model exports
    return Target(plugin=plugin)


def require_providers(ort: OrtOptions, timeout_s: float, plugin: Optional[str]) -> None:
    """The providers are in this ONNX Runtime and a GPU is there, and for the TensorRT provider
    TensorRT and the plugin library (exit 2 saying what to install or build); the node-level
    preflight follows in the gate."""
    from attn_export.validation import providers

    names = providers.parse_providers(ort.providers, trt_cache_dir=ort.trt_cache_dir, trt_fp16=ort.trt_fp16)
    if names == providers.DEFAULT_PROVIDERS:
        return
    providers.require_providers(names, providers.probe(timeout_s))
    if ort.wants_tensorrt:
        from attn_export import tensorrt as attn_trt

        attn_trt.import_tensorrt()
        if plugin is not None:
            attn_trt.check_plugin_library(plugin)


def _export(model, inputs, onnx_path: Path, options: ConvertOptions, progress: Progress):
    from attn_export.onnx import export_onnx

    with progress.step(f"exporting to {onnx_path}"):
        export = export_onnx(model, inputs, onnx_path, options.export)
    for note in export.notes + (export.replacement.notes if export.replacement else []):
        progress.note(f"note: {note}")
    if options.genai_config:
        from attn_export.genai_config import write_genai_config

        written = write_genai_config(onnx_path, model.config)
        progress.note(f"wrote {written} (ONNX Runtime GenAI reads the export's directory)")
    return export


def _max_context(model, options: ConvertOptions) -> int:
    """The longest context of a cached export's engine, checked before anything is exported."""
    from attn_export.tensorrt.cache_profile import max_context_of

    return max_context_of(getattr(model, "config", None), options.engine.max_context)


def _profile(onnx_path: Path, inputs, options: ConvertOptions, max_context: Optional[int]):
    """The engine's optimization profile: from the graph's symbolic dimensions, or for a cached
    export from the cache's contract and the longest context (tensorrt/cache_profile.py)."""
    import onnx

    from attn_export import tensorrt as attn_trt

    model = onnx.load(str(onnx_path), load_external_data=False)
    overrides = options.engine.overrides()
    if max_context is None:
        return attn_trt.derive_profile(model, inputs, **overrides)
    from attn_export.cache_contract import CacheContract

    contract = CacheContract.require(model, onnx_path)
    return attn_trt.cached_profile(model, contract, max_context=max_context, batch=int(inputs["input_ids"].shape[0]),
                                   **overrides)


def _build_engine(onnx_path: Path, engine_path: Path, inputs, export, plugin: Optional[str],
                  options: ConvertOptions, progress: Progress, max_context: Optional[int] = None):
    from attn_export import tensorrt as attn_trt

    if export.num_attention_nodes and not plugin:
        raise InputError(f"{export.num_attention_nodes} layer(s) kept the custom node (see the notes), so the "
                         "engine needs the FusedAttention plugin: give --plugin, or build it (docs/tensorrt.md)")
    profile = _profile(onnx_path, inputs, options, max_context)
    for line in profile.lines():
        progress.note(f"profile {line}")
    with progress.step(f"building the TensorRT engine {engine_path}") as update:
        return attn_trt.build_engine(onnx_path, engine_path, plugin=plugin, profile=profile,
                                     workspace_mib=options.engine.workspace_mib, progress=update)
