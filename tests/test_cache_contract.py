"""The cache's contract (attn_export/cache_contract.py): its names, axes and empty past, the
metadata it is written to a file as and read back from (a malformed value refused with the
fix), the one decision of how a cached export is checked, and that it is the one module of the
package that spells the cache's names and the only one of few that names the option."""
import ast
import json
import re
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

from attn_export.cache_contract import (
    METADATA_PROPERTY,
    CacheContract,
    generates,
    positions,
)
from attn_export.errors import InputError

PACKAGE = Path(__file__).resolve().parents[1] / "exporter" / "attn_export"
CONTRACT = CacheContract(num_layers=2, num_kv_heads=4, head_dim=16, position_ids=True, dtype="fp16")


def test_names_are_optimums_in_the_graphs_order():
    assert CONTRACT.input_names() == [
        "input_ids", "attention_mask", "position_ids", "past_key_values.0.key", "past_key_values.0.value",
        "past_key_values.1.key", "past_key_values.1.value"]
    assert CONTRACT.output_names() == ["logits", "present.0.key", "present.0.value", "present.1.key",
                                       "present.1.value"]
    no_positions = CacheContract(1, 1, 8, position_ids=False)
    assert no_positions.input_names() == ["input_ids", "attention_mask", "past_key_values.0.key",
                                          "past_key_values.0.value"]
    assert CONTRACT.layer_past_names(1) == ("past_key_values.1.key", "past_key_values.1.value")


def test_each_present_feeds_the_past_of_its_name():
    assert CONTRACT.present_to_past() == {f"present.{i}.{s}": f"past_key_values.{i}.{s}"
                                          for i in range(2) for s in ("key", "value")}
    # by name alone (an engine has no metadata), whatever the slot
    assert CacheContract.past_of("present.3.decoder.key") == "past_key_values.3.decoder.key"
    assert CacheContract.is_past("past_key_values.0.key") and not CacheContract.is_past("present.0.key")
    assert CacheContract.is_present("present.0.value") and not CacheContract.is_present("presents")


def test_genai_patterns_are_the_names_with_a_placeholder():
    assert CacheContract.past_name("%d", "key") % 5 == "past_key_values.5.key"
    assert CacheContract.present_name("%d", "value") % 0 == "present.0.value"


def test_axes_classify_every_input_by_name():
    assert CONTRACT.dynamic_axes() == {
        "input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total_sequence"},
        "position_ids": {0: "batch", 1: "sequence"},
        **{n: {0: "batch", 2: "past_sequence"} for n in CONTRACT.past_names()}}
    assert CacheContract.axes_of("logits") is None and CacheContract.axes_of("token_type_ids") is None


def test_the_empty_past_of_a_prefill():
    past = CONTRACT.empty_past(3)
    assert list(past) == CONTRACT.past_names()
    assert all(t.shape == (3, 4, 0, 16) and t.dtype == torch.float16 for t in past.values())
    assert CONTRACT.empty_past(1, torch.float32)["past_key_values.0.key"].dtype == torch.float32


def test_positions_count_from_the_left_padded_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert positions(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert positions(mask, 2).tolist() == [[1, 2], [3, 4]]


def test_metadata_round_trips_through_a_file():
    props = CONTRACT.to_metadata()
    assert list(props) == [METADATA_PROPERTY] == ["attn_export.with_past"]
    assert json.loads(props[METADATA_PROPERTY]) == {"num_layers": 2, "num_kv_heads": 4, "head_dim": 16,
                                                    "position_ids": True, "dtype": "fp16"}
    model = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    onnx.helper.set_model_props(model, {**props, "attn_export.dtype": "fp16"})
    model = onnx.load_from_string(model.SerializeToString())
    assert CacheContract.from_metadata(model) == CONTRACT
    # as attn_export.onnx.read_metadata gives it (the prefix stripped), and as a mapping of full keys
    assert CacheContract.from_metadata({"with_past": props[METADATA_PROPERTY]}) == CONTRACT
    assert CacheContract.from_metadata(props) == CONTRACT
    assert CacheContract.require(model, "m.onnx") == CONTRACT


def test_a_file_without_a_cache_has_no_contract():
    model = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    assert CacheContract.from_metadata(model) is None and CacheContract.from_metadata({}) is None
    with pytest.raises(InputError, match=r"m\.onnx has no key/value cache .*--with-past"):
        CacheContract.require(model, "m.onnx")


@pytest.mark.parametrize("raw, why", [
    ("not json", "Expecting value"),
    ("[2, 4]", "not a JSON object"),
    ('{"num_layers": 2, "num_kv_heads": 4, "head_dim": 16}', "position_ids"),
    ('{"num_layers": 0, "num_kv_heads": 4, "head_dim": 16, "position_ids": true}', "num_layers must be a positive"),
    ('{"num_layers": "2", "num_kv_heads": 4, "head_dim": 16, "position_ids": true}', "num_layers must be a positive"),
    ('{"num_layers": 2, "num_kv_heads": 4, "head_dim": 16, "position_ids": "no"}', "position_ids must be true or"),
    ('{"num_layers": 2, "num_kv_heads": 4, "head_dim": 16, "position_ids": true, "dtype": "int8"}',
     "dtype must be one of fp32"),
    ('{"num_layers": 2, "num_kv_heads": 4, "head_dim": 16, "position_ids": true, "layout": "seq2seq"}',
     "layout must be one of decoder, encoder-decoder"),
    ('{"num_layers": 2, "num_kv_heads": 4, "head_dim": 16, "position_ids": true, "shared_buffer": true}',
     "unknown field(s) shared_buffer"),
])
def test_a_malformed_value_is_refused_with_the_fix(raw, why):
    with pytest.raises(InputError, match=re.escape(why)) as info:
        CacheContract.from_metadata({METADATA_PROPERTY: raw})
    assert "attn_export.with_past is not the JSON the exporter writes" in str(info.value)
    assert "re-export the model with its cache" in str(info.value)


def test_one_decision_says_how_a_cached_export_is_checked():
    class Decoder(nn.Module):
        config = object()

        def generate(self):
            pass

    assert generates(Decoder())
    hidden = Decoder()
    hidden.generate = None  # an instance attribute hides the method
    assert not generates(hidden)
    assert not generates(nn.Linear(2, 2))  # no generate() and no config


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module


def test_the_contract_is_the_bottom_of_the_cached_export():
    """It imports only the standard library, torch and the package's errors: every layer above
    (surgery, onnx, validation, tensorrt) can use it, and it is never a cycle."""
    ours = {m for m in _imports(PACKAGE / "cache_contract.py") if m.startswith("attn_export")}
    assert ours == {"attn_export.errors"}


def _strings(path: Path):
    """The string constants of a module's code, its docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.value
        elif isinstance(node, ast.JoinedStr):  # an f-string: its parts with {} for each value
            yield "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)


def test_the_cache_names_are_spelled_in_the_contract_alone():
    """Every other module asks the contract for the names (the CLI's help text aside); a module
    that spells them again is a second contract to keep in step."""
    spelled = re.compile(r"past_key_values\.|\bpresent\.(\{|%|\d|\*)")
    modules = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if any(spelled.search(s) for s in _strings(p)))
    assert set(modules) <= {"cache_contract.py", "cli/convert.py"}, modules


def test_few_modules_name_the_option():
    """The option travels as the contract: the modules that name ``with_past`` are the option's
    own (CLI, convert, export_onnx) and the contract's metadata key (issue 58: at most 6)."""
    naming = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "with_past" in p.read_text())
    assert len(naming) <= 6, naming


@pytest.mark.parametrize("module, name", [
    ("attn_export.surgery.transformers.cache", "CacheGeometry"),
    ("attn_export.surgery.transformers.cache", "PAST"),
    ("attn_export.surgery.transformers.cache", "empty_past"),
    ("attn_export.onnx.with_past", "META_KEY"),
    ("attn_export.onnx.with_past", "generates"),
    ("attn_export.onnx.with_past", "file_geometry"),
    ("attn_export.onnx.with_past", "for_validation"),
    ("attn_export.validation.generation", "cache_layout"),
    ("attn_export.validation.generation", "require_cache_layout"),
    ("attn_export.validation.generation", "WITH_PAST"),
    ("attn_export.validation.cache_contract", "contract_names"),
    ("attn_export.validation.cache_contract", "declared_axes"),
    ("attn_export.validation.cache_contract", "cache_contract_check"),
    ("attn_export.tensorrt.generation", "PAST_PREFIX"),
    ("attn_export.tensorrt.generation", "past_name"),
])
def test_the_names_the_contract_replaced_still_import(module, name):
    import importlib

    with pytest.warns(DeprecationWarning, match=name):
        value = getattr(importlib.import_module(module), name)
    assert value is not None


def test_the_deprecated_names_keep_their_meaning():
    import warnings

    from attn_export.surgery.transformers import cache
    from attn_export.tensorrt import generation
    from attn_export.validation import cache_contract as old

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert cache.CacheGeometry is CacheContract
        assert cache.PAST.format(layer=1, kind="key") == "past_key_values.1.key"
        assert cache.PRESENT.format(layer=0, kind="value") == "present.0.value"
        assert (generation.PAST_PREFIX, generation.PRESENT_PREFIX) == ("past_key_values.", "present.")
        assert generation.past_name("present.1.value") == "past_key_values.1.value"
        assert old.contract_names(2, True) == (CONTRACT.input_names(), CONTRACT.output_names())
        assert old.declared_axes(CONTRACT) == CONTRACT.dynamic_axes()


SEQ2SEQ = CacheContract(num_layers=2, num_kv_heads=4, head_dim=16, position_ids=False, layout="encoder-decoder")


def test_an_encoder_decoder_takes_its_self_attention_past_and_gives_both_presents():
    assert SEQ2SEQ.encoder_decoder and not CONTRACT.encoder_decoder
    assert SEQ2SEQ.input_names() == ["input_ids", "encoder_hidden_states", "encoder_attention_mask",
                                     "past_key_values.0.decoder.key", "past_key_values.0.decoder.value",
                                     "past_key_values.1.decoder.key", "past_key_values.1.decoder.value"]
    assert SEQ2SEQ.output_names()[:5] == ["logits", "present.0.decoder.key", "present.0.decoder.value",
                                          "present.0.encoder.key", "present.0.encoder.value"]
    assert SEQ2SEQ.present_to_past() == {"present.0.decoder.key": "past_key_values.0.decoder.key",
                                         "present.0.decoder.value": "past_key_values.0.decoder.value",
                                         "present.1.decoder.key": "past_key_values.1.decoder.key",
                                         "present.1.decoder.value": "past_key_values.1.decoder.value"}
    assert SEQ2SEQ.axes_of("encoder_hidden_states") == {0: "batch", 1: "encoder_sequence"}
    assert SEQ2SEQ.axes_of("past_key_values.1.encoder.value") == {0: "batch", 2: "encoder_sequence"}
    assert SEQ2SEQ.axes_of("past_key_values.1.decoder.value") == {0: "batch", 2: "past_sequence"}
    assert SEQ2SEQ.encoder_input_names() == ["input_ids", "attention_mask"]
    assert SEQ2SEQ.encoder_output_names() == ["last_hidden_state"]
    whisper = CacheContract(2, 4, 16, False, layout="encoder-decoder", encoder_input="input_features")
    assert whisper.encoder_input_names() == ["input_features"]
    assert whisper.token_inputs() == ["input_ids", "encoder_hidden_states"]
    assert whisper.encoder_dynamic_axes() == {"input_features": {0: "batch"}}
    assert set(SEQ2SEQ.empty_past(3)) == set(SEQ2SEQ.past_names())


def test_the_layout_round_trips_and_a_decoder_only_file_keeps_its_fields():
    assert "layout" not in CONTRACT.to_dict() and "encoder_input" not in CONTRACT.to_dict()
    for contract in (SEQ2SEQ, CacheContract(1, 1, 8, False, layout="encoder-decoder", encoder_input="input_features")):
        assert CacheContract.from_metadata(contract.to_metadata()) == contract
    with pytest.raises(InputError, match="layout must be one of"):
        CacheContract.from_metadata({METADATA_PROPERTY: '{"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, '
                                                        '"position_ids": false, "layout": "mixture"}'})
    with pytest.raises(ValueError, match="no position_ids"):
        CacheContract(1, 1, 1, True, layout="encoder-decoder")
