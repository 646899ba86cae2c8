"""The sample run before the capture: the attention replaced (optionally), the model run on the
example inputs, its outputs named, the axes that share a symbol, the inputs resized where
torch.export would specialize them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Set

import torch
from torch import nn

from attn_export import inputs as _inputs
from attn_export.errors import InputError, first_line as _first_line
from attn_export.onnx import dims as _dims
from attn_export.onnx.outputs import output_names_for


@dataclass
class SampleRun:
    report: Optional[object]  # the ReplacementReport; None without replacement
    output_names: List[str]
    trace_inputs: Dict[str, torch.Tensor]  # the inputs, resized where torch.export would specialize
    notes: List[str]
    shared: Set[str]  # the axis labels traced as one named Dim (onnx/dims.py)


def sample_run(work: nn.Module, inputs, axes, replace: bool, seed: int) -> SampleRun:
    """Replaces the attention of ``work`` (optionally), runs it on the inputs and names its
    outputs. The replacement's plan is a sample forward with the export's inputs (it finds where
    SDPA calls run), and the run after it, on the routed model, says which calls were fused."""
    from attn_export.surgery.replace import replace_attention

    report = replace_attention(work, inputs) if replace else None
    with torch.no_grad():
        try:
            outputs = work(**inputs)
        except Exception as exc:  # noqa: BLE001 - the model rejected the inputs
            raise InputError(f"the model rejected the example inputs {_inputs.describe(inputs)}: {_first_line(exc)}") from exc
    output_names = output_names_for(outputs, taken=inputs)
    confirmed = report.confirm_calls(work) if report is not None else []
    # Decided on the example as given: resizing an axis of size 1 to 2 can make sizes agree.
    shared, notes = _dims.shared_labels(inputs, axes)
    trace_inputs, resized = _check_trace_sizes(inputs, axes, seed)
    notes.extend(resized)
    notes.extend(f"not fused: {line}" for line in confirmed)
    return SampleRun(report, output_names, trace_inputs, notes, shared)


def _check_trace_sizes(inputs, axes, seed):
    """Example sizes below 2 on a dynamic axis would be specialized by torch.export (0/1
    specialization); trace at size 2 instead."""
    sizes = _inputs.label_sizes(inputs, axes)
    small = {label: 2 for label, size in sizes.items() if size < 2}
    if not small:
        return inputs, []
    note = (
        "traced at size 2 for " + ", ".join(sorted(small)) +
        " (an example size of 1 would be baked into the graph as a constant)"
    )
    return _inputs.resize(inputs, axes, {**sizes, **small}, seed=seed), [note]
