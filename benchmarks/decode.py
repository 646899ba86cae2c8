"""Token-by-token generation on ONNX Runtime (CPU): prefill latency and decode latency per token
at a given context, the stock cached export (benchmarks/stock_cached.py: torch.onnx of the
unmodified model with its cache) against attn-export's cached export (``with_past=True``, the
same contract; exported here unless ``--ours FILE`` gives one) and attn-export's cache-less
export, which recomputes the whole prefix for every new token (docs/benchmarks.md, "Decoding
with the cache").

    python -m benchmarks.decode --contexts 128,1024,4096 --markdown benchmarks/results/decode.md \\
        --json benchmarks/results/decode.json [--ours llama_cached.onnx | --no-ours]

The model is a Llama-style decoder with grouped-query attention, random weights (seeded): hidden
256, 4 layers, 8 query heads over 2 key/value heads (head dim 32), MLP 688, vocabulary 2048.
Batch 1. At context C:

* ``prefill``: one call on C prompt tokens with an empty past;
* ``decode``: one call on 1 new token with a past of C tokens (the presents of the prefill), what
  each generated token costs; for the cache-less export, one call on C + 1 tokens.

Every session runs with the same intra-op thread count (``--threads``, 1 inter-op thread). The
implementations are timed in interleaved rounds (the order rotates, as in
benchmarks/onnx_runtime.py); a time is the median over rounds of the per-round median call.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

CONTEXTS = (128, 1024)
STOCK, OURS, CACHELESS = "stock torch.onnx (cache)", "attn-export (cache)", "attn-export (no cache)"
CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=8192, bos_token_id=0, eos_token_id=0, pad_token_id=0)


@dataclass
class Timing:
    context: int
    phase: str  # "prefill" | "decode"
    implementation: str
    ms: float
    rounds: int


def bench_model(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()


def export_cacheless(model, path: Path) -> Path:
    """attn-export's export without the cache (input_ids, attention_mask -> logits)."""
    from attn_export.onnx import export_onnx

    ids = torch.randint(1, model.config.vocab_size, (2, 16))
    export_onnx(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, path)
    return path


def export_ours(model, path: Path) -> Path:
    """attn-export's cached export (``with_past=True``: the stock export's names and layouts)."""
    from attn_export.onnx import export_onnx

    ids = torch.randint(1, model.config.vocab_size, (2, 16))
    export_onnx(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, path, with_past=True)
    return path


def _feeds(session, ids: np.ndarray, past: Dict[str, np.ndarray], past_len: int) -> Dict[str, np.ndarray]:
    """The inputs a session takes: ids, a mask of ones over past + new, positions after the past."""
    seq = ids.shape[1]
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, past_len + seq), np.int64)}
    names = {i.name for i in session.get_inputs()}
    if "position_ids" in names:
        feeds["position_ids"] = np.arange(past_len, past_len + seq, dtype=np.int64)[None]
    return {**feeds, **{n: v for n, v in past.items() if n in names}}


def _empty_past(session) -> Dict[str, np.ndarray]:
    return {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
            for i in session.get_inputs() if i.name.startswith("past_key_values.")}


def calls(session, cached: bool, context: int, seed: int = 0) -> Dict[str, Callable[[], object]]:
    """{"prefill": call, "decode": call} for one session at ``context``."""
    rng = np.random.default_rng(seed)
    vocab = session.get_outputs()[0].shape[-1]
    vocab = vocab if isinstance(vocab, int) else CONFIG["vocab_size"]
    prompt = rng.integers(1, vocab, (1, context + 1), dtype=np.int64)
    empty = _empty_past(session) if cached else {}
    prefill_feeds = _feeds(session, prompt[:, :context], empty, 0)
    if not cached:
        decode_feeds = _feeds(session, prompt, {}, 0)  # the whole prefix again, plus the new token
    else:
        outs = session.run(None, prefill_feeds)
        names = [o.name for o in session.get_outputs()]
        past = {"past_key_values." + n[len("present."):]: v for n, v in zip(names, outs) if n.startswith("present.")}
        decode_feeds = _feeds(session, prompt[:, context:], past, context)
    return {"prefill": lambda: session.run(None, prefill_feeds), "decode": lambda: session.run(None, decode_feeds)}


def _median_call(run: Callable[[], object], min_run_time: float, min_calls: int = 3) -> float:
    times, start = [], time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_run_time:
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_context(sessions: Dict[str, object], context: int, *, rounds: int, min_run_time: float,
                 settle_s: float = 0.05) -> List[Timing]:
    """Each implementation's prefill and decode at ``context``, interleaved over rounds."""
    from benchmarks.onnx_runtime import round_order

    runs = {impl: calls(s, impl != CACHELESS, context) for impl, s in sessions.items()}
    samples: Dict[tuple, List[float]] = {}
    for index in range(rounds):
        for impl in round_order(list(sessions), index):
            for phase, run in runs[impl].items():
                run()  # warm-up: allocations of this shape
                time.sleep(settle_s)
                samples.setdefault((impl, phase), []).append(_median_call(run, min_run_time))
    return [Timing(context, phase, impl, 1e3 * statistics.median(v), rounds) for (impl, phase), v in samples.items()]


def session(path: Path, threads: int):
    from benchmarks.onnx_runtime import onnx_session

    return onnx_session(path, threads)


def run_benchmark(files: Dict[str, Path], contexts: Sequence[int] = CONTEXTS, *, threads: int = 2, rounds: int = 5,
                  min_run_time: float = 0.2, progress: Callable[[str], None] = lambda _m: None) -> List[Timing]:
    sessions = {impl: session(path, threads) for impl, path in files.items()}
    results = []
    for context in contexts:
        progress(f"context {context}")
        results += time_context(sessions, context, rounds=rounds, min_run_time=min_run_time)
    return results


def markdown(results: List[Timing], command: str, facts: Dict[str, str], threads: int) -> str:
    impls = list(dict.fromkeys(t.implementation for t in results))
    table = {(t.context, t.phase, t.implementation): t.ms for t in results}
    lines = [f"`{command}`", "",
             f"CPU: {facts['cpu']} ({facts['isa']}), {threads} intra-op thread(s); onnxruntime {facts['onnxruntime']}; "
             f"torch {facts['torch']}; batch 1, float32; model: Llama-GQA "
             + ", ".join(f"{k}={v}" for k, v in CONFIG.items() if k.endswith(("size", "layers", "heads"))),
             "", "| context | phase | " + " | ".join(f"{i} (ms)" for i in impls) + " | "
             + " | ".join(f"{i} / {STOCK}" for i in impls if i != STOCK) + " |",
             "|---|---|" + "---:|" * (2 * len(impls) - 1)]
    for context in dict.fromkeys(t.context for t in results):
        for phase in ("prefill", "decode"):
            cells = [table.get((context, phase, i)) for i in impls]
            ref = table.get((context, phase, STOCK))
            ratios = [f"{c / ref:.2f}x" if c is not None and ref else "" for i, c in zip(impls, cells) if i != STOCK]
            lines.append(f"| {context} | {phase}{' (per token)' if phase == 'decode' else ''} | "
                         + " | ".join("" if c is None else f"{c:.2f}" for c in cells) + " | "
                         + " | ".join(ratios) + " |")
    return "\n".join(lines) + "\n"


def prepare_files(work: Path, ours: Optional[Path], cacheless: Optional[Path], no_cacheless: bool, seed: int,
                  progress: Callable[[str], None], no_ours: bool = False) -> Dict[str, Path]:
    """The ONNX files: the stock cached export (always written here), ours and the cache-less
    export as given or written here."""
    from benchmarks.stock_cached import export_stock_cached

    model = bench_model(seed)
    files = {STOCK: work / "stock_cached.onnx"}
    progress("exporting the stock cached model (torch.onnx)")
    export_stock_cached(model, files[STOCK])
    if not no_ours:
        if ours is None:
            progress("exporting attn-export's cached model")
            ours = export_ours(model, work / "ours_cached.onnx")
        files[OURS] = ours
    if not no_cacheless:
        if cacheless is None:
            progress("exporting attn-export's cache-less model")
            cacheless = export_cacheless(model, work / "cacheless.onnx")
        files[CACHELESS] = cacheless
    return files


def main(argv=None) -> int:
    import argparse

    from benchmarks.onnx_runtime import machine

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="comma-separated, e.g. 128,1024,4096")
    parser.add_argument("--ours", type=Path, help="attn-export's cached export of the same model (--seed; "
                        "default: exported here)")
    parser.add_argument("--no-ours", action="store_true", help="leave attn-export's cached export out")
    parser.add_argument("--cacheless", type=Path, help="attn-export's cache-less export (default: exported here)")
    parser.add_argument("--no-cacheless", action="store_true", help="leave the cache-less export out")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-run-time", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0, help="the model's weights")
    parser.add_argument("--work-dir", type=Path, help="where the exports go (default: a temporary directory)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        files = prepare_files(work, args.ours, args.cacheless, args.no_cacheless, args.seed, say, args.no_ours)
        contexts = [int(c) for c in args.contexts.split(",")]
        results = run_benchmark(files, contexts, threads=args.threads, rounds=args.rounds,
                                min_run_time=args.min_run_time, progress=say)
    facts = machine()
    command = "python -m benchmarks.decode " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(results, command, facts, args.threads)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"command": command, "machine": facts, "threads": args.threads,
                                         "config": CONFIG, "results": [asdict(r) for r in results]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
