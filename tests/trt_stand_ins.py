"""Stand-ins for TensorRT in tests that run without it: a one-node model as the plugin sees it,
TensorRT's plugin registry and creators, and real shared libraries built on the spot."""
import subprocess
from pathlib import Path

from onnx import TensorProto, helper

from attn_export import spec as spec_mod
from attn_export import tensorrt as attn_trt


def one_node_model(query_type=TensorProto.FLOAT16, mask_type=TensorProto.FLOAT, version=None, namespace="",
                   past=False):
    """One FusedAttention node over query/key/value and both masks (``past``: and the cache,
    the cache form's 7 inputs and 3 outputs), with the plugin identity the TensorRT parser reads."""
    s = spec_mod.load()
    from attn_export.onnx import node as onnx_node

    shapes = {"query": ["b", "lq", 8], "key": ["b", "lq" if past else "lk", 8],
              "value": ["b", "lq" if past else "lk", 8], "key_padding_mask": [1, 1], "attn_mask": [1, 1, 1, 1],
              "past_key": ["b", 2, "p", 4], "past_value": ["b", 2, "p", 4]}
    names, outputs = s.node_inputs(past), s.node_outputs(past)
    inputs = [helper.make_tensor_value_info(n, mask_type if n in ("key_padding_mask", "attn_mask") else query_type,
                                            shapes[n]) for n in names]
    attrs = onnx_node.node_attributes(2, 0.5, past, False, False, causal_alignment=int(past), has_past=past)
    attrs[s.attr_plugin_version], attrs[s.attr_plugin_namespace] = version or s.plugin_version, namespace
    node = helper.make_node(s.op_type, list(names), list(outputs), name="attn0", domain=s.domain, **attrs)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info(o, query_type, None)
                                                    for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20),
                                                   helper.make_opsetid(s.domain, s.domain_version)])


class Field:
    def __init__(self, name, kind):
        self.name, self.type = name, type("FieldType", (), {"name": kind})()


class Creator:
    def __init__(self, name="FusedAttention", version=None, namespace="", fields=None):
        self.name = name
        self.plugin_version = spec_mod.load().plugin_version if version is None else version
        self.plugin_namespace = namespace
        self.field_names = [Field(n, k) for n, k in (fields if fields is not None else attn_trt.expected_fields())]


class Registry:
    def __init__(self, creators, handle=object()):
        self.all_creators, self.loaded, self.handle = creators, [], handle

    def load_library(self, path):
        self.loaded.append(path)
        return self.handle

    def get_creator(self, name, version, namespace=""):
        for c in self.all_creators:
            if (c.name, c.plugin_version, c.plugin_namespace) == (name, version, namespace):
                return c
        return None


def shared_library(directory: Path, name: str, source: str) -> Path:
    src, lib = directory / f"{name}.cpp", directory / f"lib{name}.so"
    src.write_text(source)
    subprocess.run(["c++", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    return lib


class BoundMemoryContext:
    """TensorRT's IExecutionContext as CachedEngineSteps drives it, on the CPU: input shapes
    are set per name (refused outside the profile, as TensorRT does), output shapes follow from
    the ONNX graph's symbols, and ``execute_async_v3`` reads every input from the memory at its
    bound address (with the shape that was set) and writes every output to its bound address,
    running the ONNX file in ONNX Runtime. Addresses of 0 are refused, as TensorRT refuses
    them; ``history`` holds, per step, the (name, shape, address) of every tensor it read or wrote."""

    def __init__(self, engine):
        self.engine, self.shapes, self.addresses, self.calls, self.history = engine, {}, {}, [], []

    def set_input_shape(self, name, shape):
        if name not in self.engine.inputs or self.engine.profile.outside({name: tuple(shape)}):
            return False
        self.shapes[name] = tuple(int(d) for d in shape)
        return True

    def get_tensor_shape(self, name):
        if name in self.shapes:
            return self.shapes[name]
        sizes = {}
        for value in self.engine.session_inputs:
            for d, size in zip(value.shape, self.shapes[value.name]):
                if isinstance(d, str):
                    sizes[d] = size
        out = next(v for v in self.engine.session_outputs if v.name == name)
        return tuple(d if isinstance(d, int) else sizes.get(d, -1) for d in out.shape)

    def set_tensor_address(self, name, address):
        self.addresses[name] = int(address)
        return True

    def _memory(self, name, shape):
        import ctypes

        import numpy as np
        import torch

        dtype = torch.empty(0, dtype=self.engine.dtypes[name]).numpy().dtype
        count = int(np.prod(shape)) if len(shape) else 1
        if not self.addresses.get(name):
            raise AssertionError(f"{name} is bound to address 0: TensorRT refuses null addresses")
        self.calls.append((name, tuple(shape), self.addresses[name]))
        buffer = (ctypes.c_char * (count * dtype.itemsize)).from_address(self.addresses[name])
        return np.frombuffer(buffer, dtype=dtype, count=count).reshape(shape)

    def execute_async_v3(self, stream):
        self.calls = []
        feeds = {n: self._memory(n, self.shapes[n]).copy() for n in self.engine.inputs}
        outs = self.engine.session.run(None, feeds)
        for value, result in zip(self.engine.session_outputs, outs):
            target = self._memory(value.name, self.get_tensor_shape(value.name))
            assert target.shape == result.shape, (value.name, target.shape, result.shape)
            target[...] = result
        self.history.append(self.calls)
        return True


class CachedEngineStandIn:
    """EngineRunner's facts for a cached export's ONNX file on the CPU (``device``), its profile
    ``profile`` (what build_engine would build it with), and a BoundMemoryContext."""

    device = "cpu"

    def __init__(self, onnx_path, profile):
        import onnxruntime as ort

        from attn_export.validation.runners import ONNX_ELEM_TO_TORCH

        import onnx

        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        self.session_inputs, self.session_outputs = self.session.get_inputs(), self.session.get_outputs()
        self.inputs = [v.name for v in self.session_inputs]
        self.outputs = [v.name for v in self.session_outputs]
        graph = onnx.load(str(onnx_path), load_external_data=False).graph
        self.dtypes = {v.name: ONNX_ELEM_TO_TORCH[v.type.tensor_type.elem_type]
                       for v in list(graph.input) + list(graph.output)}
        self.profile = profile
        self.metadata, self.plugin_library = {}, None
        self.context = BoundMemoryContext(self)
