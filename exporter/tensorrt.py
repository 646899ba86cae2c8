"""TensorRT: the FusedAttention plugin library, engines with dynamic-shape profiles, running them.

    >>> from attn_export import tensorrt as attn_trt
    >>> plugin = attn_trt.find_plugin_library()                  # --plugin, $ATTN_EXPORT_TRT_PLUGIN, build/tensorrt/
    >>> profile = attn_trt.derive_profile(onnx.load("model.onnx"), example_inputs)
    >>> info = attn_trt.build_engine("model.onnx", "model.engine", plugin=plugin, profile=profile)
    >>> outputs = attn_trt.EngineRunner("model.engine", plugin=plugin).run(example_inputs)

The plugin (plugins/tensorrt/) runs the ``attn_export.FusedAttention`` nodes with the same CUDA
kernels as the PyTorch operator. Before anything is built, :func:`preflight` checks that the
library loads, that it registers a creator under exactly the name/version/namespace the nodes
ask for with the fields the nodes carry, and that the nodes' types are ones the plugin
supports, and says what is wrong in words (instead of the parser's "Plugin not found").

Precision follows TensorRT's strongly typed rules: the engine computes in the ONNX file's types
(export with ``--dtype fp16`` for a float16 engine); no precision flags are set.

Everything here that does not need TensorRT (profiles, node requests, the preflight's logic
with a registry passed in, the library checks) is tested without it; the rest imports
``tensorrt`` when called and raises :class:`TensorRTUnavailable` (exit 2) saying what to
install when TensorRT or a GPU is missing.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import onnx
import torch

from attn_export import spec as _spec
from attn_export._errors import AttnExportError, InputError, first_line as _first_line
from attn_export._io import atomic_output, write_text

PLUGIN_ENV = "ATTN_EXPORT_TRT_PLUGIN"
PLUGIN_FILENAME = "libattn_export_trt_plugin.so"
ENTRY_POINTS = ("getCreators", "setLoggerFinder")
SUPPORTED_ONNX_TYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
                        onnx.TensorProto.BFLOAT16: "bfloat16"}
MASK_ONNX_TYPE = onnx.TensorProto.FLOAT
ENGINE_META_SUFFIX = ".json"

INSTALL_TENSORRT = (
    "install TensorRT's Python package for your CUDA version (pip install tensorrt-cu13, or "
    "tensorrt-cu12 for CUDA 12; TensorRT 10 or newer) on a machine with an NVIDIA GPU; see docs/tensorrt.md"
)
BUILD_PLUGIN = (
    "build it with `cmake -S plugins/tensorrt -B build/tensorrt -DTENSORRT_ROOT=<TensorRT dir> && "
    "cmake --build build/tensorrt -j` (docs/tensorrt.md), then pass --plugin PATH or set "
    f"{PLUGIN_ENV}"
)


class TensorRTUnavailable(AttnExportError):
    """TensorRT's Python package or a usable GPU is missing (exit 2); the message says what to install."""


class PluginError(AttnExportError):
    """The plugin library cannot serve the model's nodes (exit 2); the message says why."""


class EngineError(AttnExportError):
    """Parsing, building, loading or running an engine failed (exit 2)."""


# --------------------------------------------------------------------------------------------
# TensorRT and the GPU
# --------------------------------------------------------------------------------------------

def import_tensorrt():
    """The ``tensorrt`` module, or TensorRTUnavailable saying what to install."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise TensorRTUnavailable(f"TensorRT is not installed ({_first_line(exc)}): {INSTALL_TENSORRT}") from exc
    except Exception as exc:  # noqa: BLE001 - e.g. the wheel's libraries fail to load
        raise TensorRTUnavailable(f"TensorRT failed to import ({_first_line(exc)}): {INSTALL_TENSORRT}") from exc
    major = _major_version(getattr(trt, "__version__", "0"))
    if major < 10:
        raise TensorRTUnavailable(
            f"TensorRT {trt.__version__} has no IPluginV3 support, which the FusedAttention plugin needs: "
            f"{INSTALL_TENSORRT}"
        )
    return trt


def require_gpu() -> None:
    """Engines are built and run on an NVIDIA GPU, through a CUDA build of PyTorch (for the buffers)."""
    if torch.version.cuda is None:
        raise TensorRTUnavailable(
            f"this PyTorch ({torch.__version__}) is a CPU build; TensorRT engines are built and run on an "
            "NVIDIA GPU with a CUDA build of PyTorch (e.g. pip install torch --index-url "
            "https://download.pytorch.org/whl/cu130)"
        )
    if not torch.cuda.is_available():
        raise TensorRTUnavailable(
            "no usable NVIDIA GPU (torch.cuda.is_available() is False: no GPU, or the driver is missing or too "
            "old); TensorRT engines are built and run on a GPU"
        )


def require_runtime():
    """TensorRT and a GPU, both checked (the first thing the CLI does for --to tensorrt / --engine)."""
    trt = import_tensorrt()
    require_gpu()
    return trt


def _major_version(version: str) -> int:
    m = re.match(r"(\d+)", str(version))
    return int(m.group(1)) if m else 0


# --------------------------------------------------------------------------------------------
# The plugin library
# --------------------------------------------------------------------------------------------

def default_plugin_paths() -> List[Path]:
    """Where the library is looked for when no path is given: the build folder of a source
    checkout (docs/tensorrt.md builds into build/tensorrt/)."""
    here = Path(__file__).resolve().parent
    return [here.parent / "build" / "tensorrt" / PLUGIN_FILENAME]


def find_plugin_library(explicit: Optional[str | os.PathLike] = None) -> Path:
    """The plugin library: ``explicit`` (--plugin), else $ATTN_EXPORT_TRT_PLUGIN, else the source
    checkout's build/tensorrt/. PluginError naming what was tried and how to build it."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise PluginError(f"plugin library {path}: no such file; {BUILD_PLUGIN}")
        return path
    env = os.environ.get(PLUGIN_ENV)
    if env:
        path = Path(env)
        if not path.is_file():
            raise PluginError(f"{PLUGIN_ENV}={env}: no such file; {BUILD_PLUGIN}")
        return path
    tried = default_plugin_paths()
    for path in tried:
        if path.is_file():
            return path
    raise PluginError(
        f"the FusedAttention plugin library was not found (no --plugin, no {PLUGIN_ENV}, not at "
        f"{', '.join(map(str, tried))}); {BUILD_PLUGIN}"
    )


@dataclass
class LibraryInfo:
    path: str
    sha256: str
    size: int


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_plugin_library(path: str | os.PathLike) -> LibraryInfo:
    """The library loads (its dependencies resolve) and exports TensorRT's entry points.
    PluginError with the loader's own words otherwise."""
    path = Path(path)
    if not path.is_file():
        raise PluginError(f"plugin library {path}: no such file; {BUILD_PLUGIN}")
    try:
        lib = ctypes.CDLL(str(path.resolve()))
    except OSError as exc:
        raise PluginError(
            f"plugin library {path} does not load: {_first_line(exc)} (a missing libcudart means the CUDA "
            "runtime the plugin was built with is not on the library path; see docs/tensorrt.md)"
        ) from exc
    missing = [name for name in ENTRY_POINTS if not hasattr(lib, name)]
    if missing:
        raise PluginError(
            f"{path} is not a TensorRT plugin library: it does not export {' and '.join(missing)} "
            f"(IPluginRegistry::loadLibrary needs {' and '.join(ENTRY_POINTS)})"
        )
    return LibraryInfo(path=str(path), sha256=file_sha256(path), size=path.stat().st_size)


_REGISTERED: Dict[str, object] = {}  # resolved library path -> handle (the registry is process-global)


def register_plugin_library(plugin: str | os.PathLike, registry, load_library: Optional[Callable[[str], object]] = None):
    """Loads the library into TensorRT's plugin registry, once per process and path (loading it
    twice would register its creators twice). PluginError when TensorRT refuses it."""
    key = path = str(Path(plugin).resolve())
    if key in _REGISTERED:
        return _REGISTERED[key]
    loader = load_library or registry.load_library
    try:
        handle = loader(path)
    except Exception as exc:  # noqa: BLE001 - TensorRT raises or returns None, depending on the version
        raise PluginError(f"TensorRT could not load the plugin library {plugin}: {_first_line(exc)}") from exc
    if handle is None:
        raise PluginError(f"TensorRT could not load the plugin library {plugin} (IPluginRegistry.load_library failed)")
    _REGISTERED[key] = handle
    return handle


# --------------------------------------------------------------------------------------------
# What the model's nodes ask for
# --------------------------------------------------------------------------------------------

@dataclass
class PluginRequest:
    """The plugin one or more FusedAttention nodes ask TensorRT's parser for."""

    name: str
    version: str
    namespace: str
    nodes: List[str] = field(default_factory=list)
    types: Dict[str, str] = field(default_factory=dict)  # node -> element type of its query

    def identity(self) -> str:
        return f"{self.name} version {self.version!r} namespace {self.namespace!r}"


def expected_fields() -> List[Tuple[str, str]]:
    """(name, PluginFieldType name) of every field the nodes hand the plugin creator: the ONNX
    node's attributes except plugin_version/plugin_namespace, INT -> INT32, FLOAT -> FLOAT32 (the
    parser's narrowing). tests/test_tensorrt_plugin.py holds the C++ field table to the same list."""
    from attn_export import onnx_node

    s = _spec.load()
    onnx_node.register_schema()
    schema = onnx.defs.get_schema(s.op_type, s.domain_version, s.domain)
    kinds = {onnx.defs.OpSchema.AttrType.INT: "INT32", onnx.defs.OpSchema.AttrType.FLOAT: "FLOAT32"}
    names = [a for a in s.attribute_names if a not in (s.attr_plugin_version, s.attr_plugin_namespace)]
    return [(name, kinds[schema.attributes[name].type]) for name in names]


def plugin_field_collection(trt, *, num_heads: int, scale: float, is_causal: bool = False,
                            has_key_padding_mask: bool = False, has_attn_mask: bool = False):
    """The fields for ``creator.create_plugin`` when a network is built by hand (e.g. by the
    torch2trt converter): the spec's names and the types of :func:`expected_fields`."""
    import numpy as np

    s = _spec.load()
    values = {s.attr_num_heads: num_heads, s.attr_scale: scale, s.attr_is_causal: int(is_causal),
              s.attr_has_key_padding_mask: int(has_key_padding_mask), s.attr_has_attn_mask: int(has_attn_mask)}
    fields = []
    for name, kind in expected_fields():
        array = np.array([values[name]], dtype=np.int32 if kind == "INT32" else np.float32)
        fields.append(trt.PluginField(name, array, getattr(trt.PluginFieldType, kind)))
    return trt.PluginFieldCollection(fields)


def _string_attr(node: onnx.NodeProto, name: str, default: str) -> str:
    for attr in node.attribute:
        if attr.name == name:
            value = onnx.helper.get_attribute_value(attr)
            return value.decode() if isinstance(value, bytes) else str(value)
    return default


def _value_types(model: onnx.ModelProto) -> Dict[str, int]:
    types: Dict[str, int] = {}
    for value in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        if value.type.HasField("tensor_type"):
            types[value.name] = value.type.tensor_type.elem_type
    for init in model.graph.initializer:
        types[init.name] = init.data_type
    return types


def plugin_requests(model: onnx.ModelProto) -> List[PluginRequest]:
    """One request per distinct (name, version, namespace) among the FusedAttention nodes, as
    TensorRT's parser reads them: op_type, and the plugin_version (default "1") and
    plugin_namespace (default "") attributes; the domain is ignored. The element types of the
    nodes' inputs come from the graph's type information (shape inference fills the gaps)."""
    from attn_export import onnx_node

    s = _spec.load()
    nodes = [n for n in model.graph.node if n.op_type == s.plugin_name]
    if not nodes:
        return []
    onnx_node.register_schema()  # for shape inference, and the inputs' type constraints
    formal = onnx.defs.get_schema(s.op_type, s.domain_version, s.domain).inputs  # type "T" or "M" (masks)
    types = _value_types(model)
    if any(i not in types for n in nodes for i in n.input):
        try:
            types = _value_types(onnx.shape_inference.infer_shapes(model))
        except Exception:  # noqa: BLE001 - types stay unknown; TensorRT will judge them
            pass
    requests: Dict[Tuple[str, str, str], PluginRequest] = {}
    for i, node in enumerate(nodes):
        key = (node.op_type, _string_attr(node, s.attr_plugin_version, "1"),
               _string_attr(node, s.attr_plugin_namespace, ""))
        request = requests.setdefault(key, PluginRequest(*key))
        label = node.name or f"{node.op_type}#{i}"
        request.nodes.append(label)
        t_types = {}
        for position, input_name in enumerate(node.input[:len(formal)]):
            elem = types.get(input_name)
            if elem is None:
                continue
            if formal[position].type_str == "M" and elem != MASK_ONNX_TYPE:
                raise PluginError(
                    f"node {label}: {s.input_names[position]} is {_onnx_type_name(elem)}; the plugin takes "
                    "float32 additive masks (re-export with this attn-export)"
                )
            if formal[position].type_str == "T":
                t_types[s.input_names[position]] = _onnx_type_name(elem)
        if len(set(t_types.values())) > 1:
            raise PluginError(f"node {label}: query, key and value must share one type; got {t_types}")
        if t_types:
            request.types[label] = next(iter(t_types.values()))
    return list(requests.values())


def _onnx_type_name(elem: int) -> str:
    return SUPPORTED_ONNX_TYPES.get(elem) or onnx.TensorProto.DataType.Name(elem).lower()


# --------------------------------------------------------------------------------------------
# Preflight
# --------------------------------------------------------------------------------------------

@dataclass
class PreflightReport:
    library: Optional[LibraryInfo]
    requests: List[PluginRequest]
    creators: List[str]  # "name version namespace" of every creator TensorRT had after loading the library
    notes: List[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "library": asdict(self.library) if self.library else None,
            "requests": [asdict(r) for r in self.requests],
            "creators": self.creators,
            "notes": self.notes,
        }


def _creator_fields(creator) -> List[Tuple[str, str]]:
    out = []
    for f in getattr(creator, "field_names", None) or []:
        kind = getattr(f.type, "name", str(f.type)).split(".")[-1]
        out.append((f.name, kind))
    return out


def _creator_identity(creator) -> Tuple[str, str, str]:
    return (creator.name, creator.plugin_version, creator.plugin_namespace)


def preflight(
    model: onnx.ModelProto,
    plugin: str | os.PathLike,
    *,
    registry=None,
    load_library: Optional[Callable[[str], object]] = None,
    compute_capability: Optional[Tuple[int, int]] = None,
) -> PreflightReport:
    """Checks, before any engine is built, everything the parser would otherwise report as
    "Plugin not found": the nodes' types are supported (float32/float16/bfloat16 query, key,
    value; float32 masks; bfloat16 needs compute capability 8.0+), the library loads and
    exports getCreators/setLoggerFinder, TensorRT registers a creator under exactly the
    name/version/namespace of the nodes, and that creator declares the fields the nodes carry.

    ``registry`` is TensorRT's plugin registry (``trt.get_plugin_registry()`` by default) and
    ``load_library`` its ``load_library``; tests pass stand-ins. Raises PluginError.
    """
    requests = plugin_requests(model)
    for request in requests:
        for node, type_name in request.types.items():
            if type_name not in SUPPORTED_ONNX_TYPES.values():
                raise PluginError(
                    f"node {node}: query is {type_name}; the FusedAttention plugin supports float32, float16 and "
                    "bfloat16 (export with --dtype fp32|fp16|bf16)"
                )
            if type_name == "bfloat16" and compute_capability is not None and compute_capability < (8, 0):
                raise PluginError(
                    f"node {node}: bfloat16 needs a GPU of compute capability 8.0 or newer; this one is "
                    f"{compute_capability[0]}.{compute_capability[1]} (export with --dtype fp16 or fp32)"
                )
    library = check_plugin_library(plugin)
    if registry is None:
        registry = import_tensorrt().get_plugin_registry()
    register_plugin_library(plugin, registry, load_library)
    registered = list(getattr(registry, "all_creators", []) or [])
    creators = [" ".join(repr(x) for x in _creator_identity(c)) for c in registered]
    want_fields = expected_fields()
    for request in requests:
        creator = registry.get_creator(request.name, request.version, request.namespace)
        if creator is None:
            same_name = [c for c in registered if c.name == request.name]
            if same_name:
                found = "; ".join(f"version {c.plugin_version!r} namespace {c.plugin_namespace!r}" for c in same_name)
                raise PluginError(
                    f"{len(request.nodes)} node(s) ask for plugin {request.identity()}, but TensorRT has "
                    f"{request.name} only as {found} (loaded from {plugin}). The model and the plugin come from "
                    "different attn-export versions: rebuild the plugin from the checkout that exported the "
                    "model, or re-export the model"
                )
            raise PluginError(
                f"{len(request.nodes)} node(s) ask for plugin {request.identity()}, but {plugin} registered no "
                f"creator of that name (TensorRT knows {len(registered)} creator(s)"
                + (": " + ", ".join(sorted({c.name for c in registered})[:12]) if registered else "")
                + ")"
            )
        have = _creator_fields(creator)
        if have and have != want_fields:
            raise PluginError(
                f"plugin {request.identity()} from {plugin} declares fields {have}, but the nodes carry "
                f"{want_fields}: the library was built from a different csrc/attention_spec.h; rebuild it"
            )
    notes = [] if requests else ["the model has no FusedAttention node: the engine needs no plugin"]
    return PreflightReport(library=library, requests=requests, creators=creators, notes=notes)


# --------------------------------------------------------------------------------------------
# Optimization profiles
# --------------------------------------------------------------------------------------------

Dims = Tuple[int, ...]


@dataclass
class ShapeProfile:
    """min/opt/max shape per engine input, and the size range of every symbolic dimension."""

    shapes: Dict[str, Tuple[Dims, Dims, Dims]]
    labels: Dict[str, Tuple[int, int, int]]

    def to_dict(self) -> dict:
        return {
            "inputs": {n: {"min": list(mn), "opt": list(op), "max": list(mx)} for n, (mn, op, mx) in self.shapes.items()},
            "dimensions": {lbl: {"min": a, "opt": b, "max": c} for lbl, (a, b, c) in self.labels.items()},
        }

    def lines(self) -> List[str]:
        fmt = lambda d: "x".join(map(str, d))  # noqa: E731
        return [f"{n}: min {fmt(mn)}  opt {fmt(op)}  max {fmt(mx)}" for n, (mn, op, mx) in self.shapes.items()]

    def outside(self, shapes: Mapping[str, Sequence[int]]) -> Optional[str]:
        """Why these input shapes fall outside the profile, or None."""
        for name, shape in shapes.items():
            if name not in self.shapes:
                continue
            mn, _, mx = self.shapes[name]
            for axis, (lo, size, hi) in enumerate(zip(mn, shape, mx)):
                if not lo <= size <= hi:
                    return f"{name}[{axis}]={size} is outside the engine's profile [{lo}, {hi}]"
        return None


def parse_shape_specs(texts: Sequence[str], option: str) -> Dict[str, Dims]:
    """trtexec-style ``NAME:DIMS`` specs (``src:1x16x64``), repeatable and/or comma-separated."""
    out: Dict[str, Dims] = {}
    for text in texts:
        for part in filter(None, (p.strip() for p in text.split(","))):
            m = re.fullmatch(r"([A-Za-z_][\w.\-/]*):(\d+(?:x\d+)*)", part)
            if not m:
                raise InputError(f"{option} {part!r}: expected NAME:DIMS, e.g. src:1x16x64")
            if m[1] in out:
                raise InputError(f"{option}: {m[1]} given twice")
            out[m[1]] = tuple(int(d) for d in m[2].split("x"))
    return out


def graph_input_dims(model: onnx.ModelProto) -> Dict[str, List[object]]:
    """Engine inputs (graph inputs that are not initializers) -> per axis: an int (static) or a
    label (str: the dim_param, or ``NAME:AXIS`` for an unnamed dynamic axis)."""
    inits = {i.name for i in model.graph.initializer}
    out: Dict[str, List[object]] = {}
    for value in model.graph.input:
        if value.name in inits:
            continue
        dims: List[object] = []
        for axis, d in enumerate(value.type.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            else:
                dims.append(d.dim_param if d.HasField("dim_param") and d.dim_param else f"{value.name}:{axis}")
        out[value.name] = dims
    return out


def derive_profile(
    model: onnx.ModelProto,
    example_inputs: Mapping[str, torch.Tensor],
    *,
    min_shapes: Optional[Mapping[str, Dims]] = None,
    opt_shapes: Optional[Mapping[str, Dims]] = None,
    max_shapes: Optional[Mapping[str, Dims]] = None,
) -> ShapeProfile:
    """One optimization profile from the ONNX graph's symbolic dimensions.

    Defaults per symbolic dimension (a dim_param shared by several inputs is one dimension):
    opt = its size in the example inputs; min = 1; max = 4 x the example size, and at least every
    size ``attn-export validate`` sweeps (batch 1, sequence 1, an odd and a long sequence), so that
    validating the engine checks every case. ``min_shapes``/``opt_shapes``/``max_shapes``
    (input -> full shape, as --min-shapes etc.) override the dimensions they mention; static
    dimensions must be given as they are. InputError when the shapes disagree.
    """
    from attn_export.validation import _label_kinds, shape_cases

    inputs = graph_input_dims(model)
    missing = [n for n in inputs if n not in example_inputs]
    if missing:
        raise InputError(f"the engine's input(s) {', '.join(missing)} have no example input to size the profile")
    example: Dict[str, int] = {}
    for name, dims in inputs.items():
        shape = tuple(example_inputs[name].shape)
        if len(shape) != len(dims):
            raise InputError(f"example input {name} has shape {list(shape)}, the ONNX input has rank {len(dims)}")
        for axis, (d, size) in enumerate(zip(dims, shape)):
            if isinstance(d, int) and d != size:
                raise InputError(f"example input {name}[{axis}] is {size}; the ONNX graph fixes it to {d}")
            if isinstance(d, str):
                example.setdefault(d, int(size))

    kinds = _label_kinds({n: {a: d for a, d in enumerate(dims) if isinstance(d, str)} for n, dims in inputs.items()})
    swept: Dict[str, int] = dict(example)
    for _, overrides in shape_cases(example, kinds):
        for label, size in overrides.items():
            swept[label] = max(swept[label], size)
    bounds = {label: [1, size, max(4 * size, swept[label])] for label, size in example.items()}

    for which, given, option in ((0, min_shapes, "--min-shapes"), (1, opt_shapes, "--opt-shapes"),
                                 (2, max_shapes, "--max-shapes")):
        set_here: Dict[str, Tuple[str, int]] = {}
        for name, shape in (given or {}).items():
            if name not in inputs:
                raise InputError(f"{option} {name}: no such engine input (inputs: {', '.join(inputs)})")
            dims = inputs[name]
            if len(shape) != len(dims):
                raise InputError(f"{option} {name}:{'x'.join(map(str, shape))}: {name} has rank {len(dims)}")
            for axis, (d, size) in enumerate(zip(dims, shape)):
                if isinstance(d, int):
                    if size != d:
                        raise InputError(f"{option} {name}[{axis}]={size}: that dimension is static ({d})")
                    continue
                if size < 1:
                    raise InputError(f"{option} {name}[{axis}]={size}: sizes must be >= 1")
                if d in set_here and set_here[d][1] != size:
                    raise InputError(
                        f"{option}: dimension {d!r} is {set_here[d][1]} in {set_here[d][0]} but {size} in "
                        f"{name}[{axis}] (the ONNX graph ties them together)"
                    )
                set_here[d] = (f"{name}[{axis}]", size)
                bounds[d][which] = size
    for label, (lo, opt, hi) in bounds.items():
        if not lo <= opt <= hi:
            raise InputError(f"profile for dimension {label!r}: need min <= opt <= max; got {lo}, {opt}, {hi}")

    shapes: Dict[str, Tuple[Dims, Dims, Dims]] = {}
    for name, dims in inputs.items():
        shapes[name] = tuple(  # type: ignore[assignment]
            tuple(d if isinstance(d, int) else bounds[d][which] for d in dims) for which in range(3)
        )
    return ShapeProfile(shapes=shapes, labels={lbl: tuple(b) for lbl, b in bounds.items()})  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# Engines: build
# --------------------------------------------------------------------------------------------

@dataclass
class EngineInfo:
    engine: str
    onnx: str
    tensorrt: str
    gpu: str
    plugin: Optional[Dict[str, object]]
    plugin_layers: int
    attention_nodes: int
    profile: Dict[str, object]
    inputs: Dict[str, str]
    outputs: Dict[str, str]
    seconds: float = 0.0
    notes: List[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _collecting_logger(trt):
    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: List[str] = []
            self.warnings: List[str] = []

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.errors.append(str(msg))
            elif severity == trt.ILogger.Severity.WARNING:
                self.warnings.append(str(msg))

    return Logger()


def _gpu_name() -> str:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"{props.name} (sm_{props.major}{props.minor})"


def _network_flags(trt) -> int:
    # Strongly typed: the ONNX types decide every layer's precision. TensorRT 11 is always
    # strongly typed (the flag is deprecated and ignored); TensorRT 10 needs it.
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def _without_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with the FusedAttention function removed, so that every TensorRT parser maps
    the nodes to the plugin (parsers before 10.15 prefer a model-local function of the same name)."""
    s = _spec.load()
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    keep = [f for f in stripped.functions if not (f.domain == s.domain and f.name == s.op_type)]
    del stripped.functions[:]
    stripped.functions.extend(keep)
    return stripped


def _parse_errors(parser) -> List[str]:
    out = []
    for i in range(parser.num_errors):
        err = parser.get_error(i)
        where = []
        for attr in ("node_name", "node_operator"):
            try:
                value = getattr(err, attr)()
            except Exception:  # noqa: BLE001 - older bindings lack some accessors
                value = ""
            if value:
                where.append(str(value))
        out.append(f"{err.desc()}" + (f" (node {' '.join(where)})" if where else ""))
    return out


def build_engine(
    onnx_path: str | os.PathLike,
    engine_path: str | os.PathLike,
    *,
    plugin: str | os.PathLike,
    profile: ShapeProfile,
    workspace_mib: Optional[int] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> EngineInfo:
    """Parses ``onnx_path`` (FusedAttention nodes -> the plugin), builds a strongly typed engine
    with one optimization profile and writes it to ``engine_path`` (whole or not at all), with
    ``engine_path + ".json"`` beside it: the plugin library (path, sha256) and identity the
    engine needs to be deserialized, the profile, the TensorRT version and the GPU."""
    import time

    say = progress or (lambda _msg: None)
    trt = require_runtime()
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    if not onnx_path.is_file():
        raise InputError(f"{onnx_path}: no such file")
    model = onnx.load(str(onnx_path))
    say("preflight: plugin library and creators")
    major, minor = torch.cuda.get_device_capability()
    report = preflight(model, plugin, compute_capability=(major, minor))
    nodes = sum(len(r.nodes) for r in report.requests)

    start = time.perf_counter()
    logger = _collecting_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    say("parsing the ONNX model")
    if not parser.parse(_without_functions(model).SerializeToString(), str(onnx_path)):
        errors = _parse_errors(parser) or logger.errors or ["(the parser gave no reason)"]
        raise EngineError(f"TensorRT's ONNX parser rejected {onnx_path}: " + "; ".join(errors[:5]))
    plugin_layers = sum(
        1 for i in range(network.num_layers)
        if network.get_layer(i).type == getattr(trt.LayerType, "PLUGIN_V3", None)
    )
    if plugin_layers != nodes:
        raise EngineError(
            f"the parsed network has {plugin_layers} FusedAttention plugin layer(s) for {nodes} node(s): "
            "TensorRT did not map every node to the plugin"
        )
    config = builder.create_builder_config()
    if workspace_mib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_mib) << 20)
    opt_profile = builder.create_optimization_profile()
    for name, (mn, opt, mx) in profile.shapes.items():
        opt_profile.set_shape(name, mn, opt, mx)
    config.add_optimization_profile(opt_profile)
    say("building the engine (TensorRT times its tactics; this can take minutes)")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineError("TensorRT could not build the engine: " + ("; ".join(logger.errors[-5:]) or "no reason given"))
    try:
        with atomic_output(engine_path) as tmp:
            tmp.write_bytes(bytes(serialized))
    except OSError as exc:
        raise InputError(f"cannot write {engine_path}: {exc.strerror or exc}") from exc

    def io(kind):
        out = {}
        for i in range(network.num_inputs if kind == "in" else network.num_outputs):
            t = network.get_input(i) if kind == "in" else network.get_output(i)
            out[t.name] = getattr(t.dtype, "name", str(t.dtype))
        return out

    s = _spec.load()
    info = EngineInfo(
        engine=str(engine_path), onnx=str(onnx_path), tensorrt=trt.__version__, gpu=_gpu_name(),
        plugin={**asdict(report.library), "name": s.plugin_name, "version": s.plugin_version,
                "namespace": s.plugin_namespace} if report.library else None,
        plugin_layers=plugin_layers, attention_nodes=nodes, profile=profile.to_dict(),
        inputs=io("in"), outputs=io("out"), seconds=time.perf_counter() - start, notes=report.notes,
    )
    write_text(str(engine_path) + ENGINE_META_SUFFIX, json.dumps(info.to_dict(), indent=2) + "\n")
    return info


def read_engine_metadata(engine_path: str | os.PathLike) -> Optional[dict]:
    path = Path(str(engine_path) + ENGINE_META_SUFFIX)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# Engines: run
# --------------------------------------------------------------------------------------------

_TORCH_TYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32,
                "INT64": torch.int64, "BOOL": torch.bool, "INT8": torch.int8, "UINT8": torch.uint8}


class EngineRunner:
    """A deserialized engine, ready to run on torch tensors (copied to the GPU and back).

    The plugin library is loaded before the engine is deserialized; when deserialization fails,
    the error says which plugin the engine needs and which library built it (from the
    ``.json`` written beside the engine), instead of TensorRT's "Cannot deserialize plugin
    since corresponding IPluginCreator not found".
    """

    def __init__(self, engine_path: str | os.PathLike, *, plugin: Optional[str | os.PathLike] = None):
        trt = require_runtime()
        self.path = Path(engine_path)
        if not self.path.is_file():
            raise InputError(f"{self.path}: no such engine file")
        self.metadata = read_engine_metadata(self.path) or {}
        needs = self.metadata.get("plugin")
        self.plugin_library: Optional[LibraryInfo] = None
        if plugin is None and needs:
            try:
                plugin = find_plugin_library()
            except PluginError:
                plugin = needs.get("path") if needs.get("path") and Path(needs["path"]).is_file() else None
        if plugin is not None:
            self.plugin_library = check_plugin_library(plugin)
            register_plugin_library(plugin, trt.get_plugin_registry())
        self._logger = _collecting_logger(trt)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(self.path.read_bytes())
        if self.engine is None:
            reason = "; ".join(self._logger.errors[-3:]) or "no reason given"
            hint = ""
            if needs:
                hint = (f" The engine needs plugin {needs.get('name')} version {needs.get('version')!r} namespace "
                        f"{needs.get('namespace')!r}, built into it from {needs.get('path')} (sha256 "
                        f"{str(needs.get('sha256'))[:12]}); pass that library with --plugin.")
                if self.plugin_library and needs.get("sha256") and needs["sha256"] != self.plugin_library.sha256:
                    hint += f" The library given ({self.plugin_library.path}) is a different build."
            elif self.plugin_library is None:
                hint = (" No build record is beside the engine and no plugin library was given: an engine with "
                        "FusedAttention layers needs --plugin.")
            raise EngineError(f"TensorRT cannot deserialize {self.path}: {reason}.{hint} Engines also only load "
                              "on the TensorRT version and GPU kind they were built with.")
        self.context = self.engine.create_execution_context()
        self.inputs: List[str] = []
        self.outputs: List[str] = []
        self.dtypes: Dict[str, torch.dtype] = {}
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            is_input = self.engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            (self.inputs if is_input else self.outputs).append(name)
            kind = getattr(self.engine.get_tensor_dtype(name), "name", "")
            if kind not in _TORCH_TYPES:
                raise EngineError(f"engine tensor {name} has type {kind}, which cannot be fed from PyTorch here")
            self.dtypes[name] = _TORCH_TYPES[kind]
        shapes = {}
        for name in self.inputs:
            mn, opt, mx = self.engine.get_tensor_profile_shape(name, 0)
            shapes[name] = (tuple(mn), tuple(opt), tuple(mx))
        self.profile = ShapeProfile(shapes=shapes, labels={})

    def outside_profile(self, inputs: Mapping[str, torch.Tensor]) -> Optional[str]:
        return self.profile.outside({n: tuple(t.shape) for n, t in inputs.items() if n in self.profile.shapes})

    def run(self, inputs: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Outputs by name (on the CPU) for inputs by name."""
        missing = [n for n in self.inputs if n not in inputs]
        if missing:
            raise InputError(f"the engine needs input(s) {', '.join(missing)}")
        why = self.outside_profile(inputs)
        if why:
            raise InputError(why)
        keep = []
        for name in self.inputs:
            t = inputs[name].to(device="cuda", dtype=self.dtypes[name]).contiguous()
            keep.append(t)
            if not self.context.set_input_shape(name, tuple(t.shape)):
                raise EngineError(f"TensorRT refused shape {list(t.shape)} for input {name}")
            self.context.set_tensor_address(name, t.data_ptr())
        outputs = {}
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise EngineError(f"output {name} has an unresolved shape {list(shape)}")
            out = torch.empty(shape, dtype=self.dtypes[name], device="cuda")
            outputs[name] = out
            self.context.set_tensor_address(name, out.data_ptr())
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise EngineError("TensorRT failed to run the engine: " + ("; ".join(self._logger.errors[-3:]) or "no reason given"))
        stream.synchronize()
        self._logger.errors.clear()
        return {name: t.cpu() for name, t in outputs.items()}


def environment() -> Dict[str, object]:
    """TensorRT's version and the GPU, for reports (whatever is importable)."""
    env: Dict[str, object] = {}
    try:
        import tensorrt as trt

        env["tensorrt"] = trt.__version__
    except Exception:  # noqa: BLE001
        env["tensorrt"] = None
    if torch.cuda.is_available():
        env["gpu"] = _gpu_name()
    return env


__all__ = [
    "TensorRTUnavailable", "PluginError", "EngineError", "import_tensorrt", "require_gpu", "require_runtime",
    "find_plugin_library", "check_plugin_library", "register_plugin_library", "LibraryInfo", "PluginRequest", "plugin_requests",
    "expected_fields", "plugin_field_collection", "preflight", "PreflightReport", "ShapeProfile", "parse_shape_specs", "derive_profile",
    "graph_input_dims", "build_engine", "EngineInfo", "read_engine_metadata", "EngineRunner", "environment",
]
