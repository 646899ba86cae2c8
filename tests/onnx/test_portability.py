"""The exports in other ONNX tools: every consumer of portability_consumers (optimizers,
converters, the quantizer, onnx.reference, OpenVINO) gets four small models (portability_models)
in both attention flavors, float32 and float16, and what it makes of them must match the PyTorch
model at three shapes and ONNX Runtime on the same file, at the dtype's tolerance. Consumers
that do not read model-local functions get the function-free export (``functions="inline"``);
on the default export they may fail, but loudly. A consumer whose package is missing is skipped
with its reason. The fast tier runs the nn.Transformer (causal self-attention, padded
cross-attention: two body variants in one file) in float32 through every consumer.

``ATTN_EXPORT_PORTABILITY_TABLE=path.md`` writes the consumer x flavor table of
docs/onnx_consumers.md from the results of the run."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from attn_export.onnx import export_onnx
from helpers import assert_parity
import portability_consumers as consumers
import portability_models as models

# Relative to the reference's largest magnitude: float32 round-off over a few layers; float16
# storage between the layers; int8 weights (the quantizer).
TOLERANCE = {"fp32": 1e-5, "fp16": 1e-2}
QUANTIZED_TOLERANCE = 5e-2
MODELS = ("encoder", "seq2seq", "bert", "gpt2")
FLAVORS = ("custom", "standard")
DTYPES = ("fp32", "fp16")
FAST = ("seq2seq", "custom", "fp32")

RESULTS: dict = {}  # (consumer, flavor) -> {(model, dtype): max rel err vs PyTorch | "FAIL" | "skip" | "n/a"}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """(model, flavor, dtype, functions) -> (Case, path), each exported once."""
    folder = tmp_path_factory.mktemp("portability")
    built, cases = {}, {}

    def get(name, flavor, dtype, functions="local"):
        key = (name, flavor, dtype, functions)
        if key not in built:
            if name not in cases:
                if name in ("bert", "gpt2"):
                    pytest.importorskip("transformers")
                cases.update(models.cases([name]))
            case = cases[name]
            path = folder / ("_".join(key) + ".onnx")
            export_onnx(case.model, case.batch(*models.SHAPES[0], 0), path, attention=flavor, dtype=dtype,
                        functions=functions)
            built[key] = (case, path)
        return built[key]

    return get


def _feeds(case, dtype, shape_index):
    batch = case.batch(*models.SHAPES[shape_index], shape_index + 1)
    half = dtype == "fp16"
    return batch, {k: v.numpy().astype(np.float16) if half and v.dtype == torch.float32 else v.numpy()
                   for k, v in batch.items()}


# CI runs half of each consumer's model x flavor x dtype matrix, pairwise: every model in both
# flavors and both dtypes, every flavor in both dtypes (the pairing alternates between models).
# The consumers that cost seconds a file (a Python interpreter of every op, an OpenVINO compile,
# Polygraphy's constant folding through ONNX Runtime) get one cell per model in CI, which still
# holds every flavor in both dtypes. `make test-all` runs the rest; the fast tier the FAST cell.
HEAVY = {"onnx.reference", "OpenVINO", "polygraphy surgeon sanitize --fold-constants"}


def _in_ci(consumer, name, flavor, dtype) -> bool:
    if (name, flavor, dtype) == FAST:
        return True
    m, f, d = MODELS.index(name), FLAVORS.index(flavor), DTYPES.index(dtype)
    if consumer in HEAVY:
        return (f, d) == (m % 2, m // 2 % 2)
    return (m + f + d) % 2 == 0


def _matrix():
    for consumer in consumers.CONSUMERS:
        for name in MODELS:
            for flavor in FLAVORS:
                for dtype in DTYPES:
                    marks = () if (name, flavor, dtype) == FAST else (pytest.mark.slow,)
                    if not _in_ci(consumer, name, flavor, dtype):
                        marks += (pytest.mark.exhaustive,)
                    yield pytest.param(consumer, name, flavor, dtype, marks=marks,
                                       id=f"{consumer}-{name}-{flavor}-{dtype}")


@pytest.mark.parametrize("consumer,name,flavor,dtype", list(_matrix()))
def test_consumer_matches_pytorch_and_onnx_runtime(export, tmp_path, consumer, name, flavor, dtype):
    record = RESULTS.setdefault((consumer, flavor), {})
    record[(name, dtype)] = "FAIL"  # until it passes
    if consumer == "ORT quantize_dynamic" and dtype != "fp32":
        record[(name, dtype)] = "n/a"
        pytest.skip("quantize_dynamic quantizes float32 models (its DynamicQuantizeLinear takes float32 only)")
    functions = "inline" if consumer in consumers.NEED_INLINE else "local"
    case, path = export(name, flavor, dtype, functions)
    try:
        run = consumers.CONSUMERS[consumer](path, tmp_path)
    except consumers.Missing as missing:
        record[(name, dtype)] = "skip"
        pytest.skip(str(missing))
    ort = consumers.ort_runner(path)
    rel = QUANTIZED_TOLERANCE if consumer == "ORT quantize_dynamic" else TOLERANCE[dtype]
    worst = 0.0
    for index in range(len(models.SHAPES)):
        batch, feeds = _feeds(case, dtype, index)
        with torch.no_grad():
            want = models.first_output(case.model(**batch))
        valid = case.valid(batch)
        got = torch.from_numpy(np.asarray(run(feeds)[0]).astype(np.float32))
        from_ort = torch.from_numpy(np.asarray(ort(feeds)[0]).astype(np.float32))
        what = f"{consumer} on {name} ({flavor}, {dtype}) at {tuple(batch[next(iter(batch))].shape)}"
        assert_parity(got[valid], want[valid], rel, f"{what} vs PyTorch")
        assert_parity(got[valid], from_ort[valid], rel, f"{what} vs ONNX Runtime")
        worst = max(worst, float((got[valid] - want[valid]).abs().max() / want[valid].abs().max()))
    record[(name, dtype)] = f"{worst:.0e}"


@pytest.mark.parametrize("consumer", sorted(consumers.NEED_INLINE))
def test_consumers_without_function_support_fail_loudly_on_the_default_export(export, tmp_path, consumer):
    """The default (local-function) export in a consumer that does not read model-local
    functions: an error, or the right answer, never a wrong one."""
    case, path = export(*FAST)
    try:
        run = consumers.CONSUMERS[consumer](path, tmp_path)
        batch, feeds = _feeds(case, "fp32", 1)
        got = torch.from_numpy(np.asarray(run(feeds)[0]))
    except consumers.Missing as missing:
        pytest.skip(str(missing))
    except Exception:  # noqa: BLE001 - loud is what is asked for
        return
    with torch.no_grad():
        want = models.first_output(case.model(**batch))
    assert_parity(got, want, TOLERANCE["fp32"], f"{consumer} on the default export")


def _cell(record, dtype):
    """One table cell: the consumer on one flavor's exports of one dtype (the four models)."""
    values = [v for (name, d), v in record.items() if d == dtype]
    if not values:
        return "not run"
    failed = values.count("FAIL")
    if failed:
        return f"**FAIL** ({failed} of {len(values)} models)"
    if all(v == "n/a" for v in values):
        return "n/a (float32 only)"
    errors = [float(v) for v in values if v not in ("n/a", "skip")]
    if not errors:
        return "skipped (not installed)"
    return f"pass, {len(errors)} models, {max(errors):.0e}"


def teardown_module(module):
    target = os.environ.get("ATTN_EXPORT_PORTABILITY_TABLE")
    if not target or not RESULTS:
        return
    columns = [(flavor, dtype) for flavor in FLAVORS for dtype in DTYPES]
    lines = ["| consumer | " + " | ".join(f"{flavor} {dtype}" for flavor, dtype in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for consumer in consumers.CONSUMERS:
        suffix = " (function-free export)" if consumer in consumers.NEED_INLINE else ""
        cells = [_cell(RESULTS.get((consumer, flavor), {}), dtype) for flavor, dtype in columns]
        lines.append(f"| {consumer}{suffix} | " + " | ".join(cells) + " |")
    Path(target).write_text("\n".join(lines) + "\n")
