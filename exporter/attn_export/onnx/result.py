"""What ``export_onnx`` returns: the file's facts, the replacement report, the notes and the
graph passes that ran."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from attn_export.onnx.passes.base import PassOutcome


@dataclass
class ExportResult:
    path: Path
    opset: int
    dtype: str
    input_names: List[str]
    output_names: List[str]
    dynamic_axes: Dict[str, Dict[int, str]]  # input -> {axis: label in the ONNX graph}
    num_attention_nodes: int
    replacement: Optional[object] = None  # ReplacementReport when export_onnx replaced layers
    notes: List[str] = field(default_factory=list)
    attention: str = "custom"  # the flavor asked for
    functions: str = "local"  # or "inline": no model-local function, no custom node
    num_standard_attention_nodes: int = 0
    kept_custom: List[str] = field(default_factory=list)  # standard flavor: layers left custom, and why
    with_past: Optional[dict] = None  # a cached export: the cache's geometry (the metadata's attn_export.with_past)
    passes: List[PassOutcome] = field(default_factory=list)  # the graph passes that ran, in order
    encoder: Optional["ExportResult"] = None  # an encoder-decoder's cached export: its encoder file's

    @property
    def paths(self) -> List[Path]:
        """Every file written: the encoder's (an encoder-decoder's cached export), then this one."""
        return ([self.encoder.path] if self.encoder is not None else []) + [self.path]

    def to_dict(self) -> dict:
        encoder = {"encoder": self.encoder.to_dict()} if self.encoder is not None else {}
        return {
            "path": str(self.path),
            "opset": self.opset,
            "dtype": self.dtype,
            "input_names": self.input_names,
            "output_names": self.output_names,
            "dynamic_axes": {n: {str(a): lbl for a, lbl in d.items()} for n, d in self.dynamic_axes.items()},
            "num_attention_nodes": self.num_attention_nodes,
            "replacement": self.replacement.to_dict() if self.replacement is not None else None,
            "notes": self.notes,
            "attention": self.attention,
            "functions": self.functions,
            "num_standard_attention_nodes": self.num_standard_attention_nodes,
            "kept_custom": self.kept_custom,
            "with_past": self.with_past,
            "passes": [p.to_dict() for p in self.passes],
            **encoder,
        }

    def passes_text(self) -> str:
        """One line: the graph passes that ran, in order, each with what it changed."""
        return ", ".join(f"{p.name} ({p.changed})" for p in self.passes) or "none"
