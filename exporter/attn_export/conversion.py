"""The whole job of ``attn-export MODEL --to onnx|tensorrt`` as one library call.

    from attn_export import ConvertOptions, convert

    result = convert(model, {"src": torch.randn(2, 16, 64)}, ConvertOptions(output="model.onnx"))
    assert result.passed, result.failures

Steps, each of which may end the run: the TensorRT and ONNX Runtime preflight (nothing is
exported when the target could not be built or checked), the replacement plan and its coverage
gate, the export (and the gate again on what ran), the engine build, the parity validation.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping, Optional, Protocol, Sequence

import torch
from torch import nn

from attn_export.errors import EXIT_MISMATCH, EXIT_OK, InputError
from attn_export.onnx_options import DEFAULT_ATTENTION, DEFAULT_FUNCTIONS, check_choices, check_standard_opset

TARGETS = ("onnx", "tensorrt")


@dataclass(frozen=True)
class ConvertOptions:
    """What ``convert`` writes and checks. ``output`` is the ONNX file (``to="onnx"``) or the
    engine (``to="tensorrt"``, the ONNX then goes to ``onnx_output``, default beside it)."""

    output: str | Path
    to: str = "onnx"
    onnx_output: Optional[str | Path] = None
    opset: Optional[int] = None
    attention: str = DEFAULT_ATTENTION  # or "standard": the standard Attention node (onnx_options.py)
    functions: str = DEFAULT_FUNCTIONS  # or "inline": the custom nodes' bodies written into the graph
    dtype: Optional[str] = None  # "fp32" | "fp16" | "bf16"; default: the model's own
    # A transformers decoder-only causal LM exported with its key/value cache (onnx/with_past.py).
    with_past: bool = False
    # With with_past: genai_config.json beside the ONNX file, for ONNX Runtime GenAI (genai_config.py).
    genai_config: bool = False
    replace: bool = True
    validate: bool = True
    dynamic_axes: Optional[Mapping[str, Mapping[int, str]]] = None
    seed: int = 0
    # The coverage gate: at least this many attention sites fused, or all of them.
    min_replaced: Optional[int] = None
    require_all: bool = False
    ort_providers: Sequence[str] = ("cpu",)
    ort_trt_cache_dir: Optional[str] = None
    ort_trt_fp16: bool = False
    # TensorRT: the plugin library (default: found as find_plugin_library does) and the profile.
    plugin: Optional[str | Path] = None
    min_shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)
    opt_shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)
    max_shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)
    workspace_mib: Optional[int] = None
    # With with_past and to="tensorrt": the longest context (past + new tokens) the engine takes
    # (default: the model config's max_position_embeddings; tensorrt/cache_profile.py).
    max_context: Optional[int] = None
    runtime_timeout_s: float = 300.0
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.to not in TARGETS:
            raise InputError(f"unknown target {self.to!r}: one of {', '.join(TARGETS)}")
        check_choices(self.attention, self.functions)
        if self.genai_config and not self.with_past:
            raise InputError("genai_config (--genai-config) describes a cached export: add with_past (--with-past)")
        if self.max_context is not None and not (self.with_past and self.to == "tensorrt"):
            raise InputError("max_context (--max-context) sizes the engine of a cached export: it goes with "
                             "--with-past --to tensorrt")


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
    plugin = (target or preflight(options, progress)).plugin

    from attn_export.surgery.replace import inspect_attention

    max_context = _max_context(model, options) if engine_path is not None and options.with_past else None
    result = ConvertResult(onnx_path=onnx_path, engine_path=engine_path, plan=inspect_attention(model, inputs))
    if options.replace:
        progress.plan(result.plan, after_export=False)
        # Modules of no known form may hold hand-written attention that the export rewrites: then
        # the gate waits for the export's report.
        undecided = any(layer.status == "skipped" and not layer.found for layer in result.plan.layers)
        if not undecided and (problem := _coverage_problem(result.plan, options)):
            result.coverage_problem = problem
            return result

    result.export = _export(model, inputs, onnx_path, options, progress)
    progress.exported(onnx_path, result.export)
    final = result.export.replacement
    if final is not None:
        if [(s.path, s.status) for s in final.layers] != [(s.path, s.status) for s in result.plan.layers]:
            progress.plan(final, after_export=True)
        if problem := _coverage_problem(final, options):
            result.coverage_problem = f"{problem} (when the model ran)"
            return result
    if engine_path is not None:
        result.engine = _build_engine(onnx_path, engine_path, inputs, result.export, plugin, options, progress,
                                      max_context)
        progress.engine_built(engine_path, result.engine)
    if options.validate:
        from attn_export.validation import validate

        with progress.step("validating against the original model") as update:
            result.report = validate(
                model, onnx_path, inputs, dynamic_axes=options.dynamic_axes, seed=options.seed,
                progress=update, engine=engine_path, plugin=plugin, runtime_timeout_s=options.runtime_timeout_s,
                ort_providers=options.ort_providers, ort_trt_cache_dir=options.ort_trt_cache_dir,
                ort_trt_fp16=options.ort_trt_fp16)
    return result


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
    plugin = str(options.plugin) if options.plugin else None
    if options.attention == "standard":
        check_standard_opset(options.opset)
    if options.to == "tensorrt":
        from attn_export import tensorrt as attn_trt

        attn_trt.require_runtime()
        if options.attention == "custom" or plugin:
            plugin = attn_trt.find_plugin_library(plugin)
            attn_trt.check_plugin_library(plugin)
        else:
            progress.note("note: standard attention: TensorRT's ONNX parser maps each Attention node to its own "
                          "attention layer; the engine is built without the FusedAttention plugin")
    if options.validate:
        require_providers(options.ort_providers, options.ort_trt_cache_dir, options.ort_trt_fp16,
                          options.runtime_timeout_s, plugin)
        from attn_export.validation.runners import prestart_onnxruntime

        prestart_onnxruntime(options.runtime_timeout_s)  # ONNX Runtime's process starts while the model exports
    return Target(plugin=plugin)


def require_providers(ort_providers: Sequence[str], trt_cache_dir: Optional[str], trt_fp16: bool,
                      timeout_s: float, plugin: Optional[str]) -> None:
    """The providers are in this ONNX Runtime and a GPU is there, and for the TensorRT provider
    TensorRT and the plugin library (exit 2 saying what to install or build); the node-level
    preflight follows in the gate."""
    from attn_export.validation import providers

    names = providers.parse_providers(ort_providers, trt_cache_dir=trt_cache_dir, trt_fp16=trt_fp16)
    if names == providers.DEFAULT_PROVIDERS:
        return
    providers.require_providers(names, providers.probe(timeout_s))
    if "tensorrt" in ort_providers:
        from attn_export import tensorrt as attn_trt

        attn_trt.import_tensorrt()
        if plugin is not None:
            attn_trt.check_plugin_library(plugin)


def _coverage_problem(report, options: ConvertOptions) -> Optional[str]:
    return report.coverage_error(options.min_replaced, options.require_all)


def _export(model, inputs, onnx_path: Path, options: ConvertOptions, progress: Progress):
    from attn_export.onnx import export_onnx

    with progress.step(f"exporting to {onnx_path}"):
        export = export_onnx(model, inputs, onnx_path, opset=options.opset, dtype=options.dtype,
                             dynamic_axes=options.dynamic_axes, replace=options.replace,
                             quiet=not options.verbose, seed=options.seed, attention=options.attention,
                             functions=options.functions, with_past=options.with_past)
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

    return max_context_of(getattr(model, "config", None), options.max_context)


def _profile(onnx_path: Path, inputs, options: ConvertOptions, max_context: Optional[int]):
    """The engine's optimization profile: from the graph's symbolic dimensions, or for a cached
    export from the cache's contract and the longest context (tensorrt/cache_profile.py)."""
    import onnx

    from attn_export import tensorrt as attn_trt

    model = onnx.load(str(onnx_path), load_external_data=False)
    overrides = {"min_shapes": dict(options.min_shapes), "opt_shapes": dict(options.opt_shapes),
                 "max_shapes": dict(options.max_shapes)}
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
                                     workspace_mib=options.workspace_mib, progress=update)
