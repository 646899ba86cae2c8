"""Building an engine: parse (FusedAttention nodes -> the plugin), build a strongly typed engine
with one optimization profile, write it with a build record beside it."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import onnx
import torch

from attn_export import spec as _spec
from attn_export.errors import InputError
from attn_export.atomic_io import atomic_output, write_text
from attn_export.onnx.node import is_attention_domain
from attn_export.tensorrt.preflight import PreflightReport, preflight
from attn_export.tensorrt.profiles import ShapeProfile
from attn_export.tensorrt.runtime import EngineError, collecting_logger, gpu_name, require_runtime

ENGINE_META_SUFFIX = ".json"


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


def _network_flags(trt) -> int:
    # Strongly typed: the ONNX types decide every layer's precision. TensorRT 11 is always
    # strongly typed (the flag is deprecated and ignored); TensorRT 10 needs it.
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def _without_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with the FusedAttention functions (every variant's) removed, so that every TensorRT parser maps
    the nodes to the plugin (parsers before 10.15 prefer a model-local function of the same name)."""
    s = _spec.load()
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    keep = [f for f in stripped.functions if not (is_attention_domain(f.domain) and f.name == s.op_type)]
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


def _load_model(onnx_path: Path) -> onnx.ModelProto:
    if not onnx_path.is_file():
        raise InputError(f"{onnx_path}: no such file")
    return onnx.load(str(onnx_path))


def _check_plugin(model: onnx.ModelProto, plugin, say: Callable[[str], None]) -> PreflightReport:
    """The preflight report: the plugin library and its creators checked against the model's FusedAttention
    nodes, or, for a model with none and no plugin, a note that TensorRT maps the standard Attention nodes."""
    if plugin is None and not any(n.op_type == _spec.load().op_type for n in model.graph.node):
        standard = sum(1 for n in model.graph.node if n.op_type == "Attention" and n.domain in ("", "ai.onnx"))
        return PreflightReport(library=None, requests=[], creators=[], notes=[
            f"{standard} standard Attention node(s), mapped by TensorRT's ONNX parser itself: no plugin"])
    say("preflight: plugin library and creators")
    major, minor = torch.cuda.get_device_capability()
    return preflight(model, plugin, compute_capability=(major, minor))


def _parse_network(trt, builder, logger, model: onnx.ModelProto, onnx_path: Path, say: Callable[[str], None]):
    """The network parsed from ``model`` (its FusedAttention functions removed), and the parser, which owns
    the network's weights and so must outlive the build."""
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    say("parsing the ONNX model")
    if not parser.parse(_without_functions(model).SerializeToString(), str(onnx_path)):
        errors = _parse_errors(parser) or logger.errors or ["(the parser gave no reason)"]
        raise EngineError(f"TensorRT's ONNX parser rejected {onnx_path}: " + "; ".join(errors[:5]))
    return network, parser


def _count_plugin_layers(trt, network, nodes: int) -> int:
    """The network's plugin layers, which must be one per FusedAttention node."""
    plugin_layers = sum(
        1 for i in range(network.num_layers)
        if network.get_layer(i).type == getattr(trt.LayerType, "PLUGIN_V3", None)
    )
    if plugin_layers != nodes:
        raise EngineError(
            f"the parsed network has {plugin_layers} FusedAttention plugin layer(s) for {nodes} node(s): "
            "TensorRT did not map every node to the plugin"
        )
    return plugin_layers


def _builder_config(trt, builder, profile: ShapeProfile, workspace_mib: Optional[int]):
    """The builder configuration: the workspace limit, if given, and the one optimization profile."""
    config = builder.create_builder_config()
    if workspace_mib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_mib) << 20)
    opt_profile = builder.create_optimization_profile()
    for name, (mn, opt, mx) in profile.shapes.items():
        opt_profile.set_shape(name, mn, opt, mx)
    config.add_optimization_profile(opt_profile)
    return config


def _build_and_write(builder, network, config, logger, engine_path: Path, say: Callable[[str], None]) -> None:
    say("building the engine (TensorRT times its tactics; this can take minutes)")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineError("TensorRT could not build the engine: " + ("; ".join(logger.errors[-5:]) or "no reason given"))
    try:
        with atomic_output(engine_path) as tmp:
            tmp.write_bytes(bytes(serialized))
    except OSError as exc:
        raise InputError(f"cannot write {engine_path}: {exc.strerror or exc}") from exc


def _tensor_types(network, kind: str) -> Dict[str, str]:
    """The network's input (``kind == "in"``) or output tensors: name -> data type name."""
    out = {}
    for i in range(network.num_inputs if kind == "in" else network.num_outputs):
        t = network.get_input(i) if kind == "in" else network.get_output(i)
        out[t.name] = getattr(t.dtype, "name", str(t.dtype))
    return out


def _plugin_identity(report: PreflightReport) -> Optional[Dict[str, object]]:
    """What the engine needs to be deserialized: the plugin library (path, sha256) and the plugin's identity."""
    if not report.library:
        return None
    s = _spec.load()
    return {**asdict(report.library), "name": s.plugin_name, "version": s.plugin_version,
            "namespace": s.plugin_namespace}


def build_engine(
    onnx_path: str | os.PathLike,
    engine_path: str | os.PathLike,
    *,
    plugin: Optional[str | os.PathLike],
    profile: ShapeProfile,
    workspace_mib: Optional[int] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> EngineInfo:
    """Parses ``onnx_path`` (FusedAttention nodes -> the plugin), builds a strongly typed engine
    with one optimization profile and writes it to ``engine_path`` (whole or not at all), with
    ``engine_path + ".json"`` beside it: the plugin library (path, sha256) and identity the
    engine needs to be deserialized, the profile, the TensorRT version and the GPU.

    ``plugin`` may be None for a model without FusedAttention nodes (``--onnx-attention
    standard``): TensorRT's parser (10.14+) maps the standard Attention nodes to its own
    attention layer, and the engine needs no plugin."""
    import time

    say = progress or (lambda _msg: None)
    trt = require_runtime()
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    model = _load_model(onnx_path)
    report = _check_plugin(model, plugin, say)
    nodes = sum(len(r.nodes) for r in report.requests)

    start = time.perf_counter()
    logger = collecting_logger(trt)
    builder = trt.Builder(logger)
    network, _parser = _parse_network(trt, builder, logger, model, onnx_path, say)
    plugin_layers = _count_plugin_layers(trt, network, nodes)
    config = _builder_config(trt, builder, profile, workspace_mib)
    _build_and_write(builder, network, config, logger, engine_path, say)

    info = EngineInfo(
        engine=str(engine_path), onnx=str(onnx_path), tensorrt=trt.__version__, gpu=gpu_name(),
        plugin=_plugin_identity(report),
        plugin_layers=plugin_layers, attention_nodes=nodes, profile=profile.to_dict(),
        inputs=_tensor_types(network, "in"), outputs=_tensor_types(network, "out"),
        seconds=time.perf_counter() - start, notes=report.notes,
    )
    write_text(str(engine_path) + ENGINE_META_SUFFIX, json.dumps(info.to_dict(), indent=2) + "\n")
    return info


def read_engine_metadata(engine_path: str | os.PathLike) -> Optional[dict]:
    path = Path(str(engine_path) + ENGINE_META_SUFFIX)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
