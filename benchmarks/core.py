"""The attention core alone against the best CPU kernels at hand, side by side in one process
(``python -m benchmarks.run --core``; docs/benchmarks.md).

Timed on q, k, v of ``[1, 4, L, 64]`` float32 (2 threads by default):

* forward (L = 512, 2048, 4096, not causal): ``attn_export.attention`` (the flash-style core,
  csrc/kernels/cpu/flash_cpu.cpp) against ONNX Runtime's ``com.microsoft.MultiHeadAttention``
  (a one-node model built here with onnx.helper, fed ``[1, L, 256]``) and PyTorch's
  ``F.scaled_dot_product_attention``, all three under no_grad / inference;
* forward+backward (L = 1024, 2048, causal and not): ``attn_export.attention`` against SDPA,
  ``out.backward(grad)`` with q, k, v requiring grad.

Every round times every implementation once (interleaved, so a burst of load on a shared machine
hits all of them alike; in an order that rotates from round to round, with ONNX Runtime's workers
told to stop spinning after a run); an implementation's time is the median over rounds of its
per-round median, and ratios are taken of those medians. Ratios below 1.00 mean attn-export is faster.

Each row also says how far the core is from this CPU's own limit: its GFLOP/s (the algorithm's
multiply-adds, 2 products forward and 5 backward with the recomputation of Q K^T, as FlashAttention
counts them; causal: the visible pairs only) against the float32 FMA peak of the same threads,
measured by benchmarks/csrc/fma_peak.cpp in the vector width the core runs with.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from benchmarks.onnx_runtime import interleaved_rounds, machine

BATCH, HEADS, HEAD_DIM = 1, 4, 64
FORWARD_SEQS = (512, 2048, 4096)
BACKWARD_SEQS = (1024, 2048)
CORE, ORT, SDPA = "attn_export", "ort MultiHeadAttention", "sdpa"


@dataclasses.dataclass
class CoreResult:
    mode: str  # "forward" or "forward+backward"
    seq: int
    causal: bool
    median_ms: Dict[str, float]  # per implementation: median over rounds of the per-round median
    ratios: Dict[str, float]  # "attn_export / <impl>" for every other implementation
    core_gflops: float = 0.0  # the core's rate: core_flops() / its median time
    of_peak: Optional[float] = None  # core_gflops / the FMA peak; None where no peak was measured


def mha_model_bytes(heads: int = HEADS, causal: bool = False) -> bytes:
    """A one-node ONNX model: com.microsoft.MultiHeadAttention on [batch, seq, heads * dim] inputs."""
    from onnx import TensorProto, helper

    dims = ["batch", "seq", heads * HEAD_DIM]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, dims) for name in ("query", "key", "value")]
    node = helper.make_node("MultiHeadAttention", ["query", "key", "value"], ["output"], domain="com.microsoft",
                            num_heads=heads, unidirectional=int(causal))
    graph = helper.make_graph([node], "core", inputs, [helper.make_tensor_value_info("output", TensorProto.FLOAT, dims)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def _session(model: bytes, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = threads, 1, 3
    # Its workers stop spinning when run() returns: left spinning (30-60 ms), they took a core
    # from the implementation timed next, which at L = 512 read 2.6x its time alone.
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def make_qkv(seq: int, seed: int = 0, requires_grad: bool = False):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=generator).requires_grad_(requires_grad)
            for _ in range(3)]


def forward_runners(seq: int, threads: int) -> Dict[str, Callable[[], object]]:
    import attn_export

    q, k, v = make_qkv(seq)
    # ONNX Runtime's contrib op takes [batch, seq, heads * dim]: the layout change is done once, here.
    feeds = {name: t.transpose(1, 2).reshape(BATCH, seq, HEADS * HEAD_DIM).contiguous().numpy()
             for name, t in zip(("query", "key", "value"), (q, k, v))}
    session = _session(mha_model_bytes(), threads)

    def core():
        with torch.inference_mode():
            return attn_export.attention(q, k, v)

    def sdpa():
        with torch.inference_mode():
            return F.scaled_dot_product_attention(q, k, v)

    return {CORE: core, ORT: lambda: session.run(None, feeds), SDPA: sdpa}


def backward_runners(seq: int, causal: bool) -> Dict[str, Callable[[], object]]:
    import attn_export

    q, k, v = make_qkv(seq, requires_grad=True)
    grad = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=torch.Generator().manual_seed(1))

    def step(fn):
        def run():
            q.grad = k.grad = v.grad = None
            fn(q, k, v, is_causal=causal).backward(grad)
        return run

    return {CORE: step(attn_export.attention), SDPA: step(F.scaled_dot_product_attention)}


def parity(seq: int = 256) -> Dict[str, float]:
    """Largest |difference| of the core's output from ONNX Runtime's and SDPA's (a sanity check
    that the three compute the same thing before they are timed)."""
    runners = forward_runners(seq, threads=1)
    core = runners[CORE]().numpy()
    ort = torch.from_numpy(runners[ORT]()[0]).reshape(BATCH, seq, HEADS, HEAD_DIM).transpose(1, 2).numpy()
    return {ORT: float(abs(core - ort).max()), SDPA: float(abs(core - runners[SDPA]().numpy()).max())}


def _time(runners: Dict[str, Callable[[], object]], rounds: int, min_run_time: float) -> Dict[str, float]:
    # The order rotates (onnx_runtime.round_order) and a pause separates the blocks, so that
    # whatever one leaves behind does not always fall on the same neighbour.
    per_round = interleaved_rounds(runners, rounds, min_run_time)
    return {impl: statistics.median(times) * 1e3 for impl, times in per_round.items()}


def core_flops(mode: str, seq: int, causal: bool) -> float:
    """Floating-point operations of one call at [1, 4, seq, 64]: 2 per multiply-add of the
    products over the (query, key) pairs that are visible."""
    pairs = seq * (seq + 1) / 2 if causal else float(seq * seq)
    products = 2 if mode == "forward" else 7  # forward: Q K^T, P V; backward: 5 more
    return 2.0 * products * BATCH * HEADS * pairs * HEAD_DIM


def fma_peak_gflops(threads: int, seconds: float = 0.5) -> float:
    """The float32 multiply-add ceiling of `threads` threads in GFLOP/s (benchmarks/csrc/fma_peak.cpp,
    best of repeated blocks over `seconds`); 0.0 where the core runs its generic kernels."""
    from benchmarks import probes

    probe = probes.library().attn_export_fma_peak_gflops
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return float(probe(threads, seconds))
    finally:
        torch.set_num_threads(previous)


def _result(mode: str, seq: int, causal: bool, medians: Dict[str, float], peak: float) -> CoreResult:
    ratios = {f"{CORE} / {impl}": medians[CORE] / medians[impl] for impl in medians if impl != CORE}
    gflops = core_flops(mode, seq, causal) / (medians[CORE] * 1e-3) * 1e-9
    return CoreResult(mode, seq, causal, medians, ratios, gflops, gflops / peak if peak > 0 else None)


def run_benchmark(forward_seqs=FORWARD_SEQS, backward_seqs=BACKWARD_SEQS, *, threads: int = 2, rounds: int = 5,
                  min_run_time: float = 0.2, peak: float = 0.0,
                  progress: Callable[[str], None] = lambda _m: None) -> List[CoreResult]:
    """peak: the FMA peak of `threads` threads (fma_peak_gflops) for the rows' share of it."""
    torch.set_num_threads(threads)
    results = []
    for seq in forward_seqs:
        progress(f"forward, L = {seq}")
        results.append(_result("forward", seq, False, _time(forward_runners(seq, threads), rounds, min_run_time),
                               peak))
    for seq in backward_seqs:
        for causal in (False, True):
            progress(f"forward+backward, L = {seq}{', causal' if causal else ''}")
            results.append(_result("forward+backward", seq, causal,
                                   _time(backward_runners(seq, causal), rounds, min_run_time), peak))
    return results


def core_isa() -> str:
    """The instruction set of the core's float32 kernels, as flash_cpu.cpp picked it."""
    import ctypes

    from attn_export import _C

    probe = ctypes.CDLL(_C.__file__).attn_export_flash_isa
    probe.restype = ctypes.c_char_p
    return probe().decode()


def markdown_table(results: List[CoreResult]) -> str:
    impls = list(dict.fromkeys(i for r in results for i in r.median_ms))
    ratio_cols = list(dict.fromkeys(c for r in results for c in r.ratios))
    lines = ["| mode | L | causal | " + " | ".join(f"{i} (ms)" for i in impls) + " | " + " | ".join(ratio_cols)
             + f" | {CORE} GFLOP/s | of FMA peak |",
             "|---" * (5 + len(impls) + len(ratio_cols)) + "|"]
    for r in results:
        cells = [f"{r.median_ms[i]:.2f}" if i in r.median_ms else "" for i in impls]
        cells += [f"{r.ratios[c]:.2f}x" if c in r.ratios else "" for c in ratio_cols]
        cells += [f"{r.core_gflops:.1f}", f"{r.of_peak:.0%}" if r.of_peak is not None else "not measured"]
        lines.append(f"| {r.mode} | {r.seq} | {'yes' if r.causal else 'no'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def facts(threads: int) -> Dict[str, str]:
    return {**machine(), "threads": str(threads), "core_isa": core_isa(),
            "shape": f"[{BATCH}, {HEADS}, L, {HEAD_DIM}] float32"}


def as_json(results: List[CoreResult], threads: int, rounds: int, check: Optional[Dict[str, float]],
            peak: float = 0.0) -> dict:
    return {"machine": facts(threads), "fma_peak_gflops": peak, "rounds": rounds, "parity_max_abs": check,
            "results": [dataclasses.asdict(r) for r in results]}
