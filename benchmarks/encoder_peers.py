"""Encoders in plain ONNX Runtime (CPU): the ort flavor against torch.onnx plus ONNX Runtime's
transformers optimizer, the pair a user would pick instead (docs/benchmarks.md, "Encoders: the ort
flavor against ONNX Runtime's transformers optimizer").

    python -m benchmarks.encoder_peers --markdown benchmarks/results/encoder_peers.md \\
        --json benchmarks/results/encoder_peers.json

Two encoders with random weights (seeded), eager attention (``attn_implementation="eager"``):

* BERT: ``transformers.BertModel`` (hidden 256, 4 layers, 4 heads, intermediate 1024, no pooler)
  on padded batches: row ``r`` of a batch has its last ``(r + 1) / 8`` of positions masked out;
* ViT: ``transformers.ViTModel`` (hidden 256, 4 layers, 4 heads, intermediate 1024, image 224,
  patch 16, no pooler) on random pixels.

Each is exported twice, once, with a dynamic batch (and sequence) that serves every shape:

* ours: ``attn_export.onnx.export_onnx(model, inputs, path, attention="ort")``;
* the peer: ``torch.onnx.export(..., dynamo=False, opset_version=17)`` (the TorchScript exporter:
  ONNX Runtime's optimizer fuses no attention in the dynamo exporter's graph of these models,
  only SkipLayerNormalization and BiasGelu), then
  ``onnxruntime.transformers.optimizer.optimize_model(model_type="bert"|"vit", num_heads,
  hidden_size, opt_level=1)``, whose fused-operator counts are printed. On BERT it fuses
  Attention (packed QKV, the raw mask as ``mask_index``), EmbedLayerNormalization,
  SkipLayerNormalization and BiasGelu; on ViT (transformers 5: the scores scaled by a Mul, no
  mask) no attention pattern of ONNX Runtime 1.32 matches, with either exporter or
  ``attn_implementation``, and only SkipLayerNormalization and BiasGelu fire.

Both run in ONNX Runtime with the same session options (``--threads`` intra-op threads, the
pools stop spinning after each run: benchmarks/onnx_runtime.py's ``_session_options``),
interleaved in rounds (benchmarks/onnx_runtime.py's ``interleaved_rounds``); a time is the median
over rounds of the per-round median. Each shape checks both files' ``last_hidden_state`` against
PyTorch eager (max abs difference). The nodes each file has after ONNX Runtime's own graph
optimization are counted (``optimized_model_filepath``); ``--profile`` adds ONNX Runtime's kernel
time per op type at each model's largest shape.

Where the files differ: the peer's BERT runs one ``Attention`` per layer (the packed QKV GEMM, its
bias and the raw mask inside), ours a packed MatMul, its bias Add, a Split and a
``MultiHeadAttention`` reading a ``[B, 1, S, S]`` bias; on ViT the peer runs MatMul-Softmax-MatMul.
Kernel for kernel they cost the same here: a com.microsoft.Attention in place of our four nodes
(with our bias as its ``attention_bias``), or the QKV bias given to MultiHeadAttention, measured
no faster.
"""
from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

import torch

OURS, PEER = "attn-export ort", "torch.onnx + ORT optimizer"
LAYOUT = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
              attn_implementation="eager")
# The operators the two exporters' fusions write (the file's counts are printed for each).
VOCAB = 30522  # BertConfig's default
FUSED_OPS = ("Attention", "MultiHeadAttention", "EmbedLayerNormalization", "SkipLayerNormalization",
             "LayerNormalization", "BiasGelu", "FastGelu", "Gelu", "MatMul", "Split")


def build_model(kind: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(**LAYOUT, vocab_size=VOCAB), add_pooling_layer=False)
    else:
        config = transformers.ViTConfig(**LAYOUT, image_size=224, patch_size=16)
        model = transformers.ViTModel(config, add_pooling_layer=False)
    with torch.no_grad():  # the init's zero biases and unit norms would hide a bias or a norm read from the wrong place
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter), alpha=0.02)
    return model.eval()


def make_inputs(kind: str, batch: int, seq: int = 0, seed: int = 0) -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if kind == "vit":
        return {"pixel_values": torch.randn(batch, 3, 224, 224, generator=generator)}
    mask = torch.ones(batch, seq, dtype=torch.int64)
    for row in range(batch):
        mask[row, seq - max(1, (row + 1) * seq // 8):] = 0
    return {"input_ids": torch.randint(0, VOCAB, (batch, seq), generator=generator), "attention_mask": mask}


class LastHiddenState(torch.nn.Module):
    """``model(**inputs).last_hidden_state`` with positional inputs: the TorchScript exporter
    passes its inputs positionally (and a keyword call of BertModel fails in its tracer). Call
    ``.eval()`` on it: the exporter restores the wrapper's mode on everything inside, so a
    wrapper left in training mode would turn the model's dropout on."""

    def __init__(self, model, names):
        super().__init__()
        self.model, self.names = model, list(names)

    def forward(self, *args):
        return self.model(**dict(zip(self.names, args))).last_hidden_state


def export_ours(model, example, path: Path) -> List[str]:
    from attn_export.onnx import export_onnx

    return list(export_onnx(model, example, path, attention="ort").notes)


def export_peer(kind: str, model, example, path: Path) -> Dict[str, int]:
    """torch.onnx (TorchScript) then ONNX Runtime's optimizer; the counts it reports as fused."""
    from onnxruntime.transformers.optimizer import optimize_model

    names = list(example)
    axes = {name: ({0: "batch", 1: "sequence"} if kind == "bert" else {0: "batch"}) for name in names}
    raw = path.with_name(path.stem + "_torch_onnx.onnx")
    torch.onnx.export(LastHiddenState(model, names).eval(), tuple(example.values()), str(raw), dynamo=False,
                      opset_version=17, input_names=names, output_names=["last_hidden_state"],
                      dynamic_axes={**axes, "last_hidden_state": {0: "batch", 1: "sequence"}})
    config = model.config
    optimized = optimize_model(str(raw), model_type=kind, num_heads=config.num_attention_heads,
                               hidden_size=config.hidden_size, opt_level=1)
    optimized.save_model_to_file(str(path))
    return {op: n for op, n in optimized.get_fused_operator_statistics().items() if n}


def file_ops(path: Path) -> Dict[str, int]:
    import onnx

    counts = collections.Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)
    return {op: counts[op] for op in FUSED_OPS if counts[op]}


def shapes(kind: str, batches, seqs):
    return [(b, s) for b in batches for s in (seqs if kind == "bert" else (197,))]


def time_shape(kind: str, model, sessions, batch: int, seq: int, rounds: int, min_run_time: float) -> List[dict]:
    import numpy as np

    from benchmarks.onnx_runtime import interleaved_rounds

    inputs = make_inputs(kind, batch, seq)
    with torch.inference_mode():
        expected = model(**inputs).last_hidden_state.numpy()
    feeds = {name: v.numpy() for name, v in inputs.items()}
    diffs = {name: float(np.abs(s.run(["last_hidden_state"], feeds)[0] - expected).max()) for name, s in sessions.items()}
    runners = {name: (lambda s=s: s.run(["last_hidden_state"], feeds)) for name, s in sessions.items()}
    per_round = interleaved_rounds(runners, rounds, min_run_time)
    return [{"model": kind, "batch": batch, "seq": seq, "implementation": name,
             "ms": statistics.median(per_round[name]) * 1e3, "rounds": rounds, "max_abs_diff": diffs[name]}
            for name in sessions]


def kernel_profile(path: Path, feeds, threads: int, runs: int = 10) -> Dict[str, float]:
    """Kernel milliseconds per op type of one call (ONNX Runtime's profiler, each node at its
    fastest of ``runs`` calls: far less disturbed by other load than wall-clock times)."""
    import onnxruntime as ort

    from benchmarks.onnx_runtime import _session_options

    with tempfile.TemporaryDirectory() as tmp:
        options = _session_options(threads)
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(tmp, "profile")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        for _ in range(runs):
            session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    fastest: Dict[str, float] = {}
    op_of: Dict[str, str] = {}
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            fastest[event["name"]] = min(fastest.get(event["name"], float("inf")), event["dur"] / 1e3)
            op_of[event["name"]] = event["args"]["op_name"]
    per_op: Dict[str, float] = collections.defaultdict(float)
    for name, ms in fastest.items():
        per_op[op_of[name]] += ms
    return dict(sorted(per_op.items(), key=lambda kv: -kv[1]))


def profile_markdown(kind: str, batch: int, seq: int, profiles: Dict[str, Dict[str, float]]) -> str:
    names = list(profiles)
    ops = list(dict.fromkeys(op for p in profiles.values() for op in p))
    lines = [f"| {kind} batch {batch} seq {seq}: kernel ms (per node: fastest call) | " + " | ".join(names) + " |",
             "|---|" + "---:|" * len(names),
             "| total | " + " | ".join(f"{sum(profiles[n].values()):.2f}" for n in names) + " |"]
    lines += [f"| {op} | " + " | ".join(f"{profiles[n].get(op, 0.0):.2f}" for n in names) + " |" for op in ops]
    return "\n".join(lines) + "\n"


def markdown(rows: List[dict], files: Dict[str, dict], command: str, facts: Dict[str, str], threads: int,
             load: str) -> str:
    table = {(r["model"], r["batch"], r["seq"], r["implementation"]): r for r in rows}
    lines = [f"`{command}`", "", f"CPU: {facts['cpu']} ({facts['isa']}), {threads} intra-op threads on both sides, "
             f"spinning off; onnxruntime {facts['onnxruntime']}, torch {facts['torch']}, transformers "
             f"{facts['transformers']}; float32; load before the run (`uptime`): {load}", "",
             f"| model | batch | seq | {OURS} (ms) | {PEER} (ms) | ours / peer | max abs diff vs PyTorch (ours / peer) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for model, batch, seq in dict.fromkeys((r["model"], r["batch"], r["seq"]) for r in rows):
        ours, peer = table[(model, batch, seq, OURS)], table[(model, batch, seq, PEER)]
        lines.append(f"| {model} | {batch} | {seq} | {ours['ms']:.2f} | {peer['ms']:.2f} | "
                     f"{ours['ms'] / peer['ms']:.2f}x | {ours['max_abs_diff']:.1e} / {peer['max_abs_diff']:.1e} |")
    lines.append("")
    for model, per_impl in files.items():
        for name, info in per_impl.items():
            nodes = info["optimized_nodes"]
            lines.append(f"* {model}, {name}: in the file " + ", ".join(f"{op} {n}" for op, n in info["file_ops"].items())
                         + f"; {info['fusions']}; {sum(nodes.values())} nodes after ONNX Runtime's optimization: "
                         + ", ".join(f"{op} {n}" for op, n in nodes.items()))
    return "\n".join(lines) + "\n"


def export_both(kind: str, model, work: Path, threads: int) -> Dict[str, dict]:
    """{implementation: {"path", "file_ops", "fusions", "optimized_nodes"}} (reuses the files of
    an earlier run in ``work``)."""
    from benchmarks.genai_peers import optimized_nodes

    example = make_inputs(kind, 2, 16)
    paths = {OURS: work / f"{kind}_ours.onnx", PEER: work / f"{kind}_peer.onnx"}
    notes_file = work / f"{kind}_fusions.json"
    if not notes_file.exists() or not all(p.exists() for p in paths.values()):
        notes = [n for n in export_ours(model, example, paths[OURS]) if "contrib" in n or "fused" in n or "packed" in n]
        fused = export_peer(kind, model, example, paths[PEER])
        notes_file.write_text(json.dumps({OURS: "; ".join(notes),
                                          PEER: "optimize_model fused: " + ", ".join(f"{op} x{n}" for op, n in fused.items())}))
    fusions = json.loads(notes_file.read_text())
    return {name: {"path": str(path), "file_ops": file_ops(path), "fusions": fusions[name],
                   "optimized_nodes": optimized_nodes(path, threads)} for name, path in paths.items()}


def main(argv=None) -> int:
    import transformers

    from benchmarks.onnx_runtime import machine, onnx_session, timing_parser

    parser = timing_parser(__doc__, rounds=5)
    parser.add_argument("--models", default="bert,vit", help="comma-separated: bert, vit")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--seqs", default="128,512", help="BERT's sequence lengths (ViT's is 197: 196 patches + CLS)")
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds of calls per implementation per round")
    parser.add_argument("--work", type=Path, default=None, help="folder for the exports (default: temporary)")
    parser.add_argument("--profile", action="store_true",
                        help="also ONNX Runtime's kernel time per op type of both files at each model's largest shape")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    command = "python -m benchmarks.encoder_peers " + " ".join(argv if argv is not None else sys.argv[1:])
    load = os.popen("uptime").read().strip()
    torch.set_num_threads(args.threads)
    batches, seqs = [int(b) for b in args.batches.split(",")], [int(s) for s in args.seqs.split(",")]
    rows, files, profiles, text_profiles = [], {}, {}, []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for kind in args.models.split(","):
            model = build_model(kind)
            print(f"exporting {kind}", file=sys.stderr)
            files[kind] = export_both(kind, model, work, args.threads)
            sessions = {name: onnx_session(Path(info["path"]), args.threads) for name, info in files[kind].items()}
            for batch, seq in shapes(kind, batches, seqs):
                print(f"{kind} batch {batch} seq {seq}", file=sys.stderr)
                rows += time_shape(kind, model, sessions, batch, seq, args.rounds, args.min_run_time)
            if args.profile:
                batch, seq = shapes(kind, batches, seqs)[-1]
                feeds = {name: v.numpy() for name, v in make_inputs(kind, batch, seq).items()}
                profiles[kind] = {name: kernel_profile(Path(info["path"]), feeds, args.threads)
                                  for name, info in files[kind].items()}
                text_profiles.append(profile_markdown(kind, batch, seq, profiles[kind]))
    facts = {**machine(), "transformers": transformers.__version__}
    text = "\n".join([markdown(rows, files, command, facts, args.threads, load), *text_profiles])
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"command": command, "machine": facts, "load": load, "threads": args.threads,
                                         "results": rows, "files": files, "kernel_ms": profiles}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
