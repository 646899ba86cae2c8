"""Running an engine on torch tensors, with the plugin library loaded first and a readable
error when deserialization fails."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Mapping, Optional

import torch

from attn_export.errors import InputError
from attn_export.tensorrt.build import read_engine_metadata
from attn_export.tensorrt.plugin_library import LibraryInfo, check_plugin_library, find_plugin_library, register_plugin_library
from attn_export.tensorrt.profiles import ShapeProfile
from attn_export.tensorrt.runtime import EngineError, PluginError, collecting_logger, require_runtime

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
        self._logger = collecting_logger(trt)
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
