"""TensorRT: the FusedAttention plugin library, engines with dynamic-shape profiles, running them.

    >>> from attn_export import tensorrt as attn_trt
    >>> plugin = attn_trt.find_plugin_library()                  # --plugin, $ATTN_EXPORT_TRT_PLUGIN, build/tensorrt/
    >>> profile = attn_trt.derive_profile(onnx.load("model.onnx"), example_inputs)
    >>> info = attn_trt.build_engine("model.onnx", "model.engine", plugin=plugin, profile=profile)
    >>> outputs = attn_trt.EngineRunner("model.engine", plugin=plugin).run(example_inputs)

A cached decoder export (``--with-past``) gets its profile from :func:`cached_profile` (the past
from 0 to ``max_context - 1`` tokens) and generates through :class:`CachedEngineSteps` (the
cache stays on the GPU between steps).

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

Modules, one job each: ``runtime`` (TensorRT, the GPU, errors), ``plugin_library`` (find, check,
register the library), ``requests`` (what the nodes ask for), ``preflight``, ``profiles``,
``build`` (engines), ``run`` (EngineRunner), ``cache_profile`` (the profile of a cached export),
``generation`` (CachedEngineSteps).
"""
from attn_export.tensorrt.build import ENGINE_META_SUFFIX, EngineInfo, build_engine, read_engine_metadata
from attn_export.tensorrt.plugin_library import (
    BUILD_PLUGIN,
    ENTRY_POINTS,
    PLUGIN_ENV,
    PLUGIN_FILENAME,
    LibraryInfo,
    check_plugin_library,
    default_plugin_paths,
    file_sha256,
    find_plugin_library,
    register_plugin_library,
)
from attn_export.tensorrt.cache_profile import MAX_CONTEXT_FLAG, cached_profile, max_context_of
from attn_export.tensorrt.generation import CachedEngineSteps
from attn_export.tensorrt.preflight import PreflightReport, preflight
from attn_export.tensorrt.profiles import Dims, ShapeProfile, derive_profile, graph_input_dims, parse_shape_specs
from attn_export.tensorrt.requests import (
    MASK_ONNX_TYPE,
    SUPPORTED_ONNX_TYPES,
    PluginRequest,
    expected_fields,
    plugin_field_collection,
    plugin_requests,
)
from attn_export.tensorrt.run import EngineRunner
from attn_export.tensorrt.runtime import (
    INSTALL_TENSORRT,
    EngineError,
    PluginError,
    TensorRTUnavailable,
    environment,
    import_tensorrt,
    require_gpu,
    require_runtime,
)

__all__ = [
    "TensorRTUnavailable", "PluginError", "EngineError", "import_tensorrt", "require_gpu", "require_runtime",
    "find_plugin_library", "check_plugin_library", "register_plugin_library", "LibraryInfo", "PluginRequest",
    "plugin_requests", "expected_fields", "plugin_field_collection", "preflight", "PreflightReport", "ShapeProfile",
    "parse_shape_specs", "derive_profile", "graph_input_dims", "build_engine", "EngineInfo", "read_engine_metadata",
    "EngineRunner", "environment", "ENGINE_META_SUFFIX", "BUILD_PLUGIN", "ENTRY_POINTS", "PLUGIN_ENV",
    "PLUGIN_FILENAME", "default_plugin_paths", "file_sha256", "Dims", "MASK_ONNX_TYPE", "SUPPORTED_ONNX_TYPES",
    "INSTALL_TENSORRT", "cached_profile", "max_context_of", "MAX_CONTEXT_FLAG", "CachedEngineSteps",
]
