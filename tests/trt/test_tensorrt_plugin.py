"""The TensorRT plugin without TensorRT: its TensorRT-free core compiled and run with a plain C++
compiler, its fields held to the one spec (csrc/attention_spec.h), the ONNX node's schema and
the plugin README, and the CMake build skipping cleanly where TensorRT's headers are absent."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import onnx
import pytest

from attn_export.onnx import node as onnx_node
from attn_export import spec as spec_mod

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "plugins" / "tensorrt"
PLUGIN_SOURCES = [PLUGIN / "fusedAttentionPlugin.h", PLUGIN / "fusedAttentionPlugin.cpp",
                  PLUGIN / "fusedAttentionCore.h", PLUGIN / "fusedAttentionCore.cpp"]
FIELD_TYPES = {5: "int32", 1: "float32"}  # nvinfer1::PluginFieldType values -> README names
needs_cxx = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")


@pytest.fixture(scope="module")
def core_test(tmp_path_factory):
    exe = tmp_path_factory.mktemp("core") / "core_test"
    subprocess.run(
        ["c++", "-std=c++17", "-O0", "-Wall", "-Wextra", "-Werror", f"-I{PLUGIN}", f"-I{ROOT / 'csrc'}",
         str(PLUGIN / "tests" / "core_test.cpp"), str(PLUGIN / "fusedAttentionCore.cpp"), "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )
    return exe


@needs_cxx
def test_plugin_core_passes_its_checks(core_test):
    run = subprocess.run([str(core_test)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert re.search(r"core_test: \d+ checks passed", run.stdout)


@needs_cxx
def test_plugin_fields_are_the_node_attributes(core_test):
    """Names, order, types and required-ness of the plugin's fields = the ONNX schema's
    attributes (less plugin_version/plugin_namespace, which the parser reads itself)."""
    fields = json.loads(subprocess.run([str(core_test), "--fields"], check=True, capture_output=True,
                                       text=True).stdout)
    s = spec_mod.load()
    assert [f["name"] for f in fields] == [s.attr_num_heads, s.attr_scale, s.attr_is_causal,
                                           s.attr_has_key_padding_mask, s.attr_has_attn_mask, s.attr_softcap,
                                           s.attr_causal_alignment, s.attr_kv_num_heads, s.attr_window, s.attr_has_past,
                                           s.attr_alibi_slopes]
    assert set(s.attribute_names) - {f["name"] for f in fields} == {s.attr_plugin_version, s.attr_plugin_namespace}
    onnx_node.register_schema()
    schema = onnx.defs.get_schema(s.op_type, s.domain_version, s.domain)
    onnx_to_field = {onnx.defs.OpSchema.AttrType.INT: 5, onnx.defs.OpSchema.AttrType.FLOAT: 1,
                     onnx.defs.OpSchema.AttrType.FLOATS: 1}
    for f in fields:
        attr = schema.attributes[f["name"]]
        assert onnx_to_field[attr.type] == f["type"], f["name"]
        assert attr.required == f["required"], f["name"]


@needs_cxx
def test_plugin_readme_parameters_table_matches_the_fields(core_test):
    fields = json.loads(subprocess.run([str(core_test), "--fields"], check=True, capture_output=True,
                                       text=True).stdout)
    readme = (PLUGIN / "README.md").read_text()
    section = readme.split("## Parameters", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\|\s*`(\w+)`\s*\|\s*`(\w+)`\s*\|", section, flags=re.M)
    assert rows == [(FIELD_TYPES[f["type"]], f["name"]) for f in fields]


def test_plugin_sources_take_every_name_from_the_spec():
    """No name of the node is spelled out in the plugin: name, version, namespace, fields and
    input names all come from attention_spec.h."""
    s = spec_mod.load()
    names = {s.plugin_name, s.plugin_version, *s.attribute_names, *s.input_names, *s.output_names}
    for path in PLUGIN_SOURCES:
        literals = set(re.findall(r'"([^"\\]*)"', re.sub(r"//[^\n]*", "", path.read_text())))
        assert not literals & names, f"{path.name} spells out {literals & names}; use the spec constants"
    core = (PLUGIN / "fusedAttentionCore.h").read_text()
    assert '#include "attention_spec.h"' in core
    plugin = (PLUGIN / "fusedAttentionPlugin.cpp").read_text()
    for what in ("Name", "Version", "Namespace"):
        returns = re.findall(rf"getPlugin{what}\(\) const noexcept {{ return ([\w:]+); }}", plugin)
        assert returns == [f"spec::kPlugin{what}"] * 2, what  # the plugin and its creator


def test_plugin_library_exports_exactly_the_two_entry_points():
    exported = re.findall(r"^\s*(\w+);", (PLUGIN / "exports.map").read_text(), flags=re.M)
    assert exported == ["getCreators", "setLoggerFinder"]
    header = (PLUGIN / "fusedAttentionPlugin.h").read_text()
    assert re.search(r"IPluginCreatorInterface\* const\* getCreators\(int32_t& nbCreators\);", header)
    assert re.search(r"void setLoggerFinder\(nvinfer1::ILoggerFinder\* finder\);", header)


def _configure(tmp_path, *args):
    return subprocess.run(["cmake", "-S", str(PLUGIN), "-B", str(tmp_path / "build"), *args],
                          capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_cmake_skips_cleanly_without_tensorrt_headers(tmp_path):
    empty = tmp_path / "no-tensorrt"
    empty.mkdir()
    run = _configure(tmp_path, f"-DTENSORRT_ROOT={empty}")
    assert run.returncode == 0, run.stderr
    text = " ".join((run.stdout + run.stderr).split())
    assert "FusedAttention TensorRT plugin NOT built: TensorRT headers (NvInferRuntime.h) not found" in text
    assert f"TENSORRT_ROOT={empty}" in text and "docs/tensorrt.md" in text
    assert not list((tmp_path / "build").glob("**/*.so"))
    strict = _configure(tmp_path, f"-DTENSORRT_ROOT={empty}", "-DATTN_EXPORT_REQUIRE_TENSORRT=ON")
    assert strict.returncode != 0
    assert "TensorRT headers (NvInferRuntime.h) not found" in " ".join(strict.stderr.split())
