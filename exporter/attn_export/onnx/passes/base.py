"""What a graph pass is: a ``name``, the flavors it serves, ``applies(context)`` and
``run(model, context) -> PassOutcome``; :class:`PassContext` is what the export tells the
passes and what they leave for it (the axis labels, the standard rewrite, ...).

A pass edits the ``onnx.ModelProto`` in place, with the helpers of ``attn_export.onnx.editing``.
Its outcome's notes are the export's notes (``ExportResult.notes``), word for word; its
``changed`` count (nodes rewritten, axes labelled, ...) is reported with its name
(``ExportResult.passes``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, Mapping, Tuple

import onnx

from attn_export.onnx.editing import count_attention_nodes


@dataclass(frozen=True)
class PassOutcome:
    """What one pass changed: a count (0: nothing) and note lines for the export's report."""

    changed: int = 0
    notes: Tuple[str, ...] = ()
    name: str = ""  # filled in by the pass loop

    def to_dict(self) -> dict:
        return {"name": self.name, "changed": self.changed, "notes": list(self.notes)}


@dataclass
class PassContext:
    """The export's request as the passes see it, and what passes leave for later ones and for
    the export (``labels``, ``standard``, and ``results`` for a pass of one's own)."""

    opset: int
    attention: str = "custom"  # the flavor asked for (attn_export.onnx_options.ATTENTION_FLAVORS)
    functions: str = "local"  # "local" or "inline"
    axes: Mapping[str, Mapping[int, str]] = field(default_factory=dict)  # input -> {axis: label} to export dynamic
    required: bool = False  # the axes were declared: one that comes out static is an error
    quantize: str | None = None  # "int4" | "int8": the ort flavor's weight-only quantization (ExportOptions.quantize)
    # A cached decoder's logits of the last position only (ExportOptions.last_logits: True, False or
    # "if-found"); the pass leaves it True or False, what the file has.
    last_logits: bool | str = False
    # A cached export's position_ids input: False once a pass removed it (nothing reads it any more).
    position_ids: bool = True
    max_positions: int | None = None  # the model's position limit (its config), where known: the ort flavor's rotary caches
    model: onnx.ModelProto | None = None  # the model being edited (set by the pass loop)
    labels: Dict[str, Dict[int, str]] = field(default_factory=dict)  # label_axes: the labels as they came out
    standard: Any = None  # standard_attention: the StandardRewrite
    results: Dict[str, Any] = field(default_factory=dict)  # pass name -> anything a pass leaves for others

    @property
    def attention_nodes(self) -> int:
        """How many FusedAttention nodes the model has now."""
        return count_attention_nodes(self.model) if self.model is not None else 0


class GraphPass:
    """One graph pass. Subclasses set ``name`` (what the report prints) and, when they serve
    some flavors only, ``flavors``; they override :meth:`run`, and :meth:`applies` for any
    other condition (call ``super().applies(context)`` to keep the flavor check)."""

    name: ClassVar[str] = ""
    flavors: ClassVar[Tuple[str, ...]] = ()  # the attention flavors it serves; () serves every flavor

    def applies(self, context: PassContext) -> bool:
        return not self.flavors or context.attention in self.flavors

    def run(self, model: onnx.ModelProto, context: PassContext) -> PassOutcome:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<pass {self.name}>"


class CountingPass(GraphPass):
    """A pass that is one function ``model -> how many it changed``: ``rewrite`` (a staticmethod),
    and ``note``, the report's line when it changed something (``{}``: the count)."""

    rewrite: ClassVar[Callable[[onnx.ModelProto], int]]
    note: ClassVar[str] = ""

    def run(self, model: onnx.ModelProto, context: PassContext) -> PassOutcome:
        changed = type(self).rewrite(model)
        return PassOutcome(changed, (self.note.format(changed),) if changed and self.note else ())

