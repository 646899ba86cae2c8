"""benchmarks/genai_profile.py on a tiny GPT-2 export: the decode steps' operators are found in
ONNX Runtime's profile, and their times add up to about a step's (not, say, the prompt's too)."""
import pytest

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai")

from attn_export.genai_config import write_genai_config  # noqa: E402
from benchmarks.genai_profile import profile  # noqa: E402
from benchmarks.stock_cached import export_stock_cached  # noqa: E402
from hf_models import tiny_gpt2  # noqa: E402


@pytest.mark.exhaustive  # an export and GenAI's generator (~12 s): a benchmark's own run
def test_profile_sums_the_decode_steps_operators(tmp_path):
    model = tiny_gpt2()
    folder = tmp_path / "gpt2"
    folder.mkdir()
    path = folder / "model.onnx"
    export_stock_cached(model, path)
    write_genai_config(path, model.config)
    result = profile(folder, context=90, new_tokens=3)  # a prompt several steps long
    ops = result["ops_us"]
    assert "MatMul" in ops or "Gemm" in ops, ops
    assert result["step_us"] > 0
    # Without a subgraph every node runs once per step, inside the session run: the prompt's nodes
    # counted too would push the sum past a step.
    assert "If" not in ops and 0 < sum(ops.values()) <= 1.2 * result["step_us"], (ops, result["step_us"])
    assert (tmp_path / "gpt2_profile" / "genai_config.json").exists()
