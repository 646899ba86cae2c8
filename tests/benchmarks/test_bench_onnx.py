"""benchmarks.run --onnx: what its timing loop must not do to the implementations it compares.
The bench holds one ONNX Runtime session per implementation in one process; a
session whose workers keep spin-waiting after its run returns burns a core while the next
implementation is timed, which on 2 cores made the flavor timed after another one look slower."""

import os
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from benchmarks import onnx_runtime as bench_onnx

ort = pytest.importorskip("onnxruntime")


def _threads() -> set:
    return set(os.listdir("/proc/self/task"))


def _cpu_ms(threads) -> float:
    """CPU time the threads have run, in ms (the scheduler's own account, nanosecond resolution)."""
    total = 0
    for tid in threads:
        try:
            total += int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0])
        except FileNotFoundError:  # the thread has exited: it burns nothing any more
            pass
    return total / 1e6


N = 384  # large enough that ONNX Runtime splits the MatMul over its intra-op threads


def _matmul_model(path):
    weight = helper.make_tensor("w", TensorProto.FLOAT, [N, N], np.ones(N * N, np.float32))
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, N])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N, N])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def _worker_cpu_after_runs(make_session) -> float:
    """CPU ms the session's own worker threads burn in the 0.2 s after its last run returns."""
    before = _threads()
    session = make_session()
    workers = _threads() - before
    assert workers, "the session started no intra-op worker thread: nothing to measure"
    feeds = {"x": np.ones((N, N), np.float32)}
    for _ in range(20):
        session.run(None, feeds)
    start = _cpu_ms(workers)
    time.sleep(0.2)
    return _cpu_ms(workers) - start


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux's per-thread /proc accounting")
def test_a_bench_session_stops_its_workers_when_a_run_returns(tmp_path):
    path = tmp_path / "matmul.onnx"
    _matmul_model(path)

    def default_session():  # what the bench had: ONNX Runtime's defaults, 2 intra-op threads
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    spinning = _worker_cpu_after_runs(default_session)
    if spinning < 5:
        pytest.skip(f"this ONNX Runtime ({ort.__version__}) does not spin after a run by default "
                    f"({spinning:.1f} ms in 0.2 s): nothing to guard against")
    ours = _worker_cpu_after_runs(lambda: bench_onnx.onnx_session(path, 2))
    assert ours < 1.0, (f"the bench's session burned {ours:.1f} ms of CPU in the 0.2 s after its last run "
                        f"(ONNX Runtime's default: {spinning:.1f} ms): it would slow the next implementation timed")


def test_every_implementation_is_timed_at_every_position_of_a_round():
    impls = bench_onnx.IMPLEMENTATIONS
    orders = [bench_onnx.round_order(impls, index) for index in range(len(impls))]
    assert all(sorted(order) == sorted(impls) for order in orders)
    for position in range(len(impls)):
        assert sorted(order[position] for order in orders) == sorted(impls)


@pytest.mark.parametrize("count", [2, 3, 4, 5])
def test_no_implementation_is_timed_twice_in_a_row(count):
    # Its second block would find the caches its first one warmed (a 16 MB decoder fits in L3).
    impls = [f"impl{k}" for k in range(count)]
    sequence = [impl for index in range(3 * count) for impl in bench_onnx.round_order(impls, index)]
    assert all(a != b for a, b in zip(sequence, sequence[1:]))


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux's per-thread /proc accounting")
def test_the_gemm_rate_lines_onnx_runtime_stops_its_workers_when_a_run_returns():
    # The same guard for `bench --gemm`'s ONNX Runtime MatMul, timed between the GEMM backends.
    from benchmarks import gemm as bench_gemm

    before = _threads()
    run = bench_gemm._ort_statement(bench_gemm.Gemm("square", N, N, N), 2)
    workers = _threads() - before
    assert workers, "the session started no intra-op worker thread: nothing to measure"
    for _ in range(20):
        run()
    start = _cpu_ms(workers)
    time.sleep(0.2)
    burned = _cpu_ms(workers) - start
    assert burned < 1.0, f"the GEMM line's session burned {burned:.1f} ms of CPU in the 0.2 s after its last run"


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux's per-thread /proc accounting")
def test_the_core_benchs_onnx_runtime_stops_its_workers_when_a_run_returns(tmp_path):
    # `bench --core` times ONNX Runtime's MultiHeadAttention between attn-export's core and SDPA;
    # with its workers left spinning the core read 7.1 ms at L = 512 against 2.8 ms alone.
    from benchmarks import core as bench_core

    path = tmp_path / "matmul.onnx"
    _matmul_model(path)
    burned = _worker_cpu_after_runs(lambda: bench_core._session(path.read_bytes(), 2))
    assert burned < 1.0, f"the core bench's session burned {burned:.1f} ms of CPU in the 0.2 s after its last run"
