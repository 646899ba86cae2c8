"""Where a decode step's time goes, per ONNX operator, under ONNX Runtime GenAI's generator
(docs/benchmarks.md, "ONNX Runtime GenAI: the ort flavor against the model builder").

    python -m benchmarks.genai_profile DIR [DIR ...] --context 1024 --new-tokens 32

Each DIR is a GenAI model folder (genai_config.json beside the model), e.g. the two that
``benchmarks.genai_peers`` exports. Each is copied to DIR_profile with ONNX Runtime's profiler
switched on in the config's ``session_options``; a random prompt of ``--context`` tokens is
appended, ``--new-tokens`` tokens generated, and the profile's ``Node`` events of the decode runs
(every run after the prompt's) summed by operator. Printed per folder: the median session run
of a decode step and the operators' time per step, largest first. A subgraph node (``If``)
counts its own time including its branch's nodes, which are also listed on their own.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import shutil
import statistics
from pathlib import Path


def profile(folder: Path, context: int, new_tokens: int) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    work = folder.with_name(folder.name + "_profile")
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(folder, work)
    config_path = work / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"]["session_options"]["enable_profiling"] = str(work / "ort_profile")
    config_path.write_text(json.dumps(config, indent=1))
    model = og.Model(str(work))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=context + new_tokens + 8, do_sample=False)
    generator = og.Generator(model, params)
    vocab = min(config["model"]["vocab_size"], 1000)
    generator.append_tokens(np.random.default_rng(0).integers(4, vocab, size=(1, context)).astype(np.int32))
    for _ in range(new_tokens):
        generator.generate_next_token()
    del generator, params, model  # the profile is written when the session closes
    events = json.loads(Path(sorted(glob.glob(str(work / "ort_profile*.json")))[-1]).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    prompt_end = runs[0]["ts"] + runs[0]["dur"]
    steps = len(runs) - 1
    per_op = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["ts"] > prompt_end and e["name"].endswith("_kernel_time"):
            per_op[e["args"].get("op_name", "?")] += e["dur"]
    return {"step_us": statistics.median(e["dur"] for e in runs[1:]),
            "ops_us": {op: total / steps for op, total in per_op.most_common()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    for folder in args.folders:
        result = profile(folder, args.context, args.new_tokens)
        print(f"{folder}: {result['step_us']:.0f} us per decode step (median session run)")
        for op, us in list(result["ops_us"].items())[:12]:
            print(f"  {op:34s} {us:9.1f} us")


if __name__ == "__main__":
    main()
