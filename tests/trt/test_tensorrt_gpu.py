"""The TensorRT path for real: engines built with the FusedAttention plugin and checked against
PyTorch. Needs TensorRT's Python package, an NVIDIA GPU with a CUDA build of PyTorch, and the
plugin library (--plugin's defaults: $ATTN_EXPORT_TRT_PLUGIN or build/tensorrt/); each test
skips with the reason when one is missing (docs/tensorrt.md, "What was verified")."""
import json
from pathlib import Path

import onnx
import pytest
import torch

from attn_export import tensorrt as attn_trt
from helpers import run

pytestmark = pytest.mark.cuda


def _missing():
    try:
        attn_trt.require_runtime()
    except attn_trt.TensorRTUnavailable as exc:
        return str(exc)
    try:
        attn_trt.find_plugin_library()
    except attn_trt.PluginError as exc:
        return str(exc)
    return None


MISSING = _missing()
needs_tensorrt = pytest.mark.skipif(MISSING is not None, reason=f"TensorRT path unavailable: {MISSING}")


@pytest.fixture(scope="module")
def plugin():
    return attn_trt.find_plugin_library()


@needs_tensorrt
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_engine_matches_pytorch(small_seq2seq, tmp_path, plugin, dtype):
    from attn_export.onnx import export_onnx
    from attn_export.validation import BACKEND_TRT, validate

    inputs = small_seq2seq.example_inputs
    onnx_path = tmp_path / f"model-{dtype}.onnx"
    export_onnx(small_seq2seq, inputs, onnx_path, dtype=dtype)
    profile = attn_trt.derive_profile(onnx.load(str(onnx_path)), inputs)
    engine = tmp_path / f"model-{dtype}.engine"
    info = attn_trt.build_engine(onnx_path, engine, plugin=plugin, profile=profile)
    assert info.plugin_layers == info.attention_nodes == 3
    assert json.loads(Path(str(engine) + ".json").read_text())["plugin"]["sha256"] == attn_trt.file_sha256(plugin)
    report = validate(small_seq2seq, onnx_path, inputs, engine=engine, plugin=plugin)
    ran = [c for c in report.cases if c.backend == BACKEND_TRT and c.status != "skipped"]
    assert len({c.case for c in ran}) == 5, report.lines()
    assert report.passed, "\n".join(report.lines())


@needs_tensorrt
def test_cli_to_tensorrt(tmp_path, plugin):
    from torch import nn

    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True), 2).eval()
    model.example_inputs = {"src": torch.randn(2, 16, 64)}
    torch.save(model, tmp_path / "model.pt")
    run("model.pt", "--to", "tensorrt", "--plugin", plugin, "--json", "report.json", cwd=tmp_path, expect=0)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and report["engine"]["plugin_layers"] == 2
    assert any(c["backend"] == "tensorrt" and c["status"] == "passed" for c in report["cases"])


@needs_tensorrt
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_cached_decoder_generates_through_the_engine(tmp_path, plugin, dtype):
    """--with-past --to tensorrt: the engine's profile runs the past from 0 (the prefill) to
    --max-context - 1, and the generation gate's 16 greedy tokens through the engine (its cache
    kept on the GPU, CachedEngineSteps) equal generate()'s, every step within tolerance."""
    transformers = pytest.importorskip("transformers")
    from hf_models import tiny_llama

    assert transformers
    tiny_llama().config.save_pretrained(tmp_path)
    run("--model", "transformers:AutoModelForCausalLM", "--config", "config.json", "--with-past", "--to", "tensorrt",
        "--dtype", dtype, "--max-context", "64", "--plugin", plugin, "-o", "llama.engine", "--json", "report.json",
        cwd=tmp_path, expect=0)
    report = json.loads((tmp_path / "report.json").read_text())
    runs = {r["backend"]: r for r in report["generation"]["runs"]}
    assert report["passed"] and runs["tensorrt"]["tokens"] == report["generation"]["reference_tokens"]
    past = report["engine"]["profile"]["inputs"]["past_key_values.0.key"]
    assert past["min"][2] == 0 and past["max"][2] == 63
