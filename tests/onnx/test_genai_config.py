"""A generation runtime nobody here wrote reads a cached export: ONNX Runtime GenAI
(``onnxruntime-genai``) loads the stock cached export (benchmarks/stock_cached.py) with the
``genai_config.json`` that attn_export.genai_config writes beside it, and generates the same
greedy tokens as transformers' generate().

ONNX Runtime GenAI 0.18 reads a padded batch as RIGHT-padded: it scans each row from the end and
masks the pad tokens it meets before the first other token (src/models/io/
default_position_inputs.cpp); pad tokens on the left are attended, with positions counted from
the row's start. The prompts are therefore given to it right-padded, to transformers left-padded
(its generation convention); the continuations must agree."""
import json

import onnx
import pytest

pytest.importorskip("transformers")

from attn_export.errors import InputError  # noqa: E402
from attn_export.genai_config import CONFIG_NAME, genai_config, write_genai_config  # noqa: E402
from attn_export.validation.generation import left_padded, random_prompts, reference_generation  # noqa: E402
from benchmarks.stock_cached import export_stock_cached  # noqa: E402
from hf_models import genai_greedy_tokens, tiny_gpt2, tiny_llama  # noqa: E402

NEW_TOKENS = 16
LENGTHS = (5, 9, 12)


def exported(tmp_path, model):
    path = tmp_path / "model.onnx"
    export_stock_cached(model, path)
    write_genai_config(path, model.config)
    return path


def transformers_tokens(model, prompts, pad_id):
    ids, mask = left_padded(prompts, pad_id)
    return reference_generation(model, ids, mask, NEW_TOKENS, pad_id, takes_positions=True)[0].tolist()


def check_same_tokens(tmp_path, model):
    path = exported(tmp_path, model)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
    prompts = random_prompts(model.config.vocab_size, LENGTHS, seed=0, avoid=[pad_id])
    expected = transformers_tokens(model, prompts, pad_id)
    assert len({tuple(t) for t in expected}) == len(prompts)  # a non-trivial comparison
    assert genai_greedy_tokens(path.parent, prompts, pad_id, NEW_TOKENS) == expected


@pytest.mark.slow  # an export of a transformers decoder (~5 s)
def test_config_names_the_contract(tmp_path):
    model = tiny_gpt2()
    path = tmp_path / "model.onnx"
    export_stock_cached(model, path)
    out = write_genai_config(path, model.config)
    assert out.name == CONFIG_NAME and out.parent == tmp_path
    config = json.loads(out.read_text())
    decoder = config["model"]["decoder"]
    graph = onnx.load(str(path))
    inputs = {v.name for v in graph.graph.input}
    outputs = {v.name for v in graph.graph.output}
    for i in range(model.config.n_layer):
        assert decoder["inputs"]["past_key_names"] % i in inputs
        assert decoder["inputs"]["past_value_names"] % i in inputs
        assert decoder["outputs"]["present_key_names"] % i in outputs
        assert decoder["outputs"]["present_value_names"] % i in outputs
    assert {decoder["inputs"][k] for k in ("input_ids", "attention_mask", "position_ids")} <= inputs
    assert (decoder["head_size"], decoder["num_key_value_heads"], decoder["num_hidden_layers"]) == (8, 4, 2)
    assert decoder["filename"] == "model.onnx" and config["search"]["past_present_share_buffer"] is False
    # no metadata, no config: the file is not a cached export
    del graph.metadata_props[:]
    with pytest.raises(InputError, match="--with-past"):
        genai_config(graph, "model.onnx", model.config)


@pytest.mark.slow  # an export of a transformers decoder (~5 s)
def test_a_config_without_an_end_token_is_refused_and_bos_falls_back(tmp_path):
    """GenAI reads every special token as a number: no eos_token_id is an error naming the
    fix; no bos_token_id (Qwen2's configs) falls back to the pad token."""
    model = tiny_gpt2()
    path = tmp_path / "model.onnx"
    export_stock_cached(model, path)
    graph = onnx.load(str(path))
    model.config.bos_token_id, model.config.pad_token_id = None, 5
    assert genai_config(graph, "model.onnx", model.config)["model"]["bos_token_id"] == 5
    model.config.eos_token_id = None
    with pytest.raises(InputError, match="set config.eos_token_id"):
        genai_config(graph, "model.onnx", model.config)


@pytest.mark.slow  # an export and GenAI's generator (~4 s)
def test_genai_generates_gpt2_tokens_like_transformers(tmp_path):
    pytest.importorskip("onnxruntime_genai")
    check_same_tokens(tmp_path, tiny_gpt2())


@pytest.mark.slow  # exports the Llama model (~10 s)
def test_genai_generates_llama_gqa_tokens_like_transformers(tmp_path):
    pytest.importorskip("onnxruntime_genai")
    check_same_tokens(tmp_path, tiny_llama())
