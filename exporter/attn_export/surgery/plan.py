"""The export's plan, site by site, without exporting: what ``export_onnx`` will do to each
attention of a model with these example inputs. A copy is replaced as the export replaces it (a
sample forward finds the SDPA calls), captured with ``torch.export`` at the example shapes, and
the hand-written attention in the captured graph matched as the export matches it; the report
comes back in the future tense. ``attn-export inspect`` shows it."""
from __future__ import annotations

import copy
from typing import Mapping

import torch
from torch import nn

from attn_export.errors import first_line
from attn_export.surgery import transformers as _hf
from attn_export.surgery.replace import replace_attention
from attn_export.surgery.site_report import REPLACED, ROUTED, WILL_REPLACE, WILL_ROUTE, ReplacementReport

_FUTURE = {REPLACED: WILL_REPLACE, ROUTED: WILL_ROUTE}


def plan_export(model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> ReplacementReport:
    """What the export of ``model`` with ``inputs`` (name -> tensor) does to each attention site;
    ``model`` is not changed. Where the model cannot be captured, the hand-written attention is
    left undecided and a note says why."""
    from attn_export.surgery.patterns import rewrite

    work = copy.deepcopy(model).eval()
    if _hf.contains_hf_model(work):
        _hf.prepare_for_export(work)
    report = replace_attention(work, inputs)
    try:
        exported = torch.export.export(work, (), kwargs=dict(inputs), strict=False)
    except Exception as exc:  # noqa: BLE001 - the export will say it again, with its own message
        report.notes.append(f"torch.export could not capture the model, so hand-written attention was not matched: "
                            f"{first_line(exc)}")
    else:
        report.add_pattern_sites(rewrite(exported), work)
    for layer in report.layers:
        layer.status = _FUTURE.get(layer.status, layer.status)
    report.applied, report.surgery = False, None  # a plan: the copy's surgery is not the model's
    return report
