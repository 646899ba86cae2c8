"""The GenAI peer benchmark's table (benchmarks/genai_peers.py): ours over each of the builder's
files, per context and phase."""
from benchmarks import genai_peers
from benchmarks.genai_peers import BUILDER, OURS, PRUNED


def test_table_gives_ours_over_each_builder_file():
    rows = [{"context": 128, "phase": phase, "implementation": name, "ms": ms, "rounds": 3, "same_tokens": True}
            for phase, times in (("prefill", (8.0, 10.0, 9.0)), ("decode", (0.5, 0.4, 0.5)))
            for name, ms in zip((OURS, BUILDER, PRUNED), times)]
    facts = {"cpu": "cpu", "isa": "avx2", "onnxruntime": "1.x", "onnxruntime_genai": "0.x"}
    text = genai_peers.markdown(rows, {}, "python -m benchmarks.genai_peers --all-logits", facts, 2, "load",
                                ours_label=OURS + " --all-logits", family="qwen2")
    assert f"| batch | context | phase | {OURS} --all-logits (ms) | {BUILDER} (ms) | {PRUNED} (ms) | ours / {BUILDER} | " \
           f"ours / {PRUNED} | same tokens |" in text
    assert "| 1 | 128 | prefill | 8.00 | 10.00 | 9.00 | 0.80x | 0.89x | yes |" in text
    assert "qwen2, fp32" in text
    assert "| 1 | 128 | decode (per token) | 0.50 | 0.40 | 0.50 | 1.25x | 1.00x | yes |" in text
