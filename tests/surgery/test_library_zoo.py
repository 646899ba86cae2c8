"""The library zoo: models from libraries nobody on this project wrote (tests/surgery/library_zoo.py:
diffusers, torchtune, x-transformers, openai-whisper, segment-anything, vit-pytorch, timm,
sentence-transformers; small configs, random weights, nothing downloaded) through inspect ->
replace -> export -> validate, as a user runs them. The plan is what ran, site by site; the export
has one FusedAttention node per fused site; the parity gate passes in ONNX Runtime; --require-all
holds on every model fused in full. A library that does not install or import is skipped with
the reason (the zoo extra and `make install` bring them)."""
import tempfile
from pathlib import Path

import pytest
import torch

from attn_export.onnx import export_onnx
from attn_export.surgery.plan import plan_export
from attn_export.surgery.site_report import REPLACED, REWRITTEN, ROUTED, WILL_REPLACE, WILL_ROUTE
from attn_export.validation import validate

import library_zoo as zoo

pytestmark = pytest.mark.slow

_PAST = {WILL_REPLACE: REPLACED, WILL_ROUTE: ROUTED}


def _build(case):
    try:
        return case.build()
    except ImportError as exc:  # the library, or one of its own imports
        pytest.skip(f"{case.library} does not import here: {exc}")


# CI: every library once; `make test-all` also its second and third models (Stable Diffusion 3's and
# Flux's transformers beside the UNet; whisper under its SDPA switch beside its hand-written attention,
# the form the SDPA route meets in every other library here).
SECOND_MODELS = {"diffusers-sd3", "diffusers-flux", "whisper-sdpa"}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.exhaustive if name in SECOND_MODELS else ())
                                  for name in zoo.CASES])
def test_library_model_is_fused_exported_and_validated(name):
    case = zoo.CASES[name]
    model, inputs = _build(case)
    plan = plan_export(model, inputs)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{name}.onnx"
        result = export_onnx(model, inputs, path, dynamic_axes=case.dynamic)
        ran = result.replacement
        # The plan is what ran: every site, its status (in the past tense) and how it was found.
        assert [(s.path, _PAST.get(s.status, s.status), s.found) for s in plan.layers] == \
            [(s.path, s.status, s.found) for s in ran.layers], f"plan:\n{plan}\nran:\n{ran}"
        unfused = [s.path for s in ran.layers if s.status not in (REPLACED, ROUTED, REWRITTEN)]
        assert unfused == case.unfused, str(ran)
        assert result.num_attention_nodes == case.nodes, str(ran)
        if not case.unfused:
            assert ran.coverage_error(require_all=True) is None
        # Sites that are not nn.MultiheadAttention still report their geometry (from the calls or the graph).
        assert all(s.num_heads for s in ran.layers if s.path not in case.unfused), str(ran)
        report = validate(model, path, inputs, dynamic_axes=case.dynamic)
    assert report.passed, "\n".join(report.failures)
