"""The options of the library's steps, in groups, declared once: what ``export_onnx`` writes
(:class:`ExportOptions`), how ONNX Runtime runs in the gate (:class:`OrtOptions`), how the
TensorRT engine is built (:class:`EngineOptions`), the replacement-coverage gate
(:class:`CoverageOptions`) and how the parity gate runs (:class:`GateOptions`).

    from attn_export.options import ExportOptions, GateOptions, OrtOptions

    export_onnx(model, inputs, "m.onnx", ExportOptions(dtype="fp16"))
    validate(model, "m.onnx", inputs, ort=OrtOptions(providers=("cpu", "cuda")), gate=GateOptions(seed=1))

Each group is a frozen dataclass that checks its values when it is made (InputError, exit 2,
naming the CLI flag). The CLI's option groups (cli/_options.py) build these same objects, and
``ConvertOptions``, what ``convert`` does, is made of them. Light on purpose (no torch, no onnx at
import): the CLI imports it to build its options.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

from attn_export.errors import InputError
from attn_export.onnx_options import DEFAULT_ATTENTION, DEFAULT_FUNCTIONS, check_choices, check_standard_opset

# The precisions an export can be written in (ExportOptions.dtype; None: the model's own).
EXPORT_DTYPE_NAMES = ("fp32", "fp16", "bf16")
# Weight-only quantization of the ort flavor's MatMul weights (ExportOptions.quantize; None: none).
QUANTIZE_NAMES = ("int4", "int8")
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_NEW_TOKENS = 16


# ExportOptions.last_logits where ConvertOptions writes genai_config.json and the user chose
# neither: the last position's logits where the language-model head is found.
LAST_LOGITS_IF_FOUND = "if-found"


@dataclass(frozen=True)
class ExportOptions:
    """What ``export_onnx`` writes (onnx/pipeline.py).

    ``dynamic_axes``: input -> {axis: label}, each of which must come out dynamic; ``{}``
    exports static shapes. Default (None): dim 0 "batch" and dim 1 a sequence label for every
    input of rank 2 or 3, the batch of 4-D images (attn_export.inputs.default_axes; for
    transformers models attn_export.surgery.transformers.default_axes), where a default axis
    the model specializes stays static with a note. The inputs' batch axes come out as one
    symbol ``batch`` where the example's sizes agree, and so does a label given to several axes
    (attn_export.onnx.dims).

    ``attention``: "custom" (default), one FusedAttention node per layer with its model-local
    function; "standard", one standard ``Attention`` node (opset >= 23) per layer where it can
    express the layer, the custom node where not (the result's ``kept_custom`` says why).
    ``functions``: "local" (default), each custom node calls its model-local function;
    "inline", the bodies are written into the graph, no custom node is left (for runtimes that
    do not read model-local functions; the TensorRT plugin then has nothing to map).

    ``with_past``: a transformers decoder-only causal LM with its key/value cache, one graph
    for prefill and decode under Optimum's names (attn_export.onnx.with_past,
    docs/huggingface.md); the example inputs are ``input_ids`` [, ``attention_mask``] and
    ``dynamic_axes`` stays None.

    ``quantize``: "int4" or "int8", the 2-D weights of the MatMuls quantized by ONNX Runtime's
    own quantizer into ``com.microsoft.MatMulNBits`` (block 32, symmetric, as ONNX Runtime
    GenAI's builder's ``-p int4``; onnx/ort/quantize.py); the ort flavor only.

    ``last_logits``: with ``with_past``, a decoder-only LM's ``logits`` for the last position only
    ([batch, 1, vocab], what generation reads; onnx/last_logits.py): the prompt's other positions
    are not run through the language-model head, a large share of a prompt's time with a large
    vocabulary. None (the default) leaves it to where the file goes: ``ConvertOptions`` that
    writes ``genai_config.json`` (ONNX Runtime GenAI's generator reads the last position only)
    makes it ``LAST_LOGITS_IF_FOUND``, the last position's wherever the head is found (every
    position's otherwise, and the report says why), and False elsewhere. True fails the export
    where the head is not found; False keeps every position's logits (a perplexity needs them).
    """

    opset: Optional[int] = None  # the default-domain opset (>= 18); None: 20, or 23 for the standard flavor
    dtype: Optional[str] = None  # "fp32" | "fp16" | "bf16": exports in that precision; None: the model's own
    attention: str = DEFAULT_ATTENTION  # how each fused layer is written (onnx_options.ATTENTION_FLAVORS)
    functions: str = DEFAULT_FUNCTIONS  # where the custom nodes' bodies go (onnx_options.FUNCTION_MODES)
    dynamic_axes: Optional[Mapping[str, Mapping[int, str]]] = None  # the axes that must come out dynamic
    with_past: bool = False  # a decoder exported with its key/value cache
    replace: bool = True  # run attn_export.replace_attention on the exported copy first
    seed: int = 0  # for the inputs the trace resizes or makes (a past for with_past)
    quiet: bool = True  # silence torch's exporter
    quantize: Optional[str] = None  # "int4" | "int8": weight-only MatMulNBits (the ort flavor); None: float weights
    last_logits: Optional[bool | str] = None  # with_past: the logits of the last position only; None: see above

    def __post_init__(self) -> None:
        check_choices(self.attention, self.functions)
        if self.quantize is not None and self.quantize not in QUANTIZE_NAMES:
            raise InputError(f"--quantize {self.quantize}: one of {', '.join(QUANTIZE_NAMES)}")
        if self.quantize is not None and self.attention != "ort":
            raise InputError(f"--quantize {self.quantize} writes ONNX Runtime's MatMulNBits, which only the ort "
                             f"flavor targets: add --onnx-attention ort (got --onnx-attention {self.attention})")
        if self.quantize is not None and self.dtype not in (None, "fp32"):
            raise InputError(f"--quantize {self.quantize} quantizes float32 weights (the activations stay float32, "
                             f"as in ONNX Runtime GenAI's CPU int4 models): leave out --dtype {self.dtype}")
        if self.last_logits not in (None, True, False, LAST_LOGITS_IF_FOUND):
            raise InputError(f"last_logits must be true, false or None (the default), got {self.last_logits!r}")
        if self.last_logits and not self.with_past:
            raise InputError("--last-logits is for a decoder exported with its cache, whose generation reads the last "
                             "position's logits: add --with-past")
        if self.attention == "standard":
            check_standard_opset(self.opset)
        if self.dtype is not None and self.dtype not in EXPORT_DTYPE_NAMES:
            raise InputError(f"--dtype {self.dtype}: one of {', '.join(EXPORT_DTYPE_NAMES)}")


@dataclass(frozen=True)
class OrtOptions:
    """ONNX Runtime's execution providers in the gate (validation/providers.py): each provider is
    its own backend row, in this order."""

    providers: Sequence[str] = ("cpu",)
    trt_cache_dir: Optional[str | Path] = None  # the TensorRT provider's engine cache (created if missing)
    trt_fp16: bool = False  # let the TensorRT provider build float16 kernels (the tolerance follows)

    def __post_init__(self) -> None:
        # The names and their combinations are checked where the gate resolves them
        # (validation/providers.parse_providers), which imports ONNX Runtime's helpers.
        object.__setattr__(self, "providers", tuple(self.providers))

    @property
    def wants_tensorrt(self) -> bool:
        return "tensorrt" in self.providers

    @property
    def given(self) -> bool:
        """Anything but the defaults (the CPU provider alone)."""
        return self != OrtOptions()


@dataclass(frozen=True)
class EngineOptions:
    """The TensorRT engine: the plugin library and the optimization profile (tensorrt/)."""

    # The FusedAttention plugin library (default: as tensorrt.find_plugin_library finds it); also
    # loaded by ONNX Runtime's TensorRT provider.
    plugin: Optional[str | Path] = None
    # input -> dims; unnamed inputs keep the profile's defaults (tensorrt/profiles.py).
    min_shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)
    opt_shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)
    max_shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)
    workspace_mib: Optional[int] = None  # TensorRT's workspace limit; None: TensorRT's own
    # A cached export: the longest context (past + new tokens) the engine takes (default: the
    # model config's max_position_embeddings; tensorrt/cache_profile.py).
    max_context: Optional[int] = None

    def __post_init__(self) -> None:
        if self.workspace_mib is not None and self.workspace_mib < 1:
            raise InputError(f"--workspace-mib {self.workspace_mib}: at least 1")
        if self.max_context is not None and self.max_context < 2:
            raise InputError(f"--max-context {self.max_context}: at least 2")

    @property
    def profile_given(self) -> bool:
        """Any build setting beside the plugin."""
        return dataclasses.replace(self, plugin=None) != EngineOptions()

    def overrides(self) -> dict:
        """The profile's keyword arguments (tensorrt.derive_profile, cached_profile)."""
        return {"min_shapes": dict(self.min_shapes), "opt_shapes": dict(self.opt_shapes),
                "max_shapes": dict(self.max_shapes)}


@dataclass(frozen=True)
class CoverageOptions:
    """The replacement-coverage gate: at least ``min_replaced`` attention sites fused, or all of
    them with ``require_all``."""

    min_replaced: Optional[int] = None
    require_all: bool = False

    def __post_init__(self) -> None:
        if self.min_replaced is not None and self.min_replaced < 0:
            raise InputError(f"--min-replaced {self.min_replaced}: at least 0")

    def problem(self, report) -> Optional[str]:
        """What the ReplacementReport fails of the gate, or None."""
        return report.coverage_error(self.min_replaced, self.require_all)


@dataclass(frozen=True)
class GateOptions:
    """How the parity gate runs (validation/gate.py)."""

    seed: int = 0  # for the inputs of the shape cases and the prompts of the generation gate
    # How long ONNX Runtime or TensorRT may take to load the model or run one case before it
    # counts as hung (a failed case).
    runtime_timeout_s: float = DEFAULT_TIMEOUT_S
    new_tokens: int = DEFAULT_NEW_TOKENS  # a cached export: the greedy tokens generated
    # A cached export is checked by generating. None: so when the model has generate(); True:
    # the file must be a cached export; False: the shape cases whatever the file.
    generation: Optional[bool] = None
    # TensorRT in a child process too (ONNX Runtime always runs in one); False keeps the engine
    # in this process (for a stand-in engine).
    isolate: bool = True
    # A cached export also generates through ONNX Runtime GenAI's generator (its own backend row)
    # when onnxruntime-genai is installed. None: where genai_config.json is beside the file;
    # True: also without one (the gate writes one into a temporary folder); False: never.
    genai: Optional[bool] = None

    def __post_init__(self) -> None:
        if not self.runtime_timeout_s > 0:
            raise InputError(f"--runtime-timeout {self.runtime_timeout_s}: more than 0 seconds")
        if self.new_tokens < 1:
            raise InputError(f"new_tokens must be at least 1, got {self.new_tokens}")


def with_fields(group_cls, given, fields: Mapping[str, object], where: str):
    """``given`` (else the defaults) with ``fields``, a function's keyword shorthand for its
    group's fields (``export_onnx(..., dtype="fp16")``); TypeError for a keyword that is none."""
    names = [f.name for f in dataclasses.fields(group_cls)]
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword argument(s) {', '.join(unknown)} "
                        f"(its {group_cls.__name__} fields: {', '.join(names)})")
    base = given if given is not None else group_cls()
    return dataclasses.replace(base, **fields) if fields else base


# validate()'s and ConvertOptions' former flat names of the ONNX Runtime group.
_ORT_FLAT = {"ort_providers": "providers", "ort_trt_cache_dir": "trt_cache_dir", "ort_trt_fp16": "trt_fp16"}


def pop_legacy_ort(fields: dict, ort: Optional[OrtOptions], where: str) -> Optional[OrtOptions]:
    """``ort`` with the deprecated ``ort_providers=``/``ort_trt_cache_dir=``/``ort_trt_fp16=``
    keywords of ``fields`` (removed from it) applied; they warn."""
    flat = {_ORT_FLAT[name]: fields.pop(name) for name in list(fields) if name in _ORT_FLAT}
    if not flat:
        return ort
    warnings.warn(f"{where}(ort_providers=..., ort_trt_*=...) is deprecated: pass "
                  f"ort=OrtOptions({', '.join(f'{k}=...' for k in flat)}) (attn_export.options)",
                  DeprecationWarning, stacklevel=3)
    return dataclasses.replace(ort or OrtOptions(), **flat)


TARGETS = ("onnx", "tensorrt")

# ConvertOptions' flat keywords (its fields before the groups): each is the field of a group.
# ``seed`` seeds both the export and the gate; ``verbose`` is the export's ``quiet`` negated.
_FLAT = {
    **{name: ("export", name) for name in ("opset", "dtype", "attention", "functions", "dynamic_axes", "with_past",
                                           "replace", "quantize", "last_logits")},
    **{name: ("ort", field_name) for name, field_name in _ORT_FLAT.items()},
    **{name: ("engine", name) for name in ("plugin", "min_shapes", "opt_shapes", "max_shapes", "workspace_mib",
                                           "max_context")},
    **{name: ("coverage", name) for name in ("min_replaced", "require_all")},
    "runtime_timeout_s": ("gate", "runtime_timeout_s"),
    "seed": ("export", "seed"),  # read from the export's; given, the gate's too
}


@dataclass(frozen=True, init=False)
class ConvertOptions:
    """What ``convert`` writes and checks. ``output`` is the ONNX file (``to="onnx"``) or the
    engine (``to="tensorrt"``, the ONNX then goes to ``onnx_output``, default beside it).

        ConvertOptions("m.engine", to="tensorrt", export=ExportOptions(dtype="fp16"),
                       engine=EngineOptions(max_shapes={"src": (8, 512, 64)}))

    A group's field may also be given by its name alone, as shorthand: ``ConvertOptions("m.onnx",
    with_past=True)`` is ``ConvertOptions("m.onnx", export=ExportOptions(with_past=True))``
    (applied over a group given too); the ONNX Runtime fields keep their former ``ort_`` names
    (``ort_providers``), ``seed`` sets the export's and the gate's, ``verbose`` the export's
    ``quiet`` (negated). Reading a field that way (``options.with_past``) still works but is
    deprecated: read the group's (``options.export.with_past``).
    """

    output: Path  # given as a str or a Path
    to: str = "onnx"
    onnx_output: Optional[Path] = None
    export: ExportOptions = field(default_factory=ExportOptions)
    ort: OrtOptions = field(default_factory=OrtOptions)
    engine: EngineOptions = field(default_factory=EngineOptions)
    coverage: CoverageOptions = field(default_factory=CoverageOptions)
    gate: GateOptions = field(default_factory=GateOptions)
    # With export.with_past: genai_config.json beside the ONNX file, for ONNX Runtime GenAI (genai_config.py).
    genai_config: bool = False
    validate: bool = True  # run the parity gate on what was written

    def __init__(self, output: str | Path, to: str = "onnx", onnx_output: Optional[str | Path] = None,
                 **settings) -> None:
        groups = {f.name: settings.pop(f.name, None) or f.default_factory()
                  for f in dataclasses.fields(self) if f.default_factory is not dataclasses.MISSING}
        plain = {name: settings.pop(name) for name in ("genai_config", "validate") if name in settings}
        flat = _flat_by_group(settings)
        for name, group in groups.items():
            object.__setattr__(self, name, dataclasses.replace(group, **flat[name]) if flat.get(name) else group)
        onnx_output = Path(onnx_output) if onnx_output is not None else None
        for name, value in {"output": Path(output), "to": to, "onnx_output": onnx_output, "genai_config": False,
                            "validate": True, **plain}.items():
            object.__setattr__(self, name, value)
        self.__post_init__()
        if self.export.last_logits is None:
            # ONNX Runtime GenAI's generator reads the last position's logits only (docs/cli.md).
            last = LAST_LOGITS_IF_FOUND if self.genai_config else False
            object.__setattr__(self, "export", dataclasses.replace(self.export, last_logits=last))

    def __post_init__(self) -> None:
        if self.to not in TARGETS:
            raise InputError(f"unknown target {self.to!r}: one of {', '.join(TARGETS)}")
        if self.genai_config and not self.export.with_past:
            raise InputError("genai_config (--genai-config) describes a cached export: add with_past (--with-past)")
        if self.engine.max_context is not None and not (self.export.with_past and self.to == "tensorrt"):
            raise InputError("max_context (--max-context) sizes the engine of a cached export: it goes with "
                             "--with-past --to tensorrt")

    def __getattr__(self, name: str):
        # Only called for names that are not fields: the flat names of before the groups.
        if name not in _FLAT and name != "verbose":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        group, field_name = _FLAT.get(name, ("export", "quiet"))
        warnings.warn(f"ConvertOptions.{name} is deprecated: read ConvertOptions.{group}.{field_name}"
                      + (" (negated)" if name == "verbose" else ""), DeprecationWarning, stacklevel=2)
        value = getattr(getattr(self, group), field_name)
        return not value if name == "verbose" else value


def _flat_by_group(settings: Mapping[str, object]) -> dict:
    """{group: {field: value}} of ConvertOptions' flat keywords; TypeError for an unknown one."""
    out: dict = {}
    for name, value in settings.items():
        if name == "seed":
            out.setdefault("export", {})["seed"] = value
            out.setdefault("gate", {})["seed"] = value
        elif name == "verbose":  # the export's quiet, negated
            out.setdefault("export", {})["quiet"] = not value
        elif name in _FLAT:
            group, field_name = _FLAT[name]
            out.setdefault(group, {})[field_name] = value
        else:
            raise TypeError(f"ConvertOptions() got an unexpected keyword argument {name!r}")
    return out


__all__ = ["ExportOptions", "OrtOptions", "EngineOptions", "CoverageOptions", "GateOptions", "ConvertOptions", "TARGETS",
           "EXPORT_DTYPE_NAMES", "DEFAULT_TIMEOUT_S", "DEFAULT_NEW_TOKENS"]
