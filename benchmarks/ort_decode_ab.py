"""One decode step of cached decoder files, side by side in plain ONNX Runtime, with the cache
written in place as ONNX Runtime GenAI's shared buffer does (docs/benchmarks.md, "ONNX Runtime
GenAI: the ort flavor against the model builder"):

    python -m benchmarks.ort_decode_ab A/model.onnx B/model.onnx --context 1024

Each file gets one session (``--threads`` intra-op threads, intra-op spinning off: a spinning
pool steals the cores from the next session on a shared machine) and one IOBinding: one new
token at position C, an attention mask of C + 1 ones, and each ``past_key_values.*`` buffer
allocated at C + 17 positions and bound as the matching ``present.*`` output too (what GenAI's
``past_present_share_buffer`` does). The files need not have the same inputs (the builder's
has no ``position_ids``; a cache axis the file leaves symbolic is ``--kv-heads`` / ``--head-dim``,
the decoder of genai_peers.py by default). Interleaved rounds (the order rotates: no file runs twice in a row, each at every position); a time is the median over
rounds of the median of ``--steps`` runs, each timed; the minimum is printed beside it, and each
file over the last one as the median of the rounds' paired ratios with its 95% bootstrap interval.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import List

import numpy as np


def bound_session(path: str, context: int, threads: int, kv_shape=(2, 32)):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    binding, buffers = session.io_binding(), {}
    for value in session.get_inputs():
        ints = np.int64 if "int64" in value.type else np.int32
        if value.name == "input_ids":
            binding.bind_cpu_input(value.name, np.array([[5]], ints))
        elif value.name == "attention_mask":
            binding.bind_cpu_input(value.name, np.ones((1, context + 1), ints))
        elif value.name == "position_ids":
            binding.bind_cpu_input(value.name, np.array([[context]], ints))
        elif value.name.startswith("past_key_values"):
            heads, dim = (d if isinstance(d, int) else default for d, default in zip(value.shape[1::2], kv_shape))
            buffer = np.random.default_rng(0).random((1, heads, context + 17, dim), dtype=np.float32)
            buffers[value.name] = ort.OrtValue.ortvalue_from_numpy(buffer)
            binding.bind_ortvalue_input(value.name, buffers[value.name])
    for value in session.get_outputs():
        past = value.name.replace("present", "past_key_values")
        if past in buffers:
            binding.bind_ortvalue_output(value.name, buffers[past])
        else:
            binding.bind_output(value.name)
    return session, binding, buffers


def main(argv=None) -> int:
    from benchmarks.onnx_runtime import paired_ratio, round_order, timing_parser

    parser = timing_parser(__doc__, rounds=31)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    args = parser.parse_args(argv)
    runs = [bound_session(f, args.context, args.threads, (args.kv_heads, args.head_dim)) for f in args.files]
    times: List[List[float]] = [[] for _ in runs]
    print(os.popen("uptime").read().strip())
    for r in range(args.rounds):
        for k in round_order(range(len(runs)), r):
            session, binding, _ = runs[k]
            session.run_with_iobinding(binding)
            steps = []
            for _ in range(args.steps):
                start = time.perf_counter()
                session.run_with_iobinding(binding)
                steps.append(time.perf_counter() - start)
            times[k].append(statistics.median(steps) * 1e3)
    for path, t in zip(args.files, times):
        versus = ""
        if t is not times[-1]:
            paired = paired_ratio(t, times[-1])
            versus = f", {paired['ratio']:.3f}x the last ({paired['ratio_ci95'][0]:.3f}-{paired['ratio_ci95'][1]:.3f})"
        print(f"{path}: median {statistics.median(t):.3f} ms, min {min(t):.3f} ms{versus} (context {args.context})")
    print(os.popen("uptime").read().strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
