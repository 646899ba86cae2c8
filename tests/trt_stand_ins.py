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
