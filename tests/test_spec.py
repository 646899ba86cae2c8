"""One spec for the node's names (csrc/attention_spec.h): the C++ compiler, the Python parser,
the exported ONNX and the docs must all say the same thing."""
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import onnx
import pytest

from attn_export import spec as spec_mod

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "csrc" / "attention_spec.h"
PARAMS_HEADER = ROOT / "csrc" / "attention_params.h"

_PRINTER = r"""
#include <cstdio>
#include "attention_spec.h"
using namespace attn_export::spec;
static void s(const char* k, const char* v, bool comma = true) { std::printf("\"%s\": \"%s\"%s", k, v, comma ? ", " : ""); }
static void i(const char* k, int v) { std::printf("\"%s\": %d, ", k, v); }
int main() {
  std::printf("{");
  s("domain", kOnnxDomain); i("domain_version", kOnnxDomainVersion); s("op_type", kOpType);
  s("plugin_name", kPluginName); s("plugin_version", kPluginVersion); s("plugin_namespace", kPluginNamespace);
  s("attr_num_heads", kAttrNumHeads); s("attr_scale", kAttrScale); s("attr_is_causal", kAttrIsCausal);
  s("attr_has_key_padding_mask", kAttrHasKeyPaddingMask); s("attr_has_attn_mask", kAttrHasAttnMask);
  s("attr_softcap", kAttrSoftcap);
  s("attr_causal_alignment", kAttrCausalAlignment); s("attr_kv_num_heads", kAttrKvNumHeads); s("attr_window", kAttrWindow);
  s("attr_has_past", kAttrHasPast); i("cache_rank", kCacheRank); s("attr_alibi_slopes", kAttrAlibiSlopes);
  s("attr_plugin_namespace", kAttrPluginNamespace); s("attr_plugin_version", kAttrPluginVersion);
  i("output_rank", kOutputRank); i("min_onnx_opset", kMinOnnxOpset);
  std::printf("\"input_names\": [");
  for (int n = 0; n < kNumInputs; ++n) std::printf("\"%s\"%s", kInputNames[n], n + 1 < kNumInputs ? ", " : "");
  std::printf("], \"input_ranks\": [");
  for (int n = 0; n < kNumInputs; ++n) std::printf("%d%s", kInputRanks[n], n + 1 < kNumInputs ? ", " : "");
  std::printf("], \"output_names\": [");
  for (int n = 0; n < kNumOutputs; ++n) std::printf("\"%s\"%s", kOutputNames[n], n + 1 < kNumOutputs ? ", " : "");
  std::printf("], \"past_input_names\": [\"%s\", \"%s\"]", kPastInputNames[0], kPastInputNames[1]);
  std::printf(", \"present_output_names\": [\"%s\", \"%s\"]", kPresentOutputNames[0], kPresentOutputNames[1]);
  std::printf(", \"tensor_types\": [");
  for (int n = 0; n < kNumTensorTypes; ++n) std::printf("%d%s", kTensorTypes[n], n + 1 < kNumTensorTypes ? ", " : "");
  std::printf("], \"tensor_type_names\": [");
  for (int n = 0; n < kNumTensorTypes; ++n) std::printf("\"%s\"%s", kTensorTypeNames[n], n + 1 < kNumTensorTypes ? ", " : "");
  std::printf("], \"attributes\": [");
  for (int n = 0; n < kNumAttributes; ++n) {
    const Attribute& a = kAttributes[n];
    std::printf("[\"%s\", %d, %s, ", a.name, a.type, a.required ? "true" : "false");
    if (a.required) std::printf("null]");
    else if (a.type == kAttrTypeString) std::printf("\"%s\"]", a.default_string);
    else if (a.type == kAttrTypeFloat) std::printf("%.17g]", a.default_float);
    else if (a.type == kAttrTypeFloats) std::printf("[]]");
    else std::printf("%d]", a.default_int);
    std::printf("%s", n + 1 < kNumAttributes ? ", " : "");
  }
  std::printf("], \"attribute_ranges\": [");
  for (int n = 0; n < kNumAttributeRanges; ++n) {
    const AttributeRange& r = kAttributeRanges[n];
    std::printf("[\"%s\", %.17g, ", r.name, r.min);
    if (r.bounded_above) std::printf("%.17g", r.max); else std::printf("null");
    std::printf(", \"%s\"]%s", r.meaning, n + 1 < kNumAttributeRanges ? ", " : "");
  }
  std::printf("], ");
  i("num_plugin_fields", kNumPluginFields); i("mask_type", kMaskType);
  s("torch_namespace", kTorchNamespace); s("torch_op_attention", kOpAttention);
  s("torch_op_attention_forward", kOpAttentionForward); s("torch_op_attention_backward", kOpAttentionBackward);
  s("torch_op_multi_head_attention", kOpMultiHeadAttention);
  s("torch_op_multi_head_attention_forward", kOpMultiHeadAttentionForward);
  s("torch_op_multi_head_attention_backward", kOpMultiHeadAttentionBackward);
  s("torch_schema_attention", kSchemaAttention); s("torch_schema_attention_forward", kSchemaAttentionForward);
  s("torch_schema_attention_backward", kSchemaAttentionBackward);
  s("torch_schema_multi_head_attention", kSchemaMultiHeadAttention);
  s("torch_schema_multi_head_attention_forward", kSchemaMultiHeadAttentionForward);
  s("torch_schema_multi_head_attention_backward", kSchemaMultiHeadAttentionBackward);
  std::printf("\"positions\": [%d, %d, %d, %d, %d, %d, %d, %d, %d]}", kInputQuery, kInputKey, kInputValue,
              kInputKeyPaddingMask, kInputAttnMask, kInputPastKey, kInputPastValue, kNumPastInputs, kNumPastOutputs);
}
"""


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_the_compiled_header_and_the_python_parser_agree(tmp_path):
    src = tmp_path / "print_spec.cpp"
    src.write_text(_PRINTER)
    exe = tmp_path / "print_spec"
    subprocess.run(["c++", "-std=c++17", "-Wall", "-Werror", f"-I{HEADER.parent}", str(src), "-o", str(exe)],
                   check=True, capture_output=True)
    compiled = json.loads(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)
    assert compiled.pop("positions") == list(range(7)) + [7, 3]
    parsed = spec_mod.spec_from_header(HEADER.read_text())
    attributes = compiled.pop("attributes")
    assert [[a.name, a.type, a.required, list(a.default) if isinstance(a.default, tuple) else a.default]
            for a in parsed.attributes] == attributes
    ranges = compiled.pop("attribute_ranges")
    assert [[r.name, r.min, r.max, r.meaning] for r in parsed.attribute_ranges] == ranges
    for field, value in compiled.items():
        got = getattr(parsed, field)
        assert (list(got) if isinstance(got, tuple) else got) == value, field


def test_header_includes_nothing_from_torch_or_tensorrt():
    includes = re.findall(r"#include\s*[<\"]([^>\"]+)", HEADER.read_text())
    assert includes == []


def test_parser_rejects_an_incomplete_or_inconsistent_header():
    text = HEADER.read_text()
    with pytest.raises(spec_mod.SpecError, match="kOpType"):
        spec_mod.spec_from_header(text.replace("kOpType", "kOpTypeRenamed"))
    swapped = text.replace("kInputKey = 1;", "kInputKey = 2;")
    with pytest.raises(spec_mod.SpecError, match="positions"):
        spec_mod.spec_from_header(swapped)
    with pytest.raises(spec_mod.SpecError, match="the cache form's positions"):
        spec_mod.spec_from_header(text.replace("kInputPastKey = 5;", "kInputPastKey = 4;"))
    stray = text.replace("{kAttrSoftcap, 0.0, false", "{kOpType, 0.0, false")
    with pytest.raises(spec_mod.SpecError, match="kAttributeRanges names 'FusedAttention', which is not in kAttributes"):
        spec_mod.spec_from_header(stray)
    # A name quoted in a comment is not a definition.
    assert spec_mod.parse_header('// inline constexpr int kX = 1;\n') == {}
    # Float literals (FLOAT attributes' defaults) stay floats; integers stay integers.
    assert spec_mod.parse_header('inline constexpr double kX = 1.5;\ninline constexpr int kY = -2;\n') == {
        "kX": 1.5, "kY": -2}


def test_spec_values_the_plugin_relies_on():
    s = spec_mod.load()
    assert s.op_type == s.plugin_name
    assert s.input_names[:3] == ("query", "key", "value")
    assert len(s.input_names) == len(s.input_ranks) == 5
    assert s.plugin_version == "6" and s.domain_version == 6
    # Every attribute but plugin_namespace/plugin_version is a field, alibi_slopes last (FLOAT32, length H).
    assert s.attribute_names[s.num_plugin_fields:] == (s.attr_plugin_namespace, s.attr_plugin_version)
    assert s.plugin_fields[-1].name == s.attr_alibi_slopes
    # The cache form: inputs 5 and 6, outputs 1 and 2, head-major rank-4 tensors.
    assert s.node_inputs(True) == s.input_names + ("past_key", "past_value")
    assert s.node_outputs(True) == ("output", "present_key", "present_value") and s.cache_rank == 4
    assert s.node_inputs(False) == s.input_names and s.node_outputs(False) == s.output_names


def test_spec_types_defaults_and_operators():
    """The facts every binding reads from the spec: the ONNX element and attribute types, the
    TensorRT field types, the defaults, and the torch operators (registered under these names)."""
    import torch

    import attn_export  # noqa: F401 - loads the operators

    s = spec_mod.load()
    assert s.tensor_type_map == {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
                                 onnx.TensorProto.BFLOAT16: "bfloat16"}
    assert s.mask_type == onnx.TensorProto.FLOAT and s.mask_type_name == "float32"
    a = s.attribute
    assert [(f.name, f.plugin_field_type) for f in s.plugin_fields] == [
        ("num_heads", "INT32"), ("scale", "FLOAT32"), ("is_causal", "INT32"), ("has_key_padding_mask", "INT32"),
        ("has_attn_mask", "INT32"), ("softcap", "FLOAT32"), ("causal_alignment", "INT32"), ("kv_num_heads", "INT32"),
        ("window", "INT32"), ("has_past", "INT32"), ("alibi_slopes", "FLOAT32")]
    assert a[s.attr_scale].type == onnx.AttributeProto.FLOAT and a[s.attr_num_heads].type == onnx.AttributeProto.INT
    assert a[s.attr_plugin_version].type == onnx.AttributeProto.STRING
    assert [f.name for f in s.attributes if f.required] == [s.attr_num_heads, s.attr_scale]
    assert a[s.attr_plugin_version].default == s.plugin_version
    assert a[s.attr_plugin_namespace].default == s.plugin_namespace
    assert a[s.attr_is_causal].default == 0
    assert a[s.attr_softcap].type == onnx.AttributeProto.FLOAT and a[s.attr_softcap].default == 0.0
    assert isinstance(a[s.attr_softcap].default, float)
    assert a[s.attr_alibi_slopes].type == onnx.AttributeProto.FLOATS and a[s.attr_alibi_slopes].default == ()
    for op in (s.torch_op_attention, s.torch_op_attention_forward, s.torch_op_attention_backward,
               s.torch_op_multi_head_attention, s.torch_op_multi_head_attention_forward,
               s.torch_op_multi_head_attention_backward):
        namespace, name = op.split("::")
        assert namespace == s.torch_namespace
        assert hasattr(getattr(torch.ops, namespace), name), op


def test_docs_name_every_input_attribute_and_identity():
    doc = (ROOT / "docs" / "onnx_node.md").read_text()
    s = spec_mod.load()
    for name in (*s.node_inputs(True), *s.node_outputs(True), *s.attribute_names, s.domain, s.op_type):
        assert f"`{name}`" in doc, name


def test_exported_node_carries_exactly_the_spec_names(exported_seq2seq):
    s = spec_mod.load()
    model = onnx.load(str(exported_seq2seq.path))
    nodes = [n for n in model.graph.node if n.op_type == s.op_type]
    # Each node in its body variant's domain, <spec domain>.<variant> (TensorRT ignores the domain).
    assert nodes and all(n.domain.startswith(s.domain + ".") for n in nodes)
    for node in nodes:
        assert len(node.input) == len(s.input_names) and all(node.input)
        assert len(node.output) == len(s.output_names)
        # Every attribute; alibi_slopes only with slopes (these nodes have none).
        assert {a.name for a in node.attribute} == set(s.attribute_names) - {s.attr_alibi_slopes}
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs[s.attr_plugin_version] == s.plugin_version.encode()
        assert attrs[s.attr_plugin_namespace] == s.plugin_namespace.encode()
    functions = [f for f in model.functions if f.name == s.op_type]
    # The generic body first (in the spec's domain, called by no node), then one lean body per
    # variant in use, in the variant's domain; no overloads.
    assert functions[0].domain == s.domain
    assert sorted(f.domain for f in functions[1:]) == sorted({n.domain for n in nodes})
    for function in functions:
        assert not function.overload and not any(n.overload for n in nodes)
        assert tuple(function.input) == s.input_names and tuple(function.output) == s.output_names
        assert set(function.attribute) | {a.name for a in function.attribute_proto} == set(s.attribute_names)
    imports = {o.domain: o.version for o in model.opset_import}
    assert all(imports[n.domain] == s.domain_version for n in nodes)


# ----- The operators' signatures: said once, in the spec's kSchema* strings -----------------------

def test_the_library_registers_the_spec_schemas():
    """csrc/ops/attention.cpp defines each operator from its kSchema*: the loaded library's schemas
    are the spec's (a stale _C.so fails here: rebuild it)."""
    import torch

    import attn_export  # noqa: F401 - loads the operators

    for op, text in spec_mod.load().torch_schemas.items():
        namespace, name = op.split("::")
        registered = getattr(getattr(torch.ops, namespace), name).default._schema
        assert registered == torch._C.parse_schema(text), (op, str(registered))


def _cpp_to_schema_type(cpp: str) -> str:
    return {"double": "float", "int64_t": "int", "bool": "bool"}[cpp]


def _trailing_arguments():
    """ATTN_EXPORT_TRAILING_ARGUMENTS of csrc/ops/core_args.h: the trailing attributes, then the
    entries it adds (the ALiBi slopes): [(schema type, name, default)]."""
    text = (ROOT / "csrc" / "ops" / "core_args.h").read_text()
    body = re.search(r"#define ATTN_EXPORT_TRAILING_ARGUMENTS\(X\)((?:[^\n]*\\\n)*[^\n]*)", text)[1]
    assert "ATTN_EXPORT_TRAILING_ATTRIBUTES(X)" in body
    types = {"std::optional<std::vector<double>>": "Optional[List[float]]"}
    extra = [(types[t], n, None if d == "std::nullopt" else d)
             for t, n, d in re.findall(r"X\(\s*([\w:<>]+)\s*,\s*(\w+)\s*,\s*([^)]*?)\s*\)", body)]
    return _trailing_attributes() + extra


def _trailing_attributes():
    """ATTN_EXPORT_TRAILING_ATTRIBUTES of attention_params.h: [(schema type, name, default)]."""
    text = PARAMS_HEADER.read_text()
    body = re.search(r"#define ATTN_EXPORT_TRAILING_ATTRIBUTES\(X\)((?:[^\n]*\\\n)*[^\n]*)", text)[1]
    entries = re.findall(r"X\(\s*(\w+)\s*,\s*(\w+)\s*,\s*([^)]*?)\s*\)", body)
    literal = {"true": True, "false": False}
    return [(_cpp_to_schema_type(t), n, literal.get(d, None) if d in literal else float(d) if "." in d else int(d))
            for t, n, d in entries]


@pytest.mark.parametrize("op_field, before", [("torch_op_attention", "scale"), ("torch_op_attention_forward", "need_weights"),
                                              ("torch_op_attention_backward", "output")])
def test_trailing_attributes_end_every_core_schema(op_field, before):
    """The C++ adapters (csrc/ops/core_args.h) take the core's last arguments from
    ATTN_EXPORT_TRAILING_ATTRIBUTES (csrc/attention_params.h): the list must be what each core
    schema (csrc/attention_spec.h) ends with, in order, types and defaults. torch checks the types
    when the library loads; this names the place and checks names and defaults too."""
    from attn_export.ops import signatures

    op = getattr(spec_mod.load(), op_field)
    args = signatures.arguments(op)
    names = [a.name for a in args]
    tail = [(a.type, a.name, a.default) for a in args[names.index(before) + 1:]]
    listed = _trailing_arguments()
    assert listed, "ATTN_EXPORT_TRAILING_ATTRIBUTES lists nothing (csrc/attention_params.h)"
    assert tail == listed, (f"{op} (csrc/attention_spec.h) ends with {tail} after {before!r}; "
                            f"ATTN_EXPORT_TRAILING_ARGUMENTS (csrc/ops/core_args.h) lists {listed}")


def test_attribute_ranges_word_their_rule_and_admit_only_their_values():
    """kAttributeRanges: the words of every refusal (the binding's, the fake kernels', the
    exporter's) and the values each restricted attribute admits."""
    s = spec_mod.load()
    ranges = {r.name: r for r in s.attribute_ranges}
    assert ranges[s.attr_softcap].rule == "finite and >= 0 (0 = off)"
    assert ranges[s.attr_causal_alignment].rule == (
        "0 or 1 (0 = top-left: query i sees keys j <= i; 1 = bottom-right: keys j <= i + Lk - Lq)")
    assert spec_mod.AttributeRange("x", -1.0, 4.0, "m").rule == "-1 to 4 (m)"
    softcaps = (-2.0, -1e-30, 0.0, 1e-30, 50.0, math.inf, math.nan)
    assert [c for c in softcaps if ranges[s.attr_softcap].admits(c)] == [0.0, 1e-30, 50.0]
    assert [a for a in (-1, 0, 1, 2, 7) if ranges[s.attr_causal_alignment].admits(a)] == [0, 1]
    assert s.refusals({s.attr_softcap: -1e-30, s.attr_scale: math.nan, s.attr_causal_alignment: 1}) == (
        "softcap must be finite and >= 0 (0 = off); got -1e-30",)
    assert s.refusals({s.attr_causal_alignment: 2})[0].endswith("; got 2")


def test_every_restricted_attribute_is_a_trailing_attribute():
    """The binding checks the trailing attributes (ATTN_EXPORT_TRAILING_ATTRIBUTES) against
    kAttributeRanges: a range for any other attribute would never be checked."""
    trailing = {name for _, name, _ in _trailing_attributes()}
    for r in spec_mod.load().attribute_ranges:
        assert r.name in trailing, (f"kAttributeRanges (csrc/attention_spec.h) restricts {r.name!r}, which is not in "
                                    "ATTN_EXPORT_TRAILING_ATTRIBUTES (csrc/attention_params.h): nothing would check it")


def test_the_attention_operators_scalars_are_node_attributes():
    """The ONNX translation writes each scalar argument of attn_export::attention on the node under
    the same name (onnx/translation.py): each must be a node attribute (kAttributes) of the same
    kind, with the same default where the node has one."""
    from attn_export.ops import signatures

    s = spec_mod.load()
    kinds = {"bool": onnx.AttributeProto.INT, "int": onnx.AttributeProto.INT, "float": onnx.AttributeProto.FLOAT,
             "Optional[float]": onnx.AttributeProto.FLOAT, "Optional[List[float]]": onnx.AttributeProto.FLOATS}
    # A list argument's None stands for the node's empty list (no slopes: ALiBi off).
    defaults = {None: ()}
    scalars = [a for a in signatures.arguments(s.torch_op_attention) if not a.is_tensor]
    assert [a.name for a in scalars][:2] == [s.attr_is_causal, s.attr_scale]
    for a in scalars:
        assert a.name in s.attribute, f"{s.torch_op_attention}'s {a.name!r} is not in kAttributes (csrc/attention_spec.h)"
        node = s.attribute[a.name]
        assert node.type == kinds[a.type], f"kAttributes {a.name!r}: type {node.type_name}, the schema says {a.type}"
        if not node.required:
            schema_default = defaults.get(a.default, a.default) if node.type == onnx.AttributeProto.FLOATS else a.default
            assert node.default == schema_default, (f"kAttributes {a.name!r}: default {node.default!r}, the schema "
                                                    f"{a.default!r}")


def _python_signatures():
    """(place to fix, function, operator) for every signature still spelled in Python."""
    from attn_export.onnx import translation
    from attn_export.ops import functional

    s = spec_mod.load()
    return [
        ("exporter/attn_export/ops/functional.py: attention", functional.attention, s.torch_op_attention),
        ("exporter/attn_export/ops/functional.py: multi_head_attention", functional.multi_head_attention,
         s.torch_op_multi_head_attention),
        ("exporter/attn_export/onnx/translation.py: translate_attention", translation.translate_attention,
         s.torch_op_attention),
        ("exporter/attn_export/onnx/translation.py: translate_multi_head_attention",
         translation.translate_multi_head_attention, s.torch_op_multi_head_attention),
    ]


@pytest.mark.parametrize("index", range(4))
def test_python_entry_points_follow_the_schemas(index):
    """Names, order and defaults of each Python function that takes an operator's arguments equal
    the operator's schema in csrc/attention_spec.h; the error names the function to fix."""
    from attn_export.ops import signatures

    where, function, op = _python_signatures()[index]
    signatures.check_parameters(function, op, where)


def test_fake_kernels_name_only_their_operators_arguments():
    """ops/fake.py's kernels receive their operator's arguments by name: each parameter they name
    must be an argument of the schema (the rest arrive in **_)."""
    import inspect

    from attn_export.ops import fake, signatures

    assert set(fake.FAKE_KERNELS) == set(spec_mod.load().torch_schemas)
    for op, kernel in fake.FAKE_KERNELS.items():
        names = {a.name for a in signatures.arguments(op)}
        params = inspect.signature(kernel).parameters.values()
        named = [p.name for p in params if p.kind is not p.VAR_KEYWORD]
        assert set(named) <= names, f"exporter/attn_export/ops/fake.py: {kernel.__name__} names {set(named) - names}, not arguments of {op}"
        assert any(p.kind is p.VAR_KEYWORD for p in params), f"ops/fake.py: {kernel.__name__} must take **_"


def test_signature_check_names_the_place_to_fix():
    """check_parameters fails on a missing, reordered or wrongly defaulted parameter, naming the place."""
    from attn_export.ops import signatures

    op = spec_mod.load().torch_op_attention

    def missing(query, key, value, attn_mask=None, key_padding_mask=None, is_causal=False, scale=None):
        pass

    def reordered(query, key, value, key_padding_mask=None, attn_mask=None, is_causal=False, scale=None, softcap=0.0):
        pass

    def wrong_default(query, key, value, attn_mask=None, key_padding_mask=None, is_causal=True, scale=None, softcap=0.0):
        pass

    for function in (missing, reordered, wrong_default):
        with pytest.raises(TypeError, match="here.py: f"):
            signatures.check_parameters(function, op, "here.py: f")


def test_signatures_bind_a_call_as_the_operator_does():
    """A call bound by the schema gets every argument by name with the schema's defaults; the
    generated translation has the operator's signature and onnxscript's attribute annotations."""
    import inspect

    from attn_export.onnx import translation
    from attn_export.ops import signatures

    op = spec_mod.load().torch_op_attention
    args = signatures.arguments(op)
    bound = signatures.bind(op, ("q", "k", "v"), {"softcap": 2.0})
    assert list(bound) == [a.name for a in args]
    assert {n: bound[n] for n in ("query", "key", "value", "attn_mask", "key_padding_mask", "is_causal", "scale",
                                  "softcap")} == {"query": "q", "key": "k", "value": "v", "attn_mask": None,
                                                  "key_padding_mask": None, "is_causal": False, "scale": None,
                                                  "softcap": 2.0}
    assert all(bound[a.name] == a.default for a in args[8:])  # attributes added after softcap: their defaults
    with pytest.raises(TypeError):
        signatures.bind(op, ("q", "k"), {})
    sig = inspect.signature(translation.translate_attention)
    assert list(sig.parameters) == [a.name for a in args]
    annotations = translation.translate_attention.__annotations__
    assert {n: annotations[n] for n in ("is_causal", "scale", "softcap")} == {"is_causal": bool, "scale": float,
                                                                              "softcap": float}
    assert set(annotations) == {a.name for a in args if not a.is_tensor}
