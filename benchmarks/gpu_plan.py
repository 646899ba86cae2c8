"""How long the GPU benchmark will take, printed before it starts and used to skip what does not
fit the budget: each column's call time from the rates measured on an H200 (issue 46's table),
times the calls that benchmarks/gpu_timing.py makes. A lead, not a promise: a slower GPU or a
faster kernel moves it."""
from __future__ import annotations

from benchmarks.gpu_cases import Case, attention_flops, kv_bytes
from benchmarks.gpu_impls import declines_early

# TFLOP/s (attention rows) by column, forward; forward+backward runs at BACKWARD_SPEED of it.
ASSUMED_TFLOPS = {"attn_export": 110.0, "flash": 300.0, "cudnn": 500.0, "efficient": 200.0, "math": 40.0}
CUDA_CORE_TFLOPS = 2.0  # attn_export at head dims its tensor-core kernels do not compile
TENSOR_CORE_HEAD_DIMS = (32, 64, 128)
BACKWARD_SPEED = 0.8
ASSUMED_GBS = {"attn_export": 1600.0, "flash": 2700.0, "cudnn": 4600.0, "efficient": 2000.0, "math": 300.0}
LAYER_TFLOPS = 100.0  # whole layer, projections included
SMALL_LAYER_S = 1e-3  # the seed's launch-bound shapes: about a millisecond a call, backward included
SETUP_S = 0.2  # inputs, first-call plans and compilation, freeing memory: per column


def call_s(case: Case, impl: str) -> float:
    """The assumed time of one call of one column."""
    if case.group == "small":
        return SMALL_LAYER_S
    if case.group == "layer":
        embed = case.heads * case.head_dim
        projections = 2 * 4 * case.batch * case.q_len * embed * embed
        flops = projections * (3 if case.mode == "forward+backward" else 1) + attention_flops(case)
        return flops / (LAYER_TFLOPS * 1e12)
    if case.group == "decode":
        return kv_bytes(case) / (ASSUMED_GBS[impl] * 1e9)
    tflops = ASSUMED_TFLOPS[impl]
    if impl == "attn_export" and case.head_dim not in TENSOR_CORE_HEAD_DIMS:
        tflops = CUDA_CORE_TFLOPS
    if case.mode == "forward+backward":
        tflops *= BACKWARD_SPEED
    return attention_flops(case) / (tflops * 1e12)


def column_s(one_call_s: float, timing) -> float:
    """Wall time of best_of_blocks for a call this long: warm-up, one call, the blocks."""
    block = max(timing.block_s, one_call_s)
    blocks = min(timing.blocks * block, timing.max_s + block)
    return SETUP_S + (timing.warmup + 1) * one_call_s + blocks


def case_s(case: Case, impls, timing) -> float:
    return sum(column_s(call_s(case, impl), timing) for impl in impls if not declines_early(impl, case))
