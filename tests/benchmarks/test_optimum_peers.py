"""The Optimum peer benchmark (benchmarks/optimum_peers.py) without Optimum's environment: it
refuses a missing or broken ``--optimum-python`` with a message that says how to make one; its
table's ratios are ours over the peer's; and what it times on our GPT-2 export is right (the
greedy tokens through the cache are PyTorch's, the in-place decode computes what the appending
decode computes, and writes the new row where the next call reads it)."""
import stat

import numpy as np
import pytest

pytest.importorskip("transformers")

from benchmarks import optimum_peers  # noqa: E402
from benchmarks.optimum_peers import OURS, PEER  # noqa: E402


def _error(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        optimum_peers.main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_no_optimum_python_is_a_clear_error(capsys):
    err = _error(capsys, "--contexts", "8")
    assert "--optimum-python is required" in err and "pip install" in err and "optimum-onnx" in err


def test_a_missing_optimum_python_is_a_clear_error(tmp_path, capsys):
    err = _error(capsys, "--optimum-python", str(tmp_path / "nowhere" / "python"))
    assert "no such file" in err and "python3.11 -m venv" in err


def test_a_python_without_optimum_is_a_clear_error(tmp_path, capsys):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named optimum' >&2\nexit 1\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    err = _error(capsys, "--optimum-python", str(broken))
    assert "cannot import Optimum's exporter (ModuleNotFoundError: No module named optimum)" in err
    assert "pip install" in err


def test_a_failing_optimum_export_is_a_clear_error(tmp_path, monkeypatch, capsys):
    versions = '{"optimum": "2.1.0"}'
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nif [ \"$1\" = -c ]; then echo '{versions}'; exit 0; fi\n"
                    "echo 'ValueError: no such task' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(optimum_peers, "save_model", lambda directory: None)
    monkeypatch.setattr(optimum_peers, "export_ours", lambda hf, out: out / "model.onnx")
    assert optimum_peers.main(["--optimum-python", str(fake), "--work", str(tmp_path / "work")]) == 1
    err = capsys.readouterr().err
    assert "Optimum's export failed (exit 3)" in err and "ValueError: no such task" in err


def test_table_gives_ours_over_the_peer():
    rows = [optimum_peers._row(4, 1024, optimum_peers.DECODE, 2.0, 8.0, 5),
            optimum_peers._row(1, 128, optimum_peers.PREFILL, 30.0, 20.0, 5)]
    check = {"prompt_length": 16, "pytorch": [7, 8], OURS: {"tokens": [7, 8], "max_abs_logit_diff": 1e-5},
             PEER: {"tokens": [7, 8], "max_abs_logit_diff": 2e-5}, "same_tokens": True}
    counts = {"graph": {"Gemm": 16, "If": 4}, "branches": {"GroupQueryAttention": 8}}
    report = {"command": "python -m benchmarks.optimum_peers", "load": "load average: 1.0", "threads": 2,
              "machine": {"cpu": "cpu", "isa": "avx2", "onnxruntime": "1.x", "transformers": "5.x"},
              "peer_versions": {"optimum": "2.1", "optimum-onnx": "0.1", "transformers": "4.57"},
              "peer_fusions": {"FastGelu": 4}, "check": check,
              "optimized_nodes": {OURS: counts, PEER: {"graph": {"MatMul": 21}, "branches": {}}}}
    text = optimum_peers.markdown(rows, report)
    assert "| 4 | 1024 | decode | 2.00 | 8.00 | 0.25x |" in text
    assert "| 1 | 128 | prefill | 30.00 | 20.00 | 1.50x |" in text
    assert ": the same." in text and "fused in the peer: FastGelu x4 (no attention" in text
    assert "20 nodes after ONNX Runtime's optimization: Gemm 16, If 4; inside its If branches: GroupQueryAttention 8" in text


@pytest.mark.exhaustive  # one GPT-2 export (~30 s): a benchmark's own run
def test_what_it_times_on_our_export_is_right(tmp_path):
    config = dict(optimum_peers.CONFIG, n_embd=64, n_layer=2, n_head=2, n_positions=256)
    optimum_peers.save_model(tmp_path / "hf", config=config)
    sess = optimum_peers.session(optimum_peers.export_ours(tmp_path / "hf", tmp_path / "ours"), threads=1)

    check = optimum_peers.check_tokens(tmp_path / "hf", {OURS: sess}, steps=6)
    assert check["same_tokens"] and len(set(check["pytorch"])) > 1, check
    assert check[OURS]["max_abs_logit_diff"] < 1e-4

    context = 9
    in_place = optimum_peers.decode_call(sess, 2, context, in_place=True)
    appended = optimum_peers.decode_call(sess, 2, context, in_place=False)
    np.testing.assert_allclose(in_place().copy_outputs_to_cpu()[0], appended().copy_outputs_to_cpu()[0],
                               rtol=1e-5, atol=1e-5)
    present = appended().copy_outputs_to_cpu()[1]  # present.0.key: the past's rows and the new one
    buffer = in_place.buffers["past_key_values.0.key"].numpy()
    np.testing.assert_allclose(buffer[:, :, :context + 1], present, rtol=1e-6, atol=1e-6)
    assert not buffer[:, :, context + 1:].any()
