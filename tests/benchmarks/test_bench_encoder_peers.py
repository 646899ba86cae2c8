"""The encoder benchmark (benchmarks/encoder_peers.py) compares what it says: both files run the
same shapes, match PyTorch eager, and the peer's file carries the fusions of ONNX Runtime's
optimizer; its table's ratios are ours over the peer."""
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime.transformers.optimizer")

from benchmarks import encoder_peers  # noqa: E402


def test_table_gives_ours_over_the_peer():
    rows = [{"model": "bert", "batch": 1, "seq": 128, "implementation": encoder_peers.OURS, "ms": 3.0,
             "max_abs_diff": 1e-6},
            {"model": "bert", "batch": 1, "seq": 128, "implementation": encoder_peers.PEER, "ms": 4.0,
             "max_abs_diff": 2e-6}]
    files = {"bert": {name: {"file_ops": {"MatMul": 12}, "fusions": "fused", "optimized_nodes": {"MatMul": 12}}
                      for name in (encoder_peers.OURS, encoder_peers.PEER)}}
    facts = {"cpu": "cpu", "isa": "avx2", "onnxruntime": "1.x", "torch": "2.x", "transformers": "5.x"}
    text = encoder_peers.markdown(rows, files, "python -m benchmarks.encoder_peers", facts, 2, "load")
    assert "| bert | 1 | 128 | 3.00 | 4.00 | 0.75x | 1.0e-06 / 2.0e-06 |" in text
    assert "`python -m benchmarks.encoder_peers`" in text and "2 intra-op threads" in text


def test_padded_rows_mask_their_tail():
    mask = encoder_peers.make_inputs("bert", 4, 16)["attention_mask"]
    assert mask.sum(1).tolist() == [14, 12, 10, 8]


@pytest.mark.exhaustive  # two exports of the BERT encoder and a timing round (~25 s): a benchmark's own run
def test_both_files_time_the_smallest_shape_and_match_pytorch(tmp_path):
    out = tmp_path / "peers.json"
    assert encoder_peers.main(["--models", "bert", "--batches", "1", "--seqs", "128", "--rounds", "1",
                               "--min-run-time", "0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["implementation"]: r for r in result["results"]}
    assert set(rows) == {encoder_peers.OURS, encoder_peers.PEER}
    assert all((r["batch"], r["seq"]) == (1, 128) and r["ms"] > 0 for r in rows.values())
    assert all(r["max_abs_diff"] < 1e-4 for r in rows.values()), rows
    files = result["files"]["bert"]
    assert files[encoder_peers.PEER]["file_ops"].get("Attention") == 4  # the optimizer's fusion fired
    assert files[encoder_peers.OURS]["file_ops"].get("MultiHeadAttention") == 4
