"""``attn-export convert`` (also the default verb: ``attn-export model.pt --to onnx`` or
``--to tensorrt``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import click

from attn_export.errors import EXIT_MISMATCH
from attn_export.cli._common import common_verb, finish_validation
from attn_export.cli._html import check_html, write_html
from attn_export.cli._library_options import coverage_options, engine_options, export_options, gate_options, ort_options
from attn_export.cli._options import _grouped, input_options, logging_options, model_path_options, report_options

SUFFIXES = {"onnx": ".onnx", "tensorrt": ".engine"}

HELP = """Replace the attention layers of MODEL by the fused operator, export to ONNX, and check the
export in ONNX Runtime against the original PyTorch model. With --to tensorrt, also build a
TensorRT engine from the ONNX (the FusedAttention nodes run as the plugin) and add it to the
check.

MODEL is a file written by torch.save(model), loaded weights-only (see --trust-model-file),
or a Hugging Face transformers save_pretrained folder (its attention is routed to the fused
operator through transformers' AttentionInterface); or build the model with
--model module:factory, or --model transformers:CLASS with a folder or --config. Example
inputs come from --input, --example-inputs or the model's example_inputs attribute
(transformers models: input_ids and a padded attention_mask, or pixel_values, by default);
the ONNX inputs take their names. Dim 0 (batch) and dim 1 (sequence) of every input are
symbolic unless --dynamic/--static say otherwise (transformers models: batch and sequence
of the token inputs, the batch of pixel_values).

Validation (unless --no-validate) is the same as `attn-export validate`; --ort-provider
picks ONNX Runtime's execution providers (default cpu). Exit codes: 0 passed, 1 mismatch
(or a coverage gate failed), 2 usage or input error, or TensorRT, a GPU, an ONNX Runtime
provider or the plugin library missing (the message says what to install or build). Output files are
written whole or not at all; after a mismatch they are kept for inspection.

--to tensorrt: the engine is strongly typed (it computes in the ONNX types: --dtype fp16 for
a float16 engine) and has one optimization profile: every dynamic dimension from 1 (min)
over the example size (opt) to 4 x the example size (max) unless --min-shapes/--opt-shapes/
--max-shapes say otherwise. A <engine>.json beside the engine records the plugin library it
needs (docs/tensorrt.md). With --onnx-attention standard the engine needs no plugin: TensorRT's
parser (10.14+) maps the standard Attention nodes itself. --onnx-functions inline writes the
custom nodes' bodies into the graph, for runtimes that do not read model-local functions
(OpenVINO, onnx.version_converter; docs/onnx_consumers.md).

--with-past (transformers decoder-only causal LMs) exports the model with its key/value cache:
one graph for prefill (past length 0) and decode, with Optimum's names (input_ids,
attention_mask over past + new tokens, position_ids, past_key_values.{i}.key/value in; logits,
present.{i}.key/value out) and the cache's contract in the file's metadata
(docs/huggingface.md). The gate then generates --new-tokens greedy tokens
with the cache (or, for a model without generate(), runs new tokens after a non-empty past). With --to
tensorrt the engine's profile runs the past from 0 to --max-context - 1 tokens (default: the
config's max_position_embeddings) and the gate generates through the engine too.

\b
Examples:
  attn-export model.pt --to onnx
  attn-export model.pt --to onnx -o out/model.onnx --input src:2x16x64 --input src_key_padding_mask:2x16:bool
  attn-export model.pt --to onnx --onnx-attention standard
  attn-export --model mypkg.models:build --weights weights.pt --dtype fp16 --json report.json
  attn-export ./bert-tiny --to onnx --input input_ids:2x16:int64 --input attention_mask:2x16:int64
  attn-export --model transformers:AutoModelForCausalLM --config gpt2-config.json -o gpt2.onnx
  attn-export --model transformers:AutoModelForCausalLM --config llama-config.json --with-past -o llama.onnx
  attn-export --model transformers:AutoModelForCausalLM --config llama-config.json --with-past \\
      --to tensorrt --max-context 2048 -o llama.engine
  attn-export model.pt --to tensorrt --dtype fp16 --plugin build/tensorrt/libattn_export_trt_plugin.so \\
      --max-shapes src:8x512x64
  attn-export model.pt --to onnx --ort-provider cuda --ort-provider tensorrt --ort-trt-cache trt-cache/
"""


def default_output(model_path, factory, to: str) -> Path:
    suffix = SUFFIXES[to]
    if model_path:
        path = Path(model_path)
        if path.is_dir():  # a transformers save_pretrained folder: <folder>.onnx beside it
            return path.parent / (path.resolve().name + suffix)
        return path.with_suffix(suffix)
    return Path(factory.rpartition(":")[2] + suffix)


@dataclass(frozen=True)
class TargetArgs:
    """What convert makes (--to, -o, --onnx-output, --genai-config) and whether it checks it
    (--no-validate)."""

    to: str
    output: Optional[str]
    onnx_output: Optional[str]
    genai_config: bool
    validate: bool


def _target_args(to: str, output: Optional[str], onnx_output: Optional[str], genai_config: bool,
                 no_validate: bool) -> TargetArgs:
    return TargetArgs(to=to, output=output, onnx_output=onnx_output, genai_config=genai_config,
                      validate=not no_validate)


_FILE = click.Path(dir_okay=False)


def target_options(f):
    """``target: TargetArgs``."""
    return _grouped(_target_args, "target", [
        click.option("--to", "to", type=click.Choice(list(SUFFIXES)), default="onnx", show_default=True,
                     help="Target: ONNX, or a TensorRT engine built from that ONNX (needs TensorRT, a GPU and the "
                          "FusedAttention plugin library)."),
        click.option("-o", "--output", "output", metavar="PATH", type=_FILE,
                     help="Where to write the result (default: MODEL with the target's suffix, .onnx or .engine, beside it)."),
        click.option("--onnx-output", "onnx_output", metavar="PATH", type=_FILE,
                     help="With --to tensorrt: where the intermediate ONNX goes (default: the engine's path, .onnx)."),
        click.option("--genai-config", "genai_config", is_flag=True,
                     help="With --with-past: also write genai_config.json beside the ONNX file, so that ONNX Runtime "
                          "GenAI generates with the export's directory (docs/onnx_consumers.md); the logits are then "
                          "the last position's unless --all-logits."),
        click.option("--no-validate", is_flag=True,
                     help="Skip the parity check (ONNX Runtime, and TensorRT) after export."),
    ])(f)


@click.command("convert", help=HELP)
@target_options
@model_path_options
@input_options
@export_options
@ort_options
@engine_options
@coverage_options
@gate_options
@report_options
@logging_options
@common_verb
def convert(session, model_args, target, input_args, export, ort, engine, coverage, gate, reports):
    import torch

    from attn_export.conversion import convert as run_conversion, preflight

    _check_flags(target, ort, engine, reports)
    options = conversion_options(model_args, target, input_args, export, ort, engine, coverage, gate,
                                 verbose=session.verbose)
    progress = ConsoleProgress(session, options.export.attention)
    found = preflight(options, progress)
    with session.step("loading the model"):
        model, source = model_args.load(model_args.path, seed=input_args.seed)
        torch.manual_seed(input_args.seed)
        inputs = input_args.example_inputs(model)
        # Declared axes must come out dynamic; the defaults (None) may stay static where the model says so.
        axes = input_args.axes(inputs, model=model) if input_args.axes_given else None
        options = dataclasses.replace(options, export=dataclasses.replace(options.export, dynamic_axes=axes))

    progress.source = source
    result = run_conversion(model, inputs, options, progress=progress, target=found)
    if result.coverage_problem:
        click.echo(f"FAILED: {result.coverage_problem}", err=True)
        return EXIT_MISMATCH
    if result.report is None:
        session.out.print("validation skipped (--no-validate)")
        return 0
    write_html(session, result.report, reports.html_path)
    return finish_validation(session, result.report, reports, extra=result.to_dict())


def conversion_options(model_args, target: TargetArgs, input_args, export, ort, engine, coverage, gate, *,
                       verbose: bool = False):
    """The library's ConvertOptions of the command line's groups: the same group objects, with
    --seed for the export and the gate and the export quiet unless --verbose."""
    from attn_export.conversion import ConvertOptions

    return ConvertOptions(
        target.output or default_output(model_args.path, model_args.factory, target.to), to=target.to,
        onnx_output=target.onnx_output, genai_config=target.genai_config, validate=target.validate,
        export=dataclasses.replace(export, seed=input_args.seed, quiet=not verbose),
        ort=ort, engine=engine, coverage=coverage, gate=dataclasses.replace(gate, seed=input_args.seed))


def _check_flags(target: TargetArgs, ort, engine, reports) -> None:
    """Flags that go with a target or with the validation only (before anything is loaded)."""
    from attn_export.errors import InputError

    if reports.html_path and not target.validate:
        raise InputError("--html writes the validation report: it does not go with --no-validate")
    check_html(reports.html_path)
    if target.to == "onnx" and (target.onnx_output or (engine.plugin and not ort.wants_tensorrt)
                                or engine.profile_given):
        raise InputError("--onnx-output, --plugin, --min/--opt/--max-shapes, --workspace-mib and --max-context go "
                         "with --to tensorrt (--plugin also with --ort-provider tensorrt)")
    if not target.validate and ort.given:
        raise InputError("--ort-provider, --ort-trt-cache and --ort-trt-fp16 choose how the export is validated: "
                         "drop them or --no-validate")


class ConsoleProgress:
    """What the conversion does, on the console: steps and notes on stderr, the replacement
    tables and the files written on stdout."""

    def __init__(self, session, attention: str) -> None:
        self.session, self.attention, self.source = session, attention, ""
        self.step, self.note = session.step, session.note

    def plan(self, report, after_export: bool) -> None:
        title = f"after export: {report.summary()}" if after_export else f"{self.source}: {report.summary()}"
        self.session.out.print(report.table(title=title))

    def exported(self, onnx_path, export) -> None:
        axes = ", ".join(f"{n}[{a}]={lbl}" for n, d in export.dynamic_axes.items() for a, lbl in d.items()) or "none"
        nodes = f"{export.num_attention_nodes} fused attention node(s)"
        if self.attention == "standard":
            nodes = f"{export.num_standard_attention_nodes} standard Attention node(s)" + (
                f", {export.num_attention_nodes} kept as fused attention node(s)" if export.num_attention_nodes else "")
        self.session.out.print(f"wrote {onnx_path}: opset {export.opset}, {export.dtype}, {nodes}, dynamic axes: {axes}")
        if export.encoder is not None:  # an encoder-decoder's cached export: the decoder above, its encoder here
            self.session.out.print(f"wrote {export.encoder.path} (its encoder): "
                                   f"{export.encoder.num_attention_nodes} fused attention node(s)")
        if self.session.verbose:  # the graph passes that ran, in order (attn_export.onnx.passes)
            self.note(f"graph passes: {export.passes_text()}")

    def engine_built(self, engine_path, info) -> None:
        self.session.out.print(
            f"wrote {engine_path}: TensorRT {info.tensorrt} on {info.gpu}, {info.plugin_layers} FusedAttention plugin "
            f"layer(s), build record {engine_path}.json")
