"""The GEMM-rate line of ``python -m benchmarks.run --gemm``: the layer's projection GEMMs, per GEMM
backend (attn_export.ops.gemm), against ONNX Runtime's ``MatMul`` on the same shapes.

Each projection x[m, k] W[n, k]^T runs through the extension's own projection path
(``attn_export_project_f32``, benchmarks/csrc/projection.cpp: what the layer calls,
micro-kernels included where the backend allows them), with the backend switched before each measurement; ONNX Runtime runs a one-node
``MatMul`` model with W^T as an initializer (MLAS prepacks it, as it does in an exported
model). Everything is timed in one process, interleaved in rounds; the minimum of the
per-round medians is kept (noise only ever inflates a time), as in benchmarks/layers.py.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, Iterable, List, Optional

import numpy as np
import torch
from torch.utils.benchmark import Timer

from attn_export.ops import gemm as _gemm
from benchmarks.onnx_runtime import round_order

ORT = "onnxruntime MatMul"

# Seconds between two timed blocks: long enough for OpenBLAS's spinning workers to park.
SETTLE_S = 0.2


@dataclasses.dataclass(frozen=True)
class Gemm:
    label: str  # which projection, e.g. "8x16x128x4 qkv"
    m: int      # tokens
    n: int      # output features
    k: int      # input features

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def projection_gemms(shapes) -> List[Gemm]:
    """The input (packed q|k|v) and output projections of benchmarks.layers.Shape layers."""
    gemms = []
    for s in shapes:
        tokens = s.batch * s.seqlen
        gemms += [Gemm(f"{s} qkv", tokens, 3 * s.embed, s.embed), Gemm(f"{s} out", tokens, s.embed, s.embed)]
    return list(dict.fromkeys(gemms))


@dataclasses.dataclass
class GemmRate:
    gemm: Gemm
    implementation: str  # a GEMM backend, "auto (<name>)", or ORT
    median_us: float
    gflops: float
    ratio_to_ort: Optional[float]  # GFLOP/s / ONNX Runtime's; >= 1.0 is at least as fast

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["gemm"] = dataclasses.asdict(self.gemm)
        return d


def _project_statement(gemm: Gemm) -> Callable[[], None]:
    from benchmarks import probes

    fn = probes.library().attn_export_project_f32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(gemm.m, gemm.k, generator=g)
    w = torch.randn(gemm.n, gemm.k, generator=g)
    bias = torch.randn(gemm.n, generator=g)
    out = torch.empty(gemm.m, gemm.n)
    args = (gemm.m, gemm.n, gemm.k, x.data_ptr(), w.data_ptr(), bias.data_ptr(), out.data_ptr())

    def run():
        fn(*args)

    run.keep_alive = (x, w, bias, out)
    return run


def _ort_statement(gemm: Gemm, threads: int) -> Callable[[], None]:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weight_t = rng.standard_normal((gemm.k, gemm.n), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w_t"], ["y"])], "projection",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [gemm.m, gemm.k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [gemm.m, gemm.n])],
        [numpy_helper.from_array(weight_t, "w_t")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Its workers stop spinning when run() returns instead of taking a core from whatever is
    # timed next (bench_onnx.py).
    options.add_session_config_entry("session.force_spinning_stop", "1")
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    feed = {"x": rng.standard_normal((gemm.m, gemm.k), dtype=np.float32)}
    return lambda: session.run(None, feed)


def run_gemm_rates(
    gemms: Iterable[Gemm],
    rounds: int = 10,
    min_run_time: float = 0.05,
    progress: Optional[Callable[[str], None]] = None,
) -> List[GemmRate]:
    """Every available backend, the automatic choice, and ONNX Runtime on each GEMM. The
    backend in force before the call is restored afterwards."""
    before = _gemm.gemm_backend()
    backends = [name for name, why in _gemm.available_backends().items() if not why]
    threads = torch.get_num_threads()
    results = []
    try:
        for gemm in gemms:
            if progress:
                progress(gemm.label)
            project = _project_statement(gemm)
            # name -> (the backend to put in force, or None for ONNX Runtime; the statement)
            stmts = {name: (name, project) for name in backends + ["auto"]}
            stmts[ORT] = (None, _ort_statement(gemm, threads))
            for backend, stmt in stmts.values():
                if backend:
                    _gemm.set_gemm_backend(backend)
                stmt()  # warm-up: thread pools, OpenBLAS buffers, ORT's prepacking
            medians: Dict[str, List[float]] = {name: [] for name in stmts}
            for index in range(rounds):
                for name in round_order(stmts, index):
                    backend, stmt = stmts[name]
                    if backend:
                        _gemm.set_gemm_backend(backend)
                    # OpenBLAS's workers spin after a call (for up to ~0.1 s) before they park:
                    # timed right after it, the micro-kernels ran at half their rate (50 against
                    # 98 GFLOP/s at 512x1536x512). The pause lets them park; the rotating order
                    # keeps any other such leftover from always falling on one neighbour.
                    time.sleep(SETTLE_S)
                    timer = Timer(stmt="stmt()", globals={"stmt": stmt}, num_threads=threads)
                    medians[name].append(timer.blocked_autorange(min_run_time=min_run_time).median)
            best = {name: min(times) for name, times in medians.items()}
            auto = _gemm.set_gemm_backend("auto")
            for name, seconds in best.items():
                gflops = gemm.flops / seconds / 1e9
                label = f"auto ({auto.name}{'+' + auto.microkernel if auto.microkernel else ''})" if name == "auto" else name
                results.append(GemmRate(gemm, label, seconds * 1e6, gflops,
                                        None if name == ORT else best[ORT] / seconds))
    finally:
        _gemm.set_gemm_backend(before.name if before.forced else "auto")
    return results


def markdown_table(results: List[GemmRate]) -> str:
    impls = list(dict.fromkeys(r.implementation for r in results))
    lines = ["| GEMM (m x n x k) | " + " | ".join(f"{i} GFLOP/s" for i in impls) + " |",
             "|---|" + "---:|" * len(impls)]
    for gemm in dict.fromkeys(r.gemm for r in results):
        row = {r.implementation: r for r in results if r.gemm == gemm}
        cells = [f"{row[i].gflops:.1f}" + (f" ({row[i].ratio_to_ort:.2f}x)" if row[i].ratio_to_ort else "")
                 for i in impls]
        lines.append(f"| {gemm.label} ({gemm.m}x{gemm.n}x{gemm.k}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)
