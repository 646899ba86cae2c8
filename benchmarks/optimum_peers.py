"""Ours against Optimum's cached GPT-2 export with ONNX Runtime's transformers optimizer, both
run by plain ONNX Runtime (GPT-2 is the decoder a user takes to Optimum: ONNX Runtime GenAI's
model builder does not build it).

    python -m benchmarks.optimum_peers --optimum-python /work/venvs/optimum/bin/python \\
        --contexts 128,1024 --batches 1,4 --markdown OUT.md --json OUT.json

Optimum pins an older transformers, so it lives in an environment of its own, whose python
``--optimum-python`` names (see :data:`SETUP`). One GPT-2 (``GPT2LMHeadModel``: n_embd 256,
4 layers, 4 heads, vocabulary 2048, 8192 positions, random weights, seeded) saved with
``save_pretrained`` and exported twice from that folder:

* ours: ``attn-export DIR --to onnx --onnx-attention ort --with-past --no-validate``;
* the peer: ``optimum-cli export onnx --model DIR --task text-generation-with-past`` in the
  other environment, then ``onnxruntime.transformers.optimizer.optimize_model(model_type="gpt2")``
  (this environment's ONNX Runtime, the one that times both); the report names the fusions it made.

Both run in ONNX Runtime's CPU provider with the same session options (``--threads`` intra-op
threads, intra-op spinning off). At each batch B and context C: ``prefill`` runs C tokens over an
empty cache; ``decode`` runs one token after a cache of C, bound with an IOBinding as each file
expects: ours writes the new row in place into a buffer bound as both past and present (ONNX
Runtime GenAI's shared buffer, ``benchmarks/ort_decode_ab.py``), the peer returns a present of
C + 1 rows; ``decode, both append`` runs ours the peer's way too. Interleaved rounds (the order
rotates, :func:`benchmarks.onnx_runtime.interleaved_rounds`); a time is the median over rounds.
Before timing, both files (through their caches) and PyTorch generate 8 greedy tokens from
one prompt (printed), and each file's logits are compared with PyTorch's. The nodes each file has after ONNX
Runtime's own graph optimization are counted (an ``If`` branch's nodes apart).
"""
from __future__ import annotations

import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

OURS, PEER = "attn-export ort", "Optimum + ORT optimizer"
# initializer_range 0.1: at GPT-2's own 0.02 a random model repeats the prompt's last token, which
# would check nothing about the cache.
CONFIG = dict(vocab_size=2048, n_embd=256, n_layer=4, n_head=4, n_positions=8192, bos_token_id=1, eos_token_id=2,
              initializer_range=0.1)
PREFILL, DECODE, DECODE_APPEND = "prefill", "decode", "decode, both append"
SETUP = ("python3.11 -m venv /work/venvs/optimum && /work/venvs/optimum/bin/pip install torch==2.13.0 "
         "'optimum-onnx[onnxruntime]'")
PEER_VERSIONS = ("optimum", "optimum-onnx", "transformers", "torch", "onnxruntime", "onnx")


class PeerUnavailable(RuntimeError):
    """The other environment cannot run Optimum's exporter; the message says how to make one."""


def save_model(directory: Path, seed: int = 0, config: Optional[dict] = None) -> None:
    """The GPT-2 as a local transformers folder (no tokenizer: Optimum's export needs none)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**(config or CONFIG))).eval().save_pretrained(directory)


def peer_versions(python: Optional[str]) -> Dict[str, str]:
    """The other environment's package versions; raises :class:`PeerUnavailable` when
    ``python`` is not given, not there, or cannot import Optimum's exporter."""
    if not python:
        raise PeerUnavailable(f"--optimum-python is required: the python of an environment with Optimum's "
                              f"ONNX exporter (it pins an older transformers). Make one with: {SETUP}")
    if not Path(python).is_file():
        raise PeerUnavailable(f"--optimum-python {python}: no such file. Make the environment with: {SETUP}")
    probe = ("import importlib.metadata as m, json, optimum.exporters.onnx; "
             f"print(json.dumps({{p: m.version(p) for p in {PEER_VERSIONS!r}}}))")
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    except OSError as exc:
        raise PeerUnavailable(f"--optimum-python {python} does not run ({exc}). Make the environment with: {SETUP}")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise PeerUnavailable(f"--optimum-python {python} cannot import Optimum's exporter ({last}). "
                              f"Make the environment with: {SETUP}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def export_ours(hf: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cli = Path(sys.executable).with_name("attn-export")
    done = subprocess.run([str(cli), str(hf), "--to", "onnx", "--onnx-attention", "ort", "--with-past",
                           "--no-validate", "-o", str(out / "model.onnx")], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"attn-export failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return out / "model.onnx"


def export_peer(python: str, hf: Path, out: Path) -> tuple:
    """(the optimized file, the fusions ONNX Runtime's optimizer reports, non-zero only)."""
    from onnxruntime.transformers.optimizer import optimize_model

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # this checkout's packages are not the other environment's
    done = subprocess.run([python, "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", str(hf),
                           "--task", "text-generation-with-past", str(out)], capture_output=True, text=True, env=env)
    if done.returncode != 0 or not (out / "model.onnx").exists():
        raise PeerUnavailable(f"Optimum's export failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    config = json.loads((hf / "config.json").read_text())
    optimized = optimize_model(str(out / "model.onnx"), model_type="gpt2", num_heads=config["n_head"],
                               hidden_size=config["n_embd"])
    fused = {op: n for op, n in optimized.get_fused_operator_statistics().items() if n}
    optimized.save_model_to_file(str(out / "model_optimized.onnx"))
    return out / "model_optimized.onnx", fused


def session(path: Path, threads: int):
    import onnxruntime as ort

    from benchmarks.onnx_runtime import _session_options

    options = _session_options(threads)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def feeds(sess, tokens: np.ndarray, past: Optional[Dict[str, np.ndarray]] = None) -> Dict[str, np.ndarray]:
    """The inputs of one call: ``tokens`` [B, S] after ``past`` (name -> [B, H, P, D]; empty when None)."""
    batch, seq = tokens.shape
    length = next(iter(past.values())).shape[2] if past else 0
    out = {}
    for value in sess.get_inputs():
        if value.name == "input_ids":
            out[value.name] = tokens.astype(np.int64)
        elif value.name == "attention_mask":
            out[value.name] = np.ones((batch, length + seq), np.int64)
        elif value.name == "position_ids":
            out[value.name] = np.broadcast_to(np.arange(length, length + seq, dtype=np.int64), (batch, seq)).copy()
        elif value.name.startswith("past_key_values"):
            out[value.name] = past[value.name] if past else np.zeros(_cache_shape(value, batch, 0), np.float32)
    return out


def _cache_shape(value, batch: int, rows: int) -> tuple:
    """[B, heads, rows, head size] of a ``past_key_values.*`` input (heads and head size are static)."""
    return batch, value.shape[1], rows, value.shape[3]


def prefill_call(sess, batch: int, context: int) -> Callable[[], object]:
    prompt = np.random.default_rng(context).integers(4, CONFIG["vocab_size"], (batch, context))
    inputs = feeds(sess, prompt)
    return lambda: sess.run(None, inputs)


def decode_call(sess, batch: int, context: int, in_place: bool) -> Callable[[], object]:
    """One token after a cache of ``context`` rows, through an IOBinding; the call returns the
    binding. ``in_place``: each cache a buffer of ``context + 17`` rows bound as past and present
    (the operator writes row ``context``); otherwise a past of ``context`` rows in, a present of
    ``context + 1`` out. The first ``context`` rows are the same either way."""
    import onnxruntime as ort

    past = {}
    for k, value in enumerate(v for v in sess.get_inputs() if v.name.startswith("past_key_values")):
        rows = np.random.default_rng(k).random(_cache_shape(value, batch, context), dtype=np.float32)
        past[value.name] = np.concatenate([rows, np.zeros(_cache_shape(value, batch, 17), np.float32)], axis=2) \
            if in_place else rows
    inputs = feeds(sess, np.full((batch, 1), 5), past)
    inputs["attention_mask"] = np.ones((batch, context + 1), np.int64)
    if "position_ids" in inputs:
        inputs["position_ids"] = np.full((batch, 1), context, np.int64)
    binding, buffers = sess.io_binding(), {}
    for name, array in inputs.items():
        buffers[name] = ort.OrtValue.ortvalue_from_numpy(array)  # holds the array; the binding holds the OrtValue
        binding.bind_ortvalue_input(name, buffers[name])
    for value in sess.get_outputs():
        past_name = value.name.replace("present", "past_key_values")
        if in_place and past_name in past:
            binding.bind_ortvalue_output(value.name, buffers[past_name])
        else:
            binding.bind_output(value.name)

    def run():
        sess.run_with_iobinding(binding)
        return binding
    run.buffers = buffers
    return run


def greedy(sess, prompt: np.ndarray, steps: int) -> tuple:
    """(the prompt's logits [1, S, V] and each step's [1, 1, V], concatenated; ``steps`` greedy
    tokens), the cache fed back each step."""
    names = [v.name for v in sess.get_outputs()]
    out = dict(zip(names, sess.run(None, feeds(sess, prompt))))
    logits, tokens = [out["logits"]], []
    for _ in range(steps):
        tokens.append(int(out["logits"][0, -1].argmax()))
        past = {n.replace("present", "past_key_values"): v for n, v in out.items() if n.startswith("present")}
        out = dict(zip(names, sess.run(None, feeds(sess, np.array([[tokens[-1]]]), past))))
        logits.append(out["logits"])
    return np.concatenate(logits[:-1], axis=1), tokens


def torch_greedy(hf: Path, prompt: np.ndarray, steps: int) -> tuple:
    """PyTorch's (logits of the prompt and of each token it then picks, greedy tokens), the
    whole sequence recomputed each step, no cache."""
    import torch
    import transformers

    model = transformers.GPT2LMHeadModel.from_pretrained(hf).eval()
    ids = torch.from_numpy(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
        logits = model(ids[:, :-1]).logits.numpy()
    return logits, ids[0, prompt.shape[1]:].tolist()


def check_tokens(hf: Path, sessions: Dict[str, object], steps: int = 8, prompt_length: int = 16) -> dict:
    """Each file's greedy tokens and its logits' largest distance from PyTorch's, over the
    prompt and the steps that read the cache."""
    prompt = np.random.default_rng(1).integers(4, CONFIG["vocab_size"], (1, prompt_length))
    reference, expected = torch_greedy(hf, prompt, steps)
    result = {"prompt_length": prompt_length, "pytorch": expected}
    for name, sess in sessions.items():
        logits, tokens = greedy(sess, prompt, steps)
        result[name] = {"tokens": tokens, "max_abs_logit_diff": float(np.abs(logits - reference).max())}
    result["same_tokens"] = all(result[name]["tokens"] == expected for name in sessions)
    return result


def optimized_nodes(path: Path, threads: int) -> Dict[str, Dict[str, int]]:
    """Node types after ONNX Runtime's graph optimization (level ALL, CPU): the main graph's, and
    those inside its ``If`` branches (ours puts each layer's attention there, once per branch)."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        graph = onnx.load(so.optimized_model_filepath, load_external_data=False).graph
    branches = collections.Counter(n.op_type for node in graph.node for a in node.attribute
                                   if a.type == onnx.AttributeProto.GRAPH for n in a.g.node)
    return {"graph": dict(collections.Counter(n.op_type for n in graph.node).most_common()),
            "branches": dict(branches.most_common())}


def time_shape(sessions: Dict[str, object], batch: int, context: int, rounds: int, min_run_time: float) -> List[dict]:
    from benchmarks.onnx_runtime import interleaved_rounds

    ours, peer = sessions[OURS], sessions[PEER]
    groups = {PREFILL: {OURS: prefill_call(ours, batch, context), PEER: prefill_call(peer, batch, context)},
              DECODE: {OURS: decode_call(ours, batch, context, in_place=True),
                       PEER: decode_call(peer, batch, context, in_place=False),
                       DECODE_APPEND: decode_call(ours, batch, context, in_place=False)}}
    rows = []
    for phase, runners in groups.items():
        per_round = interleaved_rounds(runners, rounds, min_run_time)
        ms = {name: statistics.median(times) * 1e3 for name, times in per_round.items()}
        rows.append(_row(batch, context, phase, ms[OURS], ms[PEER], rounds))
        if DECODE_APPEND in ms:
            rows.append(_row(batch, context, DECODE_APPEND, ms[DECODE_APPEND], ms[PEER], rounds))
    return rows


def _row(batch: int, context: int, phase: str, ours: float, peer: float, rounds: int) -> dict:
    return {"batch": batch, "context": context, "phase": phase, OURS: ours, PEER: peer, "ratio": ours / peer,
            "rounds": rounds}


def markdown(rows: List[dict], report: dict) -> str:
    facts, peer = report["machine"], report["peer_versions"]
    check = report["check"]
    lines = [f"`{report['command']}`", "",
             f"CPU: {facts['cpu']} ({facts['isa']}), {report['threads']} intra-op threads on both sides, intra-op "
             f"spinning off; onnxruntime {facts['onnxruntime']}, transformers {facts['transformers']} (ours); "
             f"optimum {peer['optimum']}, optimum-onnx {peer['optimum-onnx']}, transformers {peer['transformers']} "
             f"(the peer's export); fp32; load before the run (`uptime`): {report['load']}", "",
             f"| batch | context | phase | {OURS} (ms) | {PEER} (ms) | ours / peer |", "|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | {r['phase']} | {r[OURS]:.2f} | {r[PEER]:.2f} | {r['ratio']:.2f}x |")
    lines += ["", f"Greedy tokens from a {check['prompt_length']}-token prompt: PyTorch {check['pytorch']}; "
              + "; ".join(f"{name} {check[name]['tokens']} (logits within {check[name]['max_abs_logit_diff']:.1e} "
                          "of PyTorch's)" for name in (OURS, PEER))
              + f": {'the same' if check['same_tokens'] else 'NOT the same'}.",
              "ONNX Runtime's optimizer fused in the peer: "
              + (", ".join(f"{op} x{n}" for op, n in report["peer_fusions"].items()) or "nothing")
              + ("" if set(report["peer_fusions"]) & {"Attention", "MultiHeadAttention", "GroupQueryAttention"}
                 else " (no attention: it runs as the exported MatMul, Softmax, MatMul)"), ""]
    for name, counts in report["optimized_nodes"].items():
        inside = ", ".join(f"{op} {n}" for op, n in counts["branches"].items())
        lines.append(f"* {name}: {sum(counts['graph'].values())} nodes after ONNX Runtime's optimization: "
                     + ", ".join(f"{op} {n}" for op, n in counts["graph"].items())
                     + (f"; inside its If branches: {inside}" if inside else ""))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import transformers

    from benchmarks.onnx_runtime import machine, timing_parser

    parser = timing_parser(__doc__, rounds=5)
    parser.add_argument("--optimum-python", help="python of the environment with Optimum (see the module's doc)")
    parser.add_argument("--contexts", default="128,1024")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds of calls per runner and round")
    parser.add_argument("--work", type=Path, default=None, help="folder for the model and both exports (default: temporary)")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    try:
        versions = peer_versions(args.optimum_python)
    except PeerUnavailable as exc:
        parser.error(str(exc))
    command = "python -m benchmarks.optimum_peers " + " ".join(argv if argv is not None else sys.argv[1:])
    load = os.popen("uptime").read().strip()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        hf = work / "hf"
        if not (hf / "config.json").exists():
            save_model(hf)
        paths = {OURS: export_ours(hf, work / "ours")}
        try:
            paths[PEER], fusions = export_peer(args.optimum_python, hf, work / "optimum")
        except PeerUnavailable as exc:
            print(f"optimum_peers: {exc}", file=sys.stderr)
            return 1
        sessions = {name: session(path, args.threads) for name, path in paths.items()}
        report = {"command": command, "machine": {**machine(), "transformers": transformers.__version__},
                  "peer_versions": versions, "load": load, "threads": args.threads, "peer_fusions": fusions,
                  "optimized_nodes": {name: optimized_nodes(path, args.threads) for name, path in paths.items()},
                  "check": check_tokens(hf, sessions)}
        print(f"greedy tokens: {json.dumps(report['check'])}", file=sys.stderr)
        rows = []
        for batch in (int(b) for b in args.batches.split(",")):
            for context in (int(c) for c in args.contexts.split(",")):
                print(f"batch {batch}, context {context}", file=sys.stderr)
                rows += time_shape(sessions, batch, context, args.rounds, args.min_run_time)
    report["results"] = rows
    text = markdown(rows, report)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
