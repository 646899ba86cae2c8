"""The GenAI peer benchmark's table (benchmarks/genai_peers.py): ours over each of the builder's
files, per context and phase."""
from benchmarks import genai_peers
from benchmarks.onnx_runtime import paired_ratio
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


def test_paired_ratio_follows_the_rounds_not_the_drift_between_them():
    # The load doubles halfway through the rounds; every round shows ours 10% faster.
    peer = [1.0] * 5 + [2.0] * 6
    ours = [0.9 * t for t in peer]
    paired = paired_ratio(ours, peer)
    assert abs(paired["ratio"] - 0.9) < 1e-12
    low, high = paired["ratio_ci95"]
    assert low <= 0.9 <= high and high - low < 1e-9
    noisy = paired_ratio([0.8, 1.0, 1.2, 0.9, 1.1], [1.0] * 5)
    assert noisy["ratio_ci95"][0] < 1.0 < noisy["ratio_ci95"][1]


def test_table_shows_the_paired_ratio_and_its_interval():
    rows = [{"context": 128, "phase": phase, "implementation": OURS, "ms": 1.0, "rounds": 9, "same_tokens": True}
            for phase in ("prefill", "decode")]
    rows += [{"context": 128, "phase": phase, "implementation": BUILDER, "ms": 1.0, "rounds": 9, "same_tokens": True,
              "ratio": 0.95, "ratio_ci95": [0.93, 0.97]} for phase in ("prefill", "decode")]
    facts = {"cpu": "cpu", "isa": "avx2", "onnxruntime": "1.x", "onnxruntime_genai": "0.x"}
    text = genai_peers.markdown(rows, {}, "cmd", facts, 2, "load")
    assert "| 1 | 128 | decode (per token) | 1.00 | 1.00 | 0.95x (0.93-0.97) | yes |" in text
