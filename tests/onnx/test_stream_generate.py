"""scripts/stream_generate.py (docs/huggingface.md, "Streaming tokens"): the tokens it prints
from a cached export, through ONNX Runtime and through ONNX Runtime GenAI, are the model's own
greedy generate()'s."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from attn_export.genai_config import write_genai_config  # noqa: E402
from attn_export.onnx import export_onnx  # noqa: E402
from attn_export.validation.generation import reference_generation  # noqa: E402
from hf_models import HF5, tiny_llama  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "stream_generate.py"
spec = importlib.util.spec_from_file_location("stream_generate", SCRIPT)
stream_generate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stream_generate)

PROMPT = [5, 17, 42, 8, 61]
NEW_TOKENS = 12
# Exports and generates (~40 s on one core): the slow tier.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HF5, reason="the cached export is checked with transformers 5")]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model = tiny_llama()
    # An end-of-sequence id greedy decoding of this prompt does not reach: GenAI stops there.
    model.config.eos_token_id = model.generation_config.eos_token_id = 96
    path = tmp_path_factory.mktemp("stream") / "model.onnx"
    export_onnx(model, {"input_ids": torch.tensor([PROMPT[:2]])}, path, with_past=True)
    write_genai_config(path, model.config)
    ids = torch.tensor([PROMPT])
    expected = reference_generation(model, ids, torch.ones_like(ids), NEW_TOKENS, 0, takes_positions=True)[0]
    return path, expected[0].tolist()


@pytest.mark.parametrize("runtime", ["onnxruntime", "genai"])
def test_the_streamed_tokens_are_generates(llama, runtime, capsys):
    if runtime == "genai":
        pytest.importorskip("onnxruntime_genai")
    path, expected = llama
    code = stream_generate.main([str(path), "--runtime", runtime, "--prompt-ids", ",".join(map(str, PROMPT)),
                                 "--new-tokens", str(NEW_TOKENS)])
    assert code == 0
    assert [int(t) for t in capsys.readouterr().out.split()] == expected


def test_a_file_without_its_cache_is_a_usage_error(tmp_path, capsys):
    model = tiny_llama()
    path = tmp_path / "plain.onnx"
    export_onnx(model, {"input_ids": torch.tensor([PROMPT])}, path)
    assert stream_generate.main([str(path), "--prompt-ids", "1,2"]) == 2
    assert "--with-past" in capsys.readouterr().err
