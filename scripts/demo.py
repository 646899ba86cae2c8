#!/usr/bin/env python
"""`make demo`: the whole pipeline on the bundled example model, through the real CLI.

1. builds attn_export.examples.TinySeq2Seq (nn.Transformer, 2+2 layers, d_model 64, 4 heads:
   encoder self-attention, causal decoder self-attention, cross-attention) with fixed weights and
   saves it with torch.save, as a user would;
2. attn-export inspect      -> the attention layers and what will happen to them;
3. attn-export MODEL --to onnx
                            -> replace, export (one attn_export.FusedAttention node per layer),
                               validate in ONNX Runtime at 5 shapes, JSON + JUnit reports;
4. attn-export validate on a copy with one weight nudged -> the gate fails with exit 1.

Everything is written under out/demo/ (git-ignored). No network access.
"""
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from rich.console import Console
from rich.rule import Rule

from attn_export.cli import main as cli
from attn_export.examples import tiny_seq2seq

console = Console()
OUT = Path(__file__).resolve().parent.parent / "out" / "demo"


def attn_export(*args) -> int:
    """Runs one attn-export command line in this process; returns its exit code."""
    console.print(f"[bold]$ attn-export {shlex.join(str(a) for a in args)}[/]")
    try:
        cli.main([str(a) for a in args], prog_name="attn-export", standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def main() -> int:
    start = time.perf_counter()
    OUT.mkdir(parents=True, exist_ok=True)
    model_path = OUT / "tiny_seq2seq.pt"
    torch.save(tiny_seq2seq(), model_path)
    rel = model_path.relative_to(Path.cwd()) if model_path.is_relative_to(Path.cwd()) else model_path
    allow = ["--allow-class", "attn_export.examples:TinySeq2Seq"]  # the one non-torch.nn class

    console.print(Rule("1. inspect"))
    code = attn_export("inspect", rel, *allow)
    if code:
        return code

    console.print(Rule("2. replace -> export -> validate"))
    onnx_path = rel.with_suffix(".onnx")
    code = attn_export(rel, "--to", "onnx", *allow, "--json", OUT / "report.json", "--junit", OUT / "report.xml")
    if code:
        console.print(f"[red]the pipeline failed with exit code {code}[/]")
        return code

    console.print(Rule("3. the gate catches a corrupted export"))
    model = onnx.load(str(onnx_path))
    weight = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    values = numpy_helper.to_array(weight).copy()
    values.flat[0] += 0.5
    weight.CopyFrom(numpy_helper.from_array(values, weight.name))
    corrupted = OUT / "tiny_seq2seq.corrupted.onnx"
    onnx.save(model, str(corrupted))
    console.print(f"(nudged one element of initializer {weight.name!r} by 0.5)")
    code = attn_export("validate", rel, corrupted.relative_to(Path.cwd()) if corrupted.is_relative_to(Path.cwd())
                       else corrupted, *allow, "--quiet")
    console.print(f"exit code {code} (1 = mismatch)")
    if code != 1:
        console.print("[red]expected the corrupted export to fail validation[/]")
        return 1

    console.print(Rule())
    console.print(
        f"Done in {time.perf_counter() - start:.0f} s. Files in {OUT}: the model, its ONNX export, report.json, "
        "report.xml. Speed of the fused layer: `make bench` (docs/benchmarks.md)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
