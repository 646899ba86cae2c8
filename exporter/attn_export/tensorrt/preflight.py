"""The preflight: everything TensorRT's parser would report as "Plugin not found", checked and
said in words before any engine is built."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Tuple

import onnx

from attn_export.tensorrt.plugin_library import LibraryInfo, check_plugin_library, register_plugin_library
from attn_export import spec as _spec
from attn_export.tensorrt.requests import PluginRequest, expected_fields, plugin_requests
from attn_export.tensorrt.runtime import PluginError, import_tensorrt

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
    _check_node_types(requests, compute_capability)
    library = check_plugin_library(plugin)
    if registry is None:
        registry = import_tensorrt().get_plugin_registry()
    register_plugin_library(plugin, registry, load_library)
    registered = list(getattr(registry, "all_creators", []) or [])
    creators = [" ".join(repr(x) for x in _creator_identity(c)) for c in registered]
    want_fields = expected_fields()
    for request in requests:
        creator = _find_creator(registry, registered, request, plugin)
        _check_creator_fields(creator, request, plugin, want_fields)
    notes = [] if requests else ["the model has no FusedAttention node: the engine needs no plugin"]
    return PreflightReport(library=library, requests=requests, creators=creators, notes=notes)


def _check_node_types(requests: List[PluginRequest], compute_capability: Optional[Tuple[int, int]]) -> None:
    """Every node's query type is one the plugin supports, and bfloat16 only on compute capability 8.0+."""
    supported = _spec.load().tensor_type_names
    for request in requests:
        for node, type_name in request.types.items():
            if type_name not in supported:
                raise PluginError(
                    f"node {node}: query is {type_name}; the FusedAttention plugin supports "
                    f"{', '.join(supported[:-1])} and {supported[-1]} (export with --dtype fp32|fp16|bf16)"
                )
            if type_name == "bfloat16" and compute_capability is not None and compute_capability < (8, 0):
                raise PluginError(
                    f"node {node}: bfloat16 needs a GPU of compute capability 8.0 or newer; this one is "
                    f"{compute_capability[0]}.{compute_capability[1]} (export with --dtype fp16 or fp32)"
                )


def _find_creator(registry, registered: list, request: PluginRequest, plugin):
    """The creator registered under exactly the request's name/version/namespace; else a
    PluginError that says whether the name is there under another version or namespace."""
    creator = registry.get_creator(request.name, request.version, request.namespace)
    if creator is not None:
        return creator
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


def _check_creator_fields(creator, request: PluginRequest, plugin, want_fields: List[Tuple[str, str]]) -> None:
    """The creator declares the fields the nodes carry (a creator that declares none is not checked)."""
    have = _creator_fields(creator)
    if have and have != want_fields:
        raise PluginError(
            f"plugin {request.identity()} from {plugin} declares fields {have}, but the nodes carry "
            f"{want_fields}: the library was built from a different csrc/attention_spec.h; rebuild it"
        )
