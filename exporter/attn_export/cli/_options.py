"""Option groups shared by the verbs, declared once (Polygraphy's argument groups).

Each group's options reach the verb as ONE object (``model_args: ModelArgs``,
``input_args: InputArgs``, ...) that also knows what to do with them, so a verb's signature
names the groups it takes rather than every flag.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import click

from attn_export.onnx_options import (
    ATTENTION_FLAVORS, DEFAULT_ATTENTION, DEFAULT_FUNCTIONS, FUNCTION_MODES, STANDARD_MIN_OPSET,
)


def _apply(options):
    def decorator(f):
        for option in reversed(options):
            f = option(f)
        return f

    return decorator


def _grouped(group_cls, keyword: str, options):
    """The options, collected into one ``group_cls`` instance passed to the verb as ``keyword``."""
    names = [f.name for f in dataclasses.fields(group_cls)]

    def decorator(f):
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            kwargs[keyword] = group_cls(**{name: kwargs.pop(name) for name in names})
            return f(*args, **kwargs)

        return _apply(options)(wrapper)

    return decorator


@dataclass(frozen=True)
class ModelArgs:
    """How the model is loaded (--model, --config, --weights, --allow-class, --trust-model-file)."""

    factory: Optional[str]
    hf_config: Optional[str]
    weights: Optional[str]
    allow_class: Tuple[str, ...]
    trust_model_file: bool

    def load(self, model_path: Optional[str], seed: int = 0):
        """(model, description); see attn_export.cli._common.load_model."""
        from attn_export.cli._common import load_model

        return load_model(model_path, self, seed=seed)


@dataclass(frozen=True)
class InputArgs:
    """Example inputs and dynamic axes (--input, --example-inputs, --dynamic, --static, --seed)."""

    input_specs: Tuple[str, ...]
    example_file: Optional[str]
    dynamic: Tuple[str, ...]
    static: bool
    seed: int

    @property
    def axes_given(self) -> bool:
        return bool(self.dynamic or self.static)

    def example_inputs(self, model):
        from attn_export.cli._common import example_inputs

        return example_inputs(model, self.input_specs, self.example_file, self.seed)

    def axes(self, inputs, model=None):
        from attn_export.cli._common import resolve_axes

        return resolve_axes(inputs, self.dynamic, self.static, model=model)


@dataclass(frozen=True)
class SampleArgs:
    """Example inputs for the sample forward that finds the attention calls (--input,
    --example-inputs, --seed); inspect runs it when inputs can be had."""

    input_specs: Tuple[str, ...]
    example_file: Optional[str]
    seed: int

    def example_inputs(self, model):
        """The inputs, or None where none were given and the model has none of its own."""
        from attn_export.cli._common import example_inputs
        from attn_export.errors import InputError

        try:
            return example_inputs(model, self.input_specs, self.example_file, self.seed)
        except InputError:
            if self.input_specs or self.example_file:
                raise
            return None


@dataclass(frozen=True)
class CoverageArgs:
    """The replacement-coverage gate (--min-replaced, --require-all)."""

    min_replaced: Optional[int]
    require_all: bool

    def problem(self, plan) -> Optional[str]:
        return plan.coverage_error(self.min_replaced, self.require_all)


@dataclass(frozen=True)
class ReportArgs:
    """Machine-readable reports (--json, --junit)."""

    json_path: Optional[str]
    junit_path: Optional[str]


@dataclass(frozen=True)
class ProfileArgs:
    """The TensorRT optimization profile (--min/--opt/--max-shapes, --workspace-mib, --max-context)."""

    min_shapes: Tuple[str, ...]
    opt_shapes: Tuple[str, ...]
    max_shapes: Tuple[str, ...]
    workspace_mib: Optional[int]
    max_context: Optional[int]

    @property
    def given(self) -> bool:
        return bool(self.min_shapes or self.opt_shapes or self.max_shapes or self.workspace_mib
                    or self.max_context is not None)

    def shape_specs(self) -> dict:
        """{"min"|"opt"|"max": {input: dims}}, parsed (InputError on a malformed spec)."""
        from attn_export import tensorrt as attn_trt

        return {which: attn_trt.parse_shape_specs(texts, f"--{which}-shapes")
                for which, texts in (("min", self.min_shapes), ("opt", self.opt_shapes), ("max", self.max_shapes))}


@dataclass(frozen=True)
class OrtArgs:
    """ONNX Runtime's execution providers in the gate (--ort-provider, --ort-trt-cache, --ort-trt-fp16)."""

    providers: Tuple[str, ...]
    trt_cache_dir: Optional[str]
    trt_fp16: bool

    @property
    def wants_tensorrt(self) -> bool:
        return "tensorrt" in self.providers

    @property
    def given(self) -> bool:
        return tuple(self.providers) != ("cpu",) or self.trt_cache_dir is not None or self.trt_fp16

    def require(self, timeout_s: float, plugin: Optional[str]) -> None:
        """Before anything is loaded or exported (conversion.require_providers)."""
        from attn_export.conversion import require_providers

        require_providers(self.providers, self.trt_cache_dir, self.trt_fp16, timeout_s, plugin)

    def validate_kwargs(self) -> dict:
        return {"ort_providers": self.providers, "ort_trt_cache_dir": self.trt_cache_dir,
                "ort_trt_fp16": self.trt_fp16}


def model_options(f):
    """How the model is loaded: ``model_args: ModelArgs``."""
    return _grouped(ModelArgs, "model_args", [
        click.option("--model", "factory", metavar="MODULE:FACTORY",
                     help="Build the model by calling FACTORY() from MODULE (importable; the current "
                          "directory is on the path) instead of loading a MODEL file. "
                          "transformers:CLASS (e.g. transformers:AutoModelForCausalLM) loads a Hugging Face "
                          "model with that class: from the save_pretrained folder MODEL, or from --config."),
        click.option("--config", "hf_config", metavar="PATH",
                     type=click.Path(exists=True, file_okay=True, dir_okay=True),
                     help="With --model transformers:CLASS: a config.json (or a folder holding one); the "
                          "model is built from it with random weights (seeded by --seed where the verb has it)."),
        click.option("--weights", metavar="FILE", type=click.Path(dir_okay=False),
                     help="With --model: a state_dict file, loaded weights-only (no code runs)."),
        click.option("--allow-class", "allow_class", multiple=True, metavar="MODULE:CLASS",
                     help="Also allow this class when loading MODEL (repeatable). It is imported by name "
                          "from the installed package. Models built from torch.nn alone need none."),
        click.option("--trust-model-file", is_flag=True,
                     help="Load MODEL with full unpickling. DANGER: this EXECUTES CODE stored in the file; "
                          "only for files you trust. Without it, MODEL is loaded weights-only with an "
                          "audited allowlist of torch.nn classes."),
    ])(f)


_INPUT_HELP = ("An example input, trtexec style (repeatable): src:2x16x64, ids:1x32:int64, "
               "mask:2x16:bool. NAME is a parameter of the model's forward; random values "
               "(integers below the smallest embedding table, boolean masks as padding masks).")


def sample_input_options(f):
    """Example inputs for inspect's sample forward: ``sample: SampleArgs``."""
    return _grouped(SampleArgs, "sample", [
        click.option("--input", "input_specs", multiple=True, metavar="NAME:DIMS[:DTYPE]", help=_INPUT_HELP),
        click.option("--example-inputs", "example_file", metavar="FILE.pt", type=click.Path(dir_okay=False),
                     help="A torch.save-d dict name -> tensor (loaded weights-only)."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed for generated inputs."),
    ])(f)


def input_options(f):
    """Example inputs and dynamic axes: ``input_args: InputArgs``."""
    return _grouped(InputArgs, "input_args", [
        click.option("--input", "input_specs", multiple=True, metavar="NAME:DIMS[:DTYPE]", help=_INPUT_HELP),
        click.option("--example-inputs", "example_file", metavar="FILE.pt", type=click.Path(dir_okay=False),
                     help="A torch.save-d dict name -> tensor (loaded weights-only). The names become the "
                          "ONNX input names."),
        click.option("--dynamic", "dynamic", multiple=True, metavar="NAME:DIM=LABEL",
                     help="Make axis DIM of input NAME symbolic with this label (repeatable; replaces that "
                          "input's defaults). Default: dim 0 of every input is 'batch', dim 1 a sequence "
                          "('seq' for the first input, '<name>_seq' for others). Labels containing 'batch' "
                          "are swept as batch sizes by the validator, others as sequence lengths."),
        click.option("--static", is_flag=True, help="No dynamic axes: export at the example shapes."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed for generated inputs."),
    ])(f)


def coverage_options(f):
    """The replacement-coverage gate: ``coverage: CoverageArgs``."""
    return _grouped(CoverageArgs, "coverage", [
        click.option("--min-replaced", type=click.IntRange(min=0), metavar="N",
                     help="Fail (exit 1) when fewer than N attention layers end up fused."),
        click.option("--require-all", is_flag=True,
                     help="Fail (exit 1) when any attention layer cannot be fused."),
    ])(f)


def report_options(f):
    """``reports: ReportArgs``."""
    return _grouped(ReportArgs, "reports", [
        click.option("--json", "json_path", metavar="FILE", type=click.Path(dir_okay=False),
                     help="Write the report as JSON (top-level 'passed')."),
        click.option("--junit", "junit_path", metavar="FILE", type=click.Path(dir_okay=False),
                     help="Write the validation cases as JUnit XML."),
    ])(f)


def runtime_timeout_option(f):
    """How long a runtime may take before it counts as hung (``runtime_timeout: float``)."""
    return click.option(
        "--runtime-timeout", "runtime_timeout", type=click.FloatRange(min=0, min_open=True), default=300.0,
        show_default=True, metavar="SECONDS",
        help="ONNX Runtime and TensorRT load and run the model in a child process: a crash (e.g. a segfault) "
             "or a hang longer than this is reported as a failed case (exit 1) with the reports written.",
    )(f)


def onnx_attention_option(f):
    """How the fused layers are written in ONNX (``onnx_attention: str``)."""
    return click.option(
        "--onnx-attention", "onnx_attention", type=click.Choice(ATTENTION_FLAVORS), default=DEFAULT_ATTENTION,
        show_default=True,
        help="custom: one attn_export.FusedAttention node per layer (with its model-local function; TensorRT runs "
             f"it as the plugin). standard: one standard ONNX Attention node (opset {STANDARD_MIN_OPSET}; --opset "
             f"defaults to {STANDARD_MIN_OPSET}) "
             "that ONNX Runtime and TensorRT implement themselves, no plugin; a layer it cannot express keeps the "
             "custom node and the output says why. ort: ONNX Runtime's own contrib operators (GroupQueryAttention, "
             "MultiHeadAttention) and graph fusions, for ONNX Runtime and ONNX Runtime GenAI ONLY (no other runtime "
             "reads the com.microsoft domain); a layer they cannot express keeps the custom node and the output says why.",
    )(f)


def onnx_functions_option(f):
    """Where the custom nodes' bodies go (``onnx_functions: str``)."""
    return click.option(
        "--onnx-functions", "onnx_functions", type=click.Choice(FUNCTION_MODES), default=DEFAULT_FUNCTIONS,
        show_default=True,
        help="local: each custom node calls its model-local function (ONNX Runtime inlines it, TensorRT maps the "
             "node to the plugin). inline: the bodies are written into the graph, no custom node and no function "
             "left, for runtimes and tools that do not read model-local functions (OpenVINO, "
             "onnx.version_converter); TensorRT then runs plain ops, not the plugin.",
    )(f)


def logging_options(f):
    return _apply([
        click.option("-q", "--quiet", is_flag=True, help="Print errors only (the exit code tells the verdict)."),
        click.option("-v", "--verbose", is_flag=True, help="Show library warnings and tracebacks."),
    ])(f)


def ort_options(f):
    """ONNX Runtime's execution providers: ``ort_args: OrtArgs``."""
    return _grouped(OrtArgs, "ort_args", [
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


def plugin_option(f):
    return click.option(
        "--plugin", "plugin", metavar="LIB.so", type=click.Path(dir_okay=False),
        help="The FusedAttention TensorRT plugin library (plugins/tensorrt). Default: $ATTN_EXPORT_TRT_PLUGIN, "
             "else build/tensorrt/libattn_export_trt_plugin.so of the source checkout.",
    )(f)


def profile_options(f):
    """The TensorRT engine's optimization profile (trtexec's --minShapes/--optShapes/--maxShapes):
    ``profile_args: ProfileArgs``."""
    return _grouped(ProfileArgs, "profile_args", [
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
