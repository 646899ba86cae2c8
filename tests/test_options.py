"""The option groups (attn_export/options.py): checked when made, composed by ConvertOptions, and
taken by export_onnx, validate and check_generation alike; the flat keywords of before the groups
still work (ConvertOptions' as shorthand, validate's ort_* with a DeprecationWarning)."""
import dataclasses
import warnings

import pytest

from attn_export import ConvertOptions
from attn_export.errors import InputError
from attn_export.options import (
    CoverageOptions,
    EngineOptions,
    ExportOptions,
    GateOptions,
    OrtOptions,
    pop_legacy_ort,
    with_fields,
)


def test_flat_keywords_are_shorthand_for_the_groups():
    flat = ConvertOptions("m.engine", to="tensorrt", opset=23, attention="standard", dtype="fp16", with_past=True,
                          seed=3, verbose=True, ort_providers=["cpu", "cuda"], ort_trt_fp16=False, plugin="lib.so",
                          max_shapes={"input_ids": (2, 8)}, max_context=64, min_replaced=1, require_all=True,
                          runtime_timeout_s=9.0, genai_config=True, validate=False)
    grouped = ConvertOptions(
        "m.engine", to="tensorrt", genai_config=True, validate=False,
        export=ExportOptions(opset=23, attention="standard", dtype="fp16", with_past=True, seed=3, quiet=False),
        ort=OrtOptions(providers=("cpu", "cuda")),
        engine=EngineOptions(plugin="lib.so", max_shapes={"input_ids": (2, 8)}, max_context=64),
        coverage=CoverageOptions(min_replaced=1, require_all=True),
        gate=GateOptions(seed=3, runtime_timeout_s=9.0))
    assert flat == grouped
    # A flat keyword goes over the group given beside it; dataclasses.replace keeps working.
    over = ConvertOptions("m.onnx", export=ExportOptions(opset=23, dtype="fp16"), dtype="bf16")
    assert (over.export.opset, over.export.dtype) == (23, "bf16")
    assert dataclasses.replace(over, dynamic_axes={}).export == dataclasses.replace(over.export, dynamic_axes={})


def test_flat_reads_warn_and_read_the_group():
    options = ConvertOptions("m.onnx", with_past=True, seed=5, ort_providers=["cuda"])
    with pytest.warns(DeprecationWarning, match=r"ConvertOptions\.with_past is deprecated: read "
                                                r"ConvertOptions\.export\.with_past"):
        assert options.with_past is True
    with pytest.warns(DeprecationWarning):
        assert (options.seed, options.ort_providers, options.verbose) == (5, ("cuda",), False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert options.export.with_past and options.gate.seed == 5
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        options.nonsense  # noqa: B018
    with pytest.raises(TypeError, match="unexpected keyword argument 'nonsense'"):
        ConvertOptions("m.onnx", nonsense=1)


@pytest.mark.parametrize("make, words", [
    (lambda: ExportOptions(attention="fast"), "unknown ONNX attention flavor 'fast'"),
    (lambda: ExportOptions(functions="nested"), "unknown ONNX function mode 'nested'"),
    (lambda: ExportOptions(attention="standard", opset=20), "needs --opset 23 or later"),
    (lambda: ExportOptions(dtype="fp8"), "--dtype fp8: one of fp32, fp16, bf16"),
    (lambda: EngineOptions(max_context=1), "--max-context 1: at least 2"),
    (lambda: CoverageOptions(min_replaced=-1), "--min-replaced -1"),
    (lambda: GateOptions(runtime_timeout_s=0), "--runtime-timeout 0"),
    (lambda: GateOptions(new_tokens=0), "new_tokens must be at least 1, got 0"),
    (lambda: ConvertOptions("m.onnx", genai_config=True), "add with_past"),
    (lambda: ConvertOptions("m.onnx", max_context=8, with_past=True), "goes with --with-past --to tensorrt"),
])
def test_each_group_checks_its_values_when_made(make, words):
    with pytest.raises(InputError, match=words):
        make()


def test_a_functions_keywords_are_its_groups_fields():
    assert with_fields(GateOptions, None, {"seed": 2}, "validate") == GateOptions(seed=2)
    assert with_fields(GateOptions, GateOptions(new_tokens=3), {"seed": 2}, "validate") == GateOptions(2, new_tokens=3)
    with pytest.raises(TypeError, match=r"validate\(\) got unexpected keyword argument\(s\) sed \(its GateOptions "
                                        r"fields: seed, runtime_timeout_s"):
        with_fields(GateOptions, None, {"sed": 2}, "validate")


def test_the_former_ort_keywords_warn_and_fill_the_ort_group():
    fields = {"ort_providers": ["cpu", "tensorrt"], "ort_trt_fp16": True, "seed": 1}
    with pytest.warns(DeprecationWarning, match=r"ort=OrtOptions\(providers=\.\.\., trt_fp16=\.\.\.\)"):
        ort = pop_legacy_ort(fields, None, "validate")
    assert ort == OrtOptions(providers=("cpu", "tensorrt"), trt_fp16=True) and fields == {"seed": 1}
    assert pop_legacy_ort({}, None, "validate") is None


def test_export_onnx_validate_and_check_generation_refuse_an_unknown_keyword(tmp_path):
    from attn_export.onnx import export_onnx
    from attn_export.validation import check_generation, validate

    with pytest.raises(TypeError, match=r"export_onnx\(\) got unexpected keyword argument\(s\) opsets"):
        export_onnx(None, {}, tmp_path / "m.onnx", opsets=20)
    with pytest.raises(TypeError, match=r"validate\(\) got unexpected keyword argument\(s\) tokens"):
        validate(None, tmp_path / "m.onnx", {}, tokens=3)
    with pytest.warns(DeprecationWarning, match="ort_providers"), pytest.raises(InputError, match="no such file"):
        validate(None, tmp_path / "m.onnx", {}, ort_providers=["cpu"])
    with pytest.warns(DeprecationWarning, match="timeout_s"), pytest.raises(Exception):
        check_generation(None, tmp_path / "m.onnx", timeout_s=3.0)
