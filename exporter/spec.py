"""The fused attention node's names, read from the one spec, ``csrc/attention_spec.h``.

The C++ header is the single source of truth (the TensorRT plugin includes it); this module
parses its ``inline constexpr`` constants with a regular expression, so the exporter can never
drift from the plugin. tests/test_spec.py compiles the header and checks both agree, and that
exported models carry exactly these names. See docs/onnx_node.md.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple

_HEADER = "attention_spec.h"

_SCALAR = re.compile(
    r"inline\s+constexpr\s+(?P<type>const\s+char\s*\*|int)\s+(?P<name>k\w+)\s*=\s*(?P<value>\"[^\"]*\"|-?\d+)\s*;"
)
_ARRAY = re.compile(
    r"inline\s+constexpr\s+(?P<type>const\s+char\s*\*|int)\s+(?P<name>k\w+)\s*\[[^\]]*\]\s*=\s*\{(?P<body>[^}]*)\}\s*;"
)


class SpecError(RuntimeError):
    """The spec header is missing or does not define what the exporter needs."""


def header_path() -> Path:
    """The installed copy (package data) if present, else the source checkout's csrc/."""
    here = Path(__file__).resolve().parent
    for candidate in (here / _HEADER, here.parent / "csrc" / _HEADER):
        if candidate.is_file():
            return candidate
    raise SpecError(
        f"{_HEADER} not found beside the package or in the source tree's csrc/; reinstall attn-export"
    )


def _literal(text: str):
    text = text.strip()
    return text[1:-1] if text.startswith('"') else int(text)


def parse_header(text: str) -> Dict[str, object]:
    """Every ``inline constexpr`` scalar and array in the header: name -> str | int | tuple."""
    text = re.sub(r"//[^\n]*", "", text)  # comments may quote names; only code counts
    values: Dict[str, object] = {}
    for m in _SCALAR.finditer(text):
        values[m["name"]] = _literal(m["value"])
    for m in _ARRAY.finditer(text):
        values[m["name"]] = tuple(_literal(part) for part in m["body"].split(",") if part.strip())
    return values


@dataclass(frozen=True)
class AttentionSpec:
    domain: str
    domain_version: int
    op_type: str
    plugin_name: str
    plugin_version: str
    plugin_namespace: str
    attr_num_heads: str
    attr_scale: str
    attr_is_causal: str
    attr_has_key_padding_mask: str
    attr_has_attn_mask: str
    attr_plugin_namespace: str
    attr_plugin_version: str
    input_names: Tuple[str, ...]
    output_names: Tuple[str, ...]
    input_ranks: Tuple[int, ...]
    output_rank: int
    min_onnx_opset: int

    @property
    def attribute_names(self) -> Tuple[str, ...]:
        return (
            self.attr_num_heads, self.attr_scale, self.attr_is_causal, self.attr_has_key_padding_mask,
            self.attr_has_attn_mask, self.attr_plugin_namespace, self.attr_plugin_version,
        )


_FIELDS = {
    "domain": "kOnnxDomain",
    "domain_version": "kOnnxDomainVersion",
    "op_type": "kOpType",
    "plugin_name": "kPluginName",
    "plugin_version": "kPluginVersion",
    "plugin_namespace": "kPluginNamespace",
    "attr_num_heads": "kAttrNumHeads",
    "attr_scale": "kAttrScale",
    "attr_is_causal": "kAttrIsCausal",
    "attr_has_key_padding_mask": "kAttrHasKeyPaddingMask",
    "attr_has_attn_mask": "kAttrHasAttnMask",
    "attr_plugin_namespace": "kAttrPluginNamespace",
    "attr_plugin_version": "kAttrPluginVersion",
    "input_names": "kInputNames",
    "output_names": "kOutputNames",
    "input_ranks": "kInputRanks",
    "output_rank": "kOutputRank",
    "min_onnx_opset": "kMinOnnxOpset",
}


def spec_from_header(text: str) -> AttentionSpec:
    values = parse_header(text)
    missing = [const for const in _FIELDS.values() if const not in values]
    if missing:
        raise SpecError(f"{_HEADER} does not define {', '.join(missing)}")
    spec = AttentionSpec(**{field: values[const] for field, const in _FIELDS.items()})
    positions = [values.get(f"kInput{''.join(p.title() for p in n.split('_'))}") for n in spec.input_names]
    if positions != list(range(len(spec.input_names))) or values.get("kNumInputs") != len(spec.input_names):
        raise SpecError(f"{_HEADER}: kInput* positions {positions} disagree with kInputNames {spec.input_names}")
    if spec.op_type != spec.plugin_name:
        raise SpecError(f"{_HEADER}: kOpType {spec.op_type!r} must equal kPluginName {spec.plugin_name!r}")
    return spec


@functools.lru_cache(maxsize=None)
def load() -> AttentionSpec:
    """The spec of the installed package (parsed once)."""
    return spec_from_header(header_path().read_text())
