"""The generation gate (attn_export.validation.generation): it passes the stock torch.onnx export
of a decoder with its cache (benchmarks/stock_cached.py, transformers' own attention), judged
against transformers' generate(), and FAILS exports broken the ways a cached export breaks: the
presents swapped, the positions wrong, one logit off; its report round-trips through JSON, JUnit
and HTML."""
import json
import xml.etree.ElementTree as ET

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

pytest.importorskip("transformers")

from attn_export.cache_contract import CacheContract  # noqa: E402
from attn_export.errors import InputError  # noqa: E402
from attn_export.validation import validate  # noqa: E402
from attn_export.validation.checks import cache_contract_check  # noqa: E402
from attn_export.validation.generation import (  # noqa: E402
    check_generation,
    left_padded,
    positions,
)
from benchmarks.stock_cached import export_stock_cached  # noqa: E402
from hf_models import tiny_gpt2, tiny_llama  # noqa: E402

NEW_TOKENS = 16


def _stock_export(tmp_path_factory, make, name):
    """A tiny decoder and its stock cached export (benchmarks/stock_cached.py), once per module."""
    model = make()
    path = tmp_path_factory.mktemp("gen") / f"{name}_stock.onnx"
    export_stock_cached(model, path)
    return model, path


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return _stock_export(tmp_path_factory, tiny_gpt2, "gpt2")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _stock_export(tmp_path_factory, tiny_llama, "llama")


def _rename_everywhere(model, old, new):
    for node in model.graph.node:
        node.input[:] = [new if n == old else n for n in node.input]
        node.output[:] = [new if n == old else n for n in node.output]


def swap_outputs(src, dst, a, b):
    """The graph's outputs ``a`` and ``b`` carry each other's values (e.g. a present key
    returned as the value)."""
    model = onnx.load(str(src))
    _rename_everywhere(model, a, a + "_inner")
    _rename_everywhere(model, b, b + "_inner")
    model.graph.node.extend([helper.make_node("Identity", [a + "_inner"], [b]),
                             helper.make_node("Identity", [b + "_inner"], [a])])
    onnx.save(model, str(dst))


def rewrite_input(src, dst, name, op, value):
    """Every consumer of input ``name`` reads ``op(name, value)`` instead (a wrong position)."""
    model = onnx.load(str(src))
    _rename_everywhere(model, name, name + "_wrong")
    const = helper.make_tensor(name + "_c", onnx.TensorProto.INT64, [], [value])
    model.graph.initializer.append(const)
    model.graph.node.insert(0, helper.make_node(op, [name, name + "_c"], [name + "_wrong"]))
    onnx.save(model, str(dst))


def perturb_logit(src, dst, index, delta):
    """logits[..., index] += delta: one vocabulary entry off at every position."""
    model = onnx.load(str(src))
    _rename_everywhere(model, "logits", "logits_inner")
    vocab = model.graph.output[0].type.tensor_type.shape.dim[2].dim_value
    bump = np.zeros(vocab, np.float32)
    bump[index] = delta
    model.graph.initializer.append(onnx.numpy_helper.from_array(bump, "logit_bump"))
    model.graph.node.append(helper.make_node("Add", ["logits_inner", "logit_bump"], ["logits"]))
    onnx.save(model, str(dst))


def test_positions_and_left_padding_follow_generate():
    ids, mask = left_padded([[5, 6], [7, 8, 9]], pad_id=0)
    assert ids.tolist() == [[0, 5, 6], [7, 8, 9]]
    assert mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    # transformers' generate(): cumsum(attention_mask) - 1, padding clipped at 0
    assert positions(mask).tolist() == [[0, 0, 1], [0, 1, 2]]


def test_stock_gpt2_export_generates_the_same_tokens(gpt2):
    model, path = gpt2
    result = check_generation(model, path, new_tokens=NEW_TOKENS)
    assert result.passed, result.failures
    run = result.runs[0]
    assert run.tokens == result.reference_tokens and len(run.steps) == NEW_TOKENS
    assert result.prompt_lengths == [5, 9, 12]
    assert run.prefill.shape == [3, 12, model.config.vocab_size]
    # float32 against float32: far inside the tolerance, but not bit-identical noise either way
    assert all(s.max_abs_err <= s.atol for s in run.steps) and run.prefill.max_abs_err <= run.prefill.atol


@pytest.mark.slow  # exports the Llama model (~8 s) besides
def test_stock_llama_gqa_export_generates_the_same_tokens(llama):
    model, path = llama
    layout = CacheContract.from_metadata(onnx.load(str(path)))
    assert (layout.num_kv_heads, model.config.num_attention_heads) == (2, 8)  # grouped-query
    result = check_generation(model, path, new_tokens=NEW_TOKENS)
    assert result.passed, result.failures
    assert result.runs[0].tokens == result.reference_tokens
    assert len({tuple(t) for t in result.reference_tokens}) == 3  # three different continuations


@pytest.mark.slow
def test_swapped_present_fails_at_the_first_decode_step(llama, tmp_path):
    model, path = llama
    broken = tmp_path / "swapped.onnx"
    swap_outputs(path, broken, "present.0.key", "present.0.value")
    result = check_generation(model, broken, new_tokens=NEW_TOKENS)
    assert not result.passed
    run = result.runs[0]
    assert run.prefill.passed  # the prefill never reads the past: the error shows from step 1
    assert run.steps[0].passed and not run.steps[1].passed
    assert any("step 1" in f for f in result.failures)
    assert run.first_divergence is not None and "reference margin" in run.divergence


def test_wrong_position_ids_fail(gpt2, tmp_path):
    model, path = gpt2
    broken = tmp_path / "positions.onnx"
    rewrite_input(path, broken, "position_ids", "Add", 1)  # GPT-2's absolute positions off by one
    result = check_generation(model, broken, new_tokens=4)
    assert not result.passed
    assert not result.runs[0].prefill.passed
    assert "max abs err" in result.runs[0].prefill.message


@pytest.mark.slow
def test_positions_ignoring_the_past_fail_for_rope(llama, tmp_path):
    """RoPE sees relative positions only, so a shift passes; positions that restart at 0 in every
    decode step (a runtime or export that ignores the past) must not."""
    model, path = llama
    broken = tmp_path / "positions.onnx"
    rewrite_input(path, broken, "position_ids", "Mul", 0)
    result = check_generation(model, broken, new_tokens=NEW_TOKENS)
    assert not result.passed


def test_one_perturbed_logit_fails_on_the_logits_not_the_tokens(gpt2, tmp_path):
    model, path = gpt2
    broken = tmp_path / "logit.onnx"
    # 10x the tolerance at the logits' scale (~1), far below the margin between the top tokens
    perturb_logit(path, broken, index=3, delta=1e-4)
    result = check_generation(model, broken, new_tokens=4)
    run = result.runs[0]
    assert not result.passed and run.first_divergence is None
    assert not run.prefill.passed and not any(s.passed for s in run.steps)
    assert all(1e-4 * 0.9 <= s.max_abs_err <= 1e-4 * 1.1 for s in run.steps)


def test_report_round_trips_and_fails_with_the_mismatch(gpt2, tmp_path):
    model, path = gpt2
    good = validate(model, path, {}, new_tokens=4)
    assert good.passed, good.failures
    data = json.loads(good.to_json())
    assert data["passed"] and data["generation"]["new_tokens"] == 4
    assert data["generation"]["runs"][0]["tokens"] == data["generation"]["reference_tokens"]
    cases = [c["case"] for c in data["cases"]]
    assert cases == ["generate/prefill"] + [f"generate/step {k}" for k in range(4)]
    assert {c["name"] for c in data["checks"]} >= {"cache layout", "dynamic axes", "generated tokens (onnxruntime)"}
    suite = ET.fromstring(good.to_junit_xml()).find("testsuite")
    assert int(suite.get("tests")) == len(data["cases"]) + len(data["checks"]) and suite.get("failures") == "0"

    broken = tmp_path / "swapped.onnx"
    swap_outputs(path, broken, "present.1.key", "present.1.value")
    bad = validate(model, broken, {}, new_tokens=4)
    assert not bad.passed
    suite = ET.fromstring(bad.to_junit_xml()).find("testsuite")
    assert int(suite.get("failures")) >= 1
    assert any(f.startswith("generate/step 1 / onnxruntime / logits") for f in bad.failures)


def test_html_report_shows_tokens_and_steps(gpt2, tmp_path):
    pytest.importorskip("matplotlib")
    model, path = gpt2
    broken = tmp_path / "swapped.onnx"
    swap_outputs(path, broken, "present.0.key", "present.0.value")
    page = validate(model, broken, {}, new_tokens=4).to_html()
    assert "<h2>Generation</h2>" in page and "generate/step 3" in page
    assert 'class="verdict failed"' in page


def test_cache_contract_names_what_is_missing(gpt2, tmp_path):
    _model, path = gpt2
    proto = onnx.load(str(path))
    layout = CacheContract.from_metadata(proto)
    assert cache_contract_check(proto, layout).passed
    proto.graph.input[3].name = "past.0.key"
    check = cache_contract_check(proto, layout)
    assert not check.passed and "no input past_key_values.0.key" in check.message


def test_file_without_cache_is_refused_with_the_fix(gpt2, tmp_path):
    model, path = gpt2
    proto = onnx.load(str(path))
    del proto.metadata_props[:]
    plain = tmp_path / "no_meta.onnx"
    onnx.save(proto, str(plain))
    with pytest.raises(InputError, match="--with-past"):
        check_generation(model, plain)
    with pytest.raises(InputError, match="--with-past"):
        validate(model, plain, {}, generation=True)


def test_non_generating_model_is_refused(gpt2):
    _model, path = gpt2
    with pytest.raises(InputError, match="causal LM"):
        check_generation(torch.nn.Linear(2, 2), path)


def test_cli_exit_codes_follow_the_generation(gpt2, tmp_path):
    from helpers import invoke

    model, path = gpt2
    model.save_pretrained(tmp_path / "gpt2")
    good = invoke("validate", tmp_path / "gpt2", path, "--new-tokens", "3", "--json", tmp_path / "good.json")
    assert good.returncode == 0, good.stdout + good.stderr
    assert json.loads((tmp_path / "good.json").read_text())["generation"]["new_tokens"] == 3
    broken = tmp_path / "swapped.onnx"
    swap_outputs(path, broken, "present.0.key", "present.0.value")
    bad = invoke("validate", tmp_path / "gpt2", broken, "--new-tokens", "3")
    assert bad.returncode == 1
    assert "generate/step 1 / onnxruntime / logits" in bad.stderr


def test_divergence_names_rows_tokens_and_the_reference_margin():
    from attn_export.validation.generation import _divergence

    reference = torch.tensor([[0.0, 2.0, 1.5], [3.0, 0.0, 0.0]])
    backend = torch.tensor([[0.0, 1.4, 1.6], [3.0, 0.0, 0.0]])  # row 0 picks token 2, row 1 agrees
    text = _divergence(backend, reference, reference.argmax(-1))
    assert text == "row 0: token 2 instead of 1 (reference margin between its top two logits 5.000e-01)"


def test_prompts_outside_the_vocabulary_are_refused(gpt2):
    model, path = gpt2
    with pytest.raises(InputError, match=r"\[0, 97\)"):
        check_generation(model, path, prompts=[[1, 2], [3, 97]])
    with pytest.raises(InputError, match="at least one token"):
        check_generation(model, path, prompts=[[1, 2], []])


def test_generation_joins_another_report_of_the_file(gpt2, tmp_path):
    from attn_export.validation.report import ValidationReport

    model, path = gpt2
    broken = tmp_path / "swapped.onnx"
    swap_outputs(path, broken, "present.0.key", "present.0.value")
    for file, passes in ((path, True), (broken, False)):
        report = ValidationReport(cases=[], checks=[], dtype="fp32", tolerance={}, environment={}, onnx_path=str(file),
                                  input_names=[], output_names=["logits"])
        check_generation(model, file, new_tokens=3).add_to(report)
        assert report.passed is passes
        assert [c.case for c in report.cases] == ["generate/prefill", "generate/step 0", "generate/step 1",
                                                  "generate/step 2"]
        assert report.to_dict()["generation"]["new_tokens"] == 3


def test_a_model_that_cannot_generate_is_compared_through_the_wrapped_decoder(gpt2):
    """A model without generate() gets validate's shape cases through the decoder wrapped with
    its cache as flat tensors: a model that is no such decoder is refused, saying the file is a
    cached export (tests/onnx/test_with_past.py runs the wrapped decoder's cases)."""
    _model, path = gpt2
    with pytest.raises(InputError, match="the file is a cached export, compared with the decoder it was exported "
                                         "from: --with-past exports a transformers decoder-only causal LM"):
        validate(torch.nn.Linear(2, 2), path, {})
