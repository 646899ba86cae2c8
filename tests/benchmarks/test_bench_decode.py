"""The decode benchmark (benchmarks/decode.py) times what it says: its decode call continues its
prefill through the cache (the stock cached export's and ours: the same next-token logits as the
cache-less export fed the whole prefix, and as PyTorch), and its table's ratios are to the stock
export."""
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import decode  # noqa: E402
from benchmarks.onnx_runtime import onnx_session  # noqa: E402
from benchmarks.stock_cached import export_stock_cached  # noqa: E402
from hf_models import tiny_llama  # noqa: E402


def test_table_gives_ratios_to_the_stock_export():
    rows = [decode.Timing(128, "decode", decode.STOCK, 2.0, 3), decode.Timing(128, "decode", decode.CACHELESS, 50.0, 3),
            decode.Timing(128, "prefill", decode.STOCK, 10.0, 3),
            decode.Timing(128, "prefill", decode.CACHELESS, 8.0, 3)]
    facts = {"cpu": "cpu", "isa": "avx2", "onnxruntime": "1.x", "torch": "2.x"}
    text = decode.markdown(rows, "python -m benchmarks.decode", facts, threads=2)
    assert "| 128 | decode (per token) | 2.00 | 50.00 | 25.00x |" in text
    assert "| 128 | prefill | 10.00 | 8.00 | 0.80x |" in text
    assert "2 intra-op thread(s)" in text and "`python -m benchmarks.decode`" in text


@pytest.mark.exhaustive  # three exports of the tiny Llama (~50 s): a benchmark's own run
def test_decode_call_continues_the_prefill(tmp_path):
    model = tiny_llama()
    stock = tmp_path / "stock.onnx"
    export_stock_cached(model, stock)
    plain = decode.export_cacheless(model, tmp_path / "plain.onnx")
    ours = decode.export_ours(model, tmp_path / "ours.onnx")
    context = 9
    cached_logits = decode.calls(onnx_session(stock, 1), True, context)["decode"]()[0]
    ours_logits = decode.calls(onnx_session(ours, 1), True, context)["decode"]()[0]
    plain_logits = decode.calls(onnx_session(plain, 1), False, context)["decode"]()[0]
    assert cached_logits.shape == (1, 1, model.config.vocab_size)
    assert plain_logits.shape == (1, context + 1, model.config.vocab_size)
    prompt = np.random.default_rng(0).integers(1, model.config.vocab_size, (1, context + 1))
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(prompt)).logits[0, -1].double()
    scale = float(expected.abs().max())
    assert ours_logits.shape == cached_logits.shape
    for got in (cached_logits[0, -1], ours_logits[0, -1], plain_logits[0, -1]):
        assert float((torch.from_numpy(got).double() - expected).abs().max()) <= 1e-5 * scale
