"""``attn-export inspect``: list the attention layers of a model and what will happen to them."""
from __future__ import annotations

import click

from attn_export.errors import EXIT_MISMATCH
from attn_export.cli._common import common_verb
from attn_export.cli._library_options import coverage_options
from attn_export.cli._options import logging_options, model_options, sample_input_options


@click.command("inspect")
@click.argument("model_path", metavar="[MODEL]", required=False, type=click.Path())
@model_options
@sample_input_options
@coverage_options
@click.option("--json", "json_path", metavar="FILE", type=click.Path(dir_okay=False), help="Write the list as JSON.")
@logging_options
@common_verb
def inspect_cmd(session, model_path, model_args, sample, coverage, json_path):
    """List every attention layer of MODEL: module path, class, heads, embed dim, and whether it
    will be replaced by the fused operator, or why not.

    With example inputs (--input, --example-inputs, or the model's example_inputs attribute) a
    sample forward finds where F.scaled_dot_product_attention calls run, and the hand-written
    attention the export rewrites is matched on the captured graph: the plan is what the export
    does. Without, the modules' source is read (a hint, which misses indirect calls).

    MODEL is a file written by torch.save(model), loaded weights-only (see --trust-model-file),
    or a transformers save_pretrained folder. Nothing is modified. An exported .onnx file instead
    says which attention flavor it uses (--onnx-attention custom or standard) and its nodes. Exit 1 if a coverage gate (--min-replaced, --require-all) fails.

    \b
    Example:
      attn-export inspect model.pt
      attn-export inspect --model mypkg.models:build --require-all
      attn-export inspect ./bert-tiny
      attn-export inspect model.onnx
    """
    import json

    from attn_export.atomic_io import write_text

    if model_path and model_path.endswith(".onnx"):
        return _inspect_onnx(session, model_path, json_path)
    from attn_export.surgery.plan import plan_export
    from attn_export.surgery.replace import inspect_attention

    with session.step("loading the model"):
        model, source = model_args.load(model_path, seed=sample.seed)
    inputs = sample.example_inputs(model)
    with session.step("running a sample forward" if inputs is not None else "reading the model"):
        report = inspect_attention(model) if inputs is None else plan_export(model, inputs)
    session.out.print(report.table(title=f"{source}: {report.summary()}"))
    for note in report.notes:
        session.out.print(f"note: {note}", markup=False)
    problem = coverage.problem(report)
    if json_path:
        payload = {"model": source, "passed": problem is None, **report.to_dict()}
        write_text(json_path, json.dumps(payload, indent=2) + "\n")
    if problem:
        click.echo(f"FAILED: {problem}", err=True)
        return EXIT_MISMATCH
    return 0


def _inspect_onnx(session, path, json_path) -> int:
    import json

    from pathlib import Path

    from attn_export.atomic_io import write_text
    from attn_export.onnx import attention_flavor
    from attn_export.validation.gate import _load_onnx

    model = _load_onnx(Path(path))
    flavor = attention_flavor(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    session.out.print(f"{path}: opset {opset}, attention flavor {flavor['text']}")
    if json_path:
        write_text(json_path, json.dumps({"model": path, "opset": opset, **flavor}, indent=2) + "\n")
    return 0
