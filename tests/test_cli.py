"""The attn-export console script, run as users run it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

EXE = [sys.executable, "-m", "attn_export.cli"]


def run(*args, check=True):
    proc = subprocess.run([*EXE, *args], capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_help_lists_verbs():
    out = run("--help").stdout
    for verb in ("convert", "inspect", "validate", "bench", "heatmap"):
        assert verb in out
    assert "attn-export MODEL --to onnx" in out


@pytest.mark.parametrize("verb,words", [
    ("convert", ["--to", "--input", "--example-inputs", "--dynamic", "--static", "--opset", "--dtype",
                 "--no-validate", "--trust-model-file", "EXECUTES CODE", "--allow-class", "--model", "--weights",
                 "--quiet", "--verbose", "--json", "--junit", "--min-replaced", "transformers:CLASS",
                 "--config", "save_pretrained folder", "--onnx-attention", "--ort-provider", "--html"]),
    ("inspect", ["--allow-class", "--trust-model-file", "--require-all"]),
    ("validate", ["[MODEL] ONNX", "--input", "--json", "--junit", "Exit codes", "--ort-provider", "--html"]),
    ("heatmap", ["--layer", "--batch-index", "--format", "--max-layers", "--max-heads", "--input"]),
    ("export", ["--to"]),  # alias of convert
])
def test_every_verb_explains_itself(verb, words):
    out = " ".join(run(verb, "--help").stdout.split())
    for word in words:
        assert word in out, word


def test_bench_help():
    out = run("bench", "--help").stdout
    assert "--shapes" in out and "--onnx" in out


def test_bench_smoke_writes_json_and_markdown(tmp_path: Path):
    json_path, md_path = tmp_path / "b.json", tmp_path / "b.md"
    run("bench", "--shapes", "2x3x16x2", "--mode", "forward", "--rounds", "1", "--min-run-time", "0.01",
        "--json", str(json_path), "--markdown", str(md_path))
    payload = json.loads(json_path.read_text())
    impls = {r["implementation"] for r in payload["results"]}
    assert impls == {"fused", "nn.MultiheadAttention", "sdpa"}
    assert all(r["median_us"] > 0 for r in payload["results"])
    assert "2x3x16x2" in md_path.read_text()


@pytest.mark.parametrize("bad", ["8x16", "8x16x10x3", "axbxcxd"])
def test_bench_rejects_bad_shapes_with_exit_2(bad):
    proc = run("bench", "--shapes", bad, check=False)
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_plot_and_memory(tmp_path: Path):
    pytest.importorskip("matplotlib", reason="--plot needs the bench extra: pip install 'attn-export[bench]'")
    png, json_path = tmp_path / "latency.png", tmp_path / "b.json"
    run("bench", "--shapes", "1x8x16x2,1x32x16x2", "--mode", "inference", "--rounds", "1",
        "--min-run-time", "0.01", "--no-sdpa", "--plot", str(png), "--memory", "1x64x16x2",
        "--json", str(json_path))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    memory = json.loads(json_path.read_text())["memory"]
    assert {m["implementation"] for m in memory} == {"fused", "nn.MultiheadAttention"}
    assert all(m["peak_mb"] >= m["baseline_mb"] > 0 for m in memory)
