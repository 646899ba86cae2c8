"""The model captured as ONNX: torch.export (with the shared Dims of onnx/dims.py, the pattern
rewrite), then torch.onnx.export with the operators' translations."""
from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Set

import torch
from torch import nn

from attn_export.errors import ExportError, first_line as _first_line
from attn_export.onnx import dims as _dims
from attn_export.onnx.sample import SampleRun
from attn_export.onnx.translation import translation_table
from attn_export.surgery import transformers as _hf
from attn_export.surgery.patterns import rewrite as rewrite_patterns


@contextlib.contextmanager
def _quiet_exporter(enabled: bool):
    """torch's exporter prints progress and warnings; keep the tool's output clean."""
    if not enabled:
        yield
        return
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export", "onnxscript", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _translations(model: nn.Module) -> dict:
    """torch.onnx's custom translations: the attn_export operators', over transformers' own for
    the ops its models emit (transformers models only)."""
    table = _hf.models.onnx_translations() if _hf.contains_hf_model(model) else {}
    table.update(translation_table())
    return table


def capture(work, sample: SampleRun, axes, opset: int, quiet: bool):
    """torch.export, the pattern rewrite, then torch.onnx.export: the ModelProto."""
    with _quiet_exporter(quiet):
        exported = _trace(work, sample, axes)
        if sample.report is not None:
            # Hand-written softmax(q k^T) v in the captured graph -> the operator (exact matches only).
            sample.report.add_pattern_sites(rewrite_patterns(exported), work)
        try:
            program = torch.onnx.export(
                exported, (), dynamo=True, opset_version=opset,
                custom_translation_table=_translations(work), output_names=sample.output_names,
                optimize=True, verbose=False, external_data=False,
            )
        except Exception as exc:  # noqa: BLE001
            raise ExportError(f"torch.onnx.export failed: {_first_line(exc)}") from exc
    return program.model_proto


def _trace(work, sample: SampleRun, axes):
    """torch.export with the shared Dims (onnx/dims.py). Where torch.export refuses the one
    batch Dim, or ties it to an axis declared otherwise, the model is traced again with a batch
    symbol per input (a note says why)."""
    shared = sample.shared
    if _dims.BATCH in shared:
        try:
            exported = _export(work, sample.trace_inputs, axes, shared)
            absorbed = _dims.absorbed(exported, axes, {_dims.BATCH})
            if not absorbed:
                return exported
            why = f"the trace tied it to {', '.join(absorbed)}"
        except Exception as exc:  # noqa: BLE001 - traced again below
            why = f"torch.export refused it: {_first_line(exc)}"
        sample.notes.append(f"the inputs' batch axes are separate symbols, not one {_dims.BATCH!r} ({why})")
        shared = shared - {_dims.BATCH}
    try:
        return _export(work, sample.trace_inputs, axes, shared)
    except Exception as exc:  # noqa: BLE001 - surfaced as one line (traceback with --verbose)
        raise ExportError(f"torch.export could not capture the model: {_first_line(exc)}{_hint(exc)}") from exc


def _export(work, trace_inputs, axes, shared: Set[str]):
    # torch.export first, by hand: given a module, torch.onnx.export falls back to
    # torch.export.draft_export when export proper fails, which ignores shape guards and can
    # label an axis dynamic that the model specializes. An ExportedProgram is taken as it is.
    return torch.export.export(work, (), kwargs=trace_inputs, strict=False,
                               dynamic_shapes=_dims.dynamic_shapes(trace_inputs, axes, shared) if axes else None)


def _hint(exc: BaseException) -> str:
    """What to try for the capture failures whose fix is known."""
    if "SymBool" in str(exc):
        return (" (a bool computed from a dynamic size, such as is_causal=q.shape[2] > 1: keep that input's "
                "sequence static, e.g. --dynamic NAME:0=batch for it, or --static)")
    return ""
