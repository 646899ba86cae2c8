"""Ours against ONNX Runtime GenAI's model builder, both run by ONNX Runtime GenAI's generator
(docs/benchmarks.md, "ONNX Runtime GenAI: the ort flavor against the model builder").

    python -m benchmarks.genai_peers --contexts 128,1024 --markdown benchmarks/results/genai_peers.md \\
        --json benchmarks/results/genai_peers.json

One decoder with grouped-query attention (hidden 256, 4 layers, 8 query heads over 2 key/value
heads, head dim 32, vocabulary 2048, random weights, seeded) of a family the builder supports
(``--family``: Llama by default; Qwen2 with its projection biases, Phi-3 with its packed
projections, Gemma 2 with its soft-caps and a 4096-token sliding window on every other layer),
saved with ``save_pretrained`` beside a ``tokenizers`` WordLevel tokenizer (so the builder runs
offline), exported twice from that folder:

* ours: ``attn-export DIR --to onnx --onnx-attention ort --with-past --genai-config``;
* the builder's: ``python -m onnxruntime_genai.models.builder -i DIR -o OUT -p fp32 -e cpu``.

``--precision int4`` compares the weight-only int4 files instead: ours with ``--quantize int4``
(MatMulNBits, block 32, symmetric, accuracy_level 4), the builder's ``-p int4``.
Ours computes the prompt's logits of the last position only (``--genai-config``'s default);
the builder's default file every position's, so its file with the same option
(``--extra_options prune_lm_head=true``) runs beside it. ``--all-logits`` exports ours with
every position's instead (what the builder's default computes). ``--vocab`` sets the
vocabulary (the language-model head's width); ``--size small`` a larger decoder of the same
family (hidden 512, 8 layers, head dim 64, vocabulary 32k), where a step's work outweighs what
each node of a run costs.
``--also LABEL=FOLDER`` times one more GenAI folder of the same weights in the same rounds (an
export of an earlier commit, a hand-edited file): a change measured side by side with what it
replaces and with the builder, under the same load.

Both get the same session options in their genai_config.json (``--threads`` intra-op threads;
GenAI 0.18's config has no key for intra-op spinning, so ``--pause`` seconds pass before each
model runs: on a shared 2-core machine a spinning pool steals the cores from the next session).
At context C and batch B (``--batches``; B different prompts of C tokens each, unpadded):
``prefill`` is ``append_tokens`` of the prompts on a fresh generator; ``decode`` is one
``generate_next_token`` after it (the median of ``--new-tokens`` calls, each timed). Interleaved
rounds (the order rotates: no model runs twice in a row, each at every position); a time is the median over rounds, and ours over a peer is the
median of the rounds' paired ratios, with its 95% bootstrap interval. Both must generate the
same greedy tokens (checked once). The nodes each file has after ONNX Runtime's own graph
optimization are counted (``optimized_model_filepath``).
"""
from __future__ import annotations

import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from benchmarks.onnx_runtime import paired_ratio, round_order

OURS, BUILDER, PRUNED = "attn-export ort", "GenAI builder", "GenAI builder, prune_lm_head"
CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# --size: the decoder, or one where a step's work outweighs the per-node cost of a run
# (head dim 64, a vocabulary of 32k: ~60M parameters, the scale of the smallest shipped models).
SIZES = {"tiny": {}, "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8)}


# The families of the builder's that the ort flavor exports, with what sets each apart from Llama.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # biases on the query, key and value projections (random)
    # Packed qkv_proj and gate_up_proj; the original position limit equal to the limit, as in Phi-3-mini-4k
    # (the builder reads a larger limit as the LongRoPE model, which needs its scaling factors).
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"original_max_position_embeddings": CONFIG["max_position_embeddings"]}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 32, "sliding_window": 4096}),  # soft-caps, window
}


def save_model(directory: Path, seed: int = 0, vocab_size: int = CONFIG["vocab_size"], family: str = "llama",
               size: str = "tiny") -> None:
    """The decoder and a WordLevel tokenizer over its vocabulary, as a local transformers folder."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    config_class, model_class, extra = FAMILIES[family]
    dims = {**CONFIG, "vocab_size": vocab_size, **SIZES[size]}
    if "head_dim" in extra:  # Gemma 2's explicit head size follows the size's heads
        extra = {**extra, "head_dim": dims["hidden_size"] // dims["num_attention_heads"]}
    config = getattr(transformers, config_class)(**{**dims, **extra})
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # a trained checkpoint's biases are not zero (the builder leaves out a zero one)
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.02)
    model.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(dims["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", pad_token="t0",
                                         unk_token="t3").save_pretrained(directory)


def export_all(hf: Path, work: Path, precision: str = "fp32", all_logits: bool = False) -> Dict[str, Path]:
    """The folders of ours and the builder's files (its default and prune_lm_head), exported
    unless a --work folder of an earlier run has them."""
    dirs = {OURS: work / f"ours_{precision}{'_all' if all_logits else ''}", BUILDER: work / f"builder_{precision}",
            PRUNED: work / f"builder_{precision}_pruned"}
    cli = Path(sys.executable).with_name("attn-export")
    quantize = ["--quantize", precision] if precision != "fp32" else []
    for name, folder in dirs.items():
        if (folder / "model.onnx").exists():
            continue
        if name == OURS:
            folder.mkdir(exist_ok=True)
            subprocess.run([str(cli), str(hf), "--to", "onnx", "--onnx-attention", "ort", "--with-past", "--genai-config",
                            *quantize, *(["--all-logits"] if all_logits else []), "--no-validate",
                            "-o", str(folder / "model.onnx")], check=True, capture_output=True)
        else:
            extra = ["--extra_options", "prune_lm_head=true"] if name == PRUNED else []
            subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(folder),
                            "-p", precision, "-e", "cpu", "-c", str(work / "cache"), *extra], check=True,
                           capture_output=True)
    return dirs


def set_session_options(directory: Path, threads: int, max_length: int) -> None:
    path = directory / "genai_config.json"
    config = json.loads(path.read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    options.pop("config_entries", None)
    options.update({"intra_op_num_threads": threads, "inter_op_num_threads": 1})
    config["model"]["eos_token_id"] = CONFIG["eos_token_id"]
    config["model"]["context_length"] = max(config["model"].get("context_length", 0), max_length)
    config["search"]["max_length"] = max_length
    path.write_text(json.dumps(config, indent=4))


def optimized_nodes(onnx_file: Path, threads: int) -> Dict[str, int]:
    """Node types after ONNX Runtime's graph optimization (level ALL, CPU)."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        so.intra_op_num_threads = threads
        ort.InferenceSession(str(onnx_file), so, providers=["CPUExecutionProvider"])
        model = onnx.load(so.optimized_model_filepath, load_external_data=False)
    return dict(collections.Counter(n.op_type for n in model.graph.node).most_common())


def generate(model, prompt: np.ndarray, new_tokens: int, min_buffer: int = 0):
    """(prefill seconds, each new token's seconds, the tokens of every row). The cache buffer
    holds the prompt and the new tokens, and at least ``min_buffer`` positions
    (GroupQueryAttention refuses a buffer shorter than its sliding window)."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    max_length = max(prompt.shape[1] + new_tokens + 1, min_buffer)
    params.set_search_options(max_length=max_length, do_sample=False, batch_size=len(prompt))
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(prompt)
    prefill = time.perf_counter() - start
    generator.generate_next_token()  # the token the prefill's logits give
    tokens = [generator.get_next_tokens().tolist()]
    steps = []
    for _ in range(new_tokens):
        start = time.perf_counter()
        generator.generate_next_token()
        steps.append(time.perf_counter() - start)
        tokens.append(generator.get_next_tokens().tolist())
    return prefill, steps, tokens


def time_context(models, context: int, rounds: int, new_tokens: int, pause: float,
                 vocab_size: int = CONFIG["vocab_size"], batch: int = 1, min_buffer: int = 0) -> List[dict]:
    """Per model and phase: the median over rounds (a round's decode time is the median of its
    tokens' times: one token stalled by the system does not move it), and ours over each other
    model as :func:`paired_ratio`."""
    prompt = np.random.default_rng(context).integers(4, vocab_size, (batch, context)).astype(np.int32)
    times = {name: {"prefill": [], "decode": []} for name in models}
    tokens = {}
    names = list(models)
    for r in range(rounds):
        for name in round_order(names, r):
            time.sleep(pause)
            prefill, steps, generated = generate(models[name], prompt, new_tokens, min_buffer)
            tokens[name] = str(generated)
            times[name]["prefill"].append(prefill * 1e3)
            times[name]["decode"].append(statistics.median(steps) * 1e3)
    same = len(set(tokens.values())) == 1
    rows = []
    for name, t in times.items():
        for phase in ("prefill", "decode"):
            row = {"batch": batch, "context": context, "phase": phase, "implementation": name,
                   "ms": statistics.median(t[phase]), "rounds": rounds, "same_tokens": same}
            if name != OURS and rounds > 1:
                row.update(paired_ratio(times[OURS][phase], t[phase]))
            rows.append(row)
    return rows


def ratio(ours: dict, peer: dict) -> str:
    """Ours over a peer: the paired median with its 95% interval where the rows carry them, else
    the ratio of the two medians."""
    if "ratio" in peer:
        low, high = peer["ratio_ci95"]
        return f"{peer['ratio']:.2f}x ({low:.2f}-{high:.2f})"
    return f"{ours['ms'] / peer['ms']:.2f}x"


def markdown(rows: List[dict], nodes: Dict[str, Dict[str, int]], command: str, facts: Dict[str, str],
             threads: int, load: str, precision: str = "fp32", ours_label: str = OURS, family: str = "llama") -> str:
    table = {(r.get("batch", 1), r["context"], r["phase"], r["implementation"]): r for r in rows}
    peers = [name for name in dict.fromkeys(r["implementation"] for r in rows) if name != OURS]
    lines = [f"`{command}`", "", f"CPU: {facts['cpu']} ({facts['isa']}), {threads} intra-op threads, a pause before each model; "
             f"onnxruntime {facts['onnxruntime']}, onnxruntime-genai {facts['onnxruntime_genai']}; {family}, {precision}; "
             f"load before the run (`uptime`): {load}", "",
             f"| batch | context | phase | {ours_label} (ms) | " + " | ".join(f"{p} (ms)" for p in peers) + " | "
             + " | ".join(f"ours / {p}" for p in peers) + " | same tokens |",
             "|---:|---:|---|---:|" + "---:|" * (2 * len(peers)) + "---|"]
    for batch, context in dict.fromkeys((r.get("batch", 1), r["context"]) for r in rows):
        for phase in ("prefill", "decode"):
            ours = table[(batch, context, phase, OURS)]
            times = [table[(batch, context, phase, p)]["ms"] for p in peers]
            lines.append(f"| {batch} | {context} | {phase}{' (per token)' if phase == 'decode' else ''} | {ours['ms']:.2f} | "
                         + " | ".join(f"{t:.2f}" for t in times) + " | "
                         + " | ".join(ratio(ours, table[(batch, context, phase, p)]) for p in peers)
                         + f" | {'yes' if ours['same_tokens'] else 'NO'} |")
    lines.append("")
    for name, counts in nodes.items():
        lines.append(f"* {name}: {sum(counts.values())} nodes after ONNX Runtime's optimization: "
                     + ", ".join(f"{op} {n}" for op, n in counts.items()))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import onnxruntime_genai as og

    from benchmarks.onnx_runtime import machine, timing_parser

    parser = timing_parser(__doc__, rounds=5)
    parser.add_argument("--contexts", default="128,1024")
    parser.add_argument("--batches", default="1", help="batch sizes, e.g. 1,4")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--precision", choices=("fp32", "int4"), default="fp32",
                        help="int4: ours with --quantize int4 against the builder's -p int4")
    parser.add_argument("--all-logits", action="store_true",
                        help="ours with --all-logits (every position's logits, as the builder's default file)")
    parser.add_argument("--vocab", type=int, default=CONFIG["vocab_size"], help="the vocabulary (the LM head's width)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny",
                        help="tiny: the decoder above; small: hidden 512, 8 layers, vocabulary 32k (overrides --vocab)")
    parser.add_argument("--pause", type=float, default=0.3, help="seconds between models (lets a pool go idle)")
    parser.add_argument("--work", type=Path, default=None, help="folder for the model and both exports (default: temporary)")
    parser.add_argument("--also", action="append", default=[], metavar="LABEL=FOLDER",
                        help="one more GenAI folder of the same weights, timed in the same rounds (repeatable)")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    also = dict(item.split("=", 1) for item in args.also)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    command = "python -m benchmarks.genai_peers " + " ".join(argv if argv is not None else sys.argv[1:])
    load = os.popen("uptime").read().strip()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        hf = work / "hf"
        if not (hf / "config.json").exists():
            save_model(hf, vocab_size=args.vocab, family=args.family, size=args.size)
        dirs = {**export_all(hf, work, args.precision, args.all_logits), **{k: Path(v) for k, v in also.items()}}
        nodes = {name: optimized_nodes(d / "model.onnx", args.threads) for name, d in dirs.items()}
        for d in dirs.values():
            set_session_options(d, args.threads, max(max(contexts) + args.new_tokens + 8,
                                                     FAMILIES[args.family][2].get("sliding_window", 0)))
        models = {name: og.Model(str(d)) for name, d in dirs.items()}
        rows = []
        for batch in batches:
            for context in contexts:
                print(f"batch {batch}, context {context}", file=sys.stderr)
                rows += time_context(models, context, args.rounds, args.new_tokens, args.pause, args.vocab, batch,
                                     FAMILIES[args.family][2].get("sliding_window", 0))
    facts = {**machine(), "onnxruntime_genai": og.__version__}
    text = markdown(rows, nodes, command, facts, args.threads, load, args.precision,
                    OURS + (" --all-logits" if args.all_logits else ""), args.family)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"command": command, "machine": facts, "load": load, "threads": args.threads,
                                         "family": args.family, "precision": args.precision, "results": rows, "optimized_nodes": nodes}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
