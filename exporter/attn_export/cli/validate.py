"""``attn-export validate``: the parity gate for an exported model."""
from __future__ import annotations

import dataclasses

import click

from attn_export.cli._common import common_verb, finish_validation
from attn_export.cli._html import check_html, write_html
from attn_export.cli._library_options import gate_options, ort_options, plugin_option
from attn_export.cli._options import input_options, logging_options, model_options, report_options


@click.command("validate")
@click.argument("paths", metavar="[MODEL] ONNX", nargs=-1, type=click.Path())
@model_options
@input_options
@click.option("--engine", "engine", metavar="FILE", type=click.Path(dir_okay=False),
              help="Also run this TensorRT engine (built from ONNX, e.g. by --to tensorrt) and compare it "
                   "like the other backends. Needs TensorRT, a GPU and the plugin library.")
@ort_options
@plugin_option
@gate_options
@report_options
@logging_options
@common_verb
def validate_cmd(session, paths, model_args, input_args, engine, ort, plugin, gate, reports):
    """Check ONNX against the original PyTorch MODEL: runs the original model (float32
    reference), the model with its attention replaced, ONNX Runtime and, with --engine, the
    TensorRT engine at the example shape, batch 1, sequence 1, an odd and a longer sequence
    length, and compares every output with a tolerance derived from the dtype
    (docs/validation.md). A NaN where the reference has none fails. Also fails when an axis
    declared dynamic is static in the ONNX graph. Shapes outside the engine's optimization
    profile are reported as skipped for TensorRT; at least one must run.

    A cached export (--with-past: its metadata records the cache's contract) is checked by
    generation instead: --new-tokens greedy tokens through ONNX Runtime (and the --engine, its
    cache kept on the GPU) with the cache, from a left-padded batch of prompts, must equal the
    model's generate() and every step's logits must be within the tolerance; the report shows
    the prefill's and every step's errors. A model without generate() runs the cases through
    the decoder with its cache as flat tensors, after a non-empty past.

    ONNX Runtime runs on the CPU unless --ort-provider says otherwise (cuda, tensorrt: one row
    each; docs/validation.md). Prints one row per case; --json / --junit / --html write the
    report. Exit codes: 0 passed, 1 mismatch (also: ONNX Runtime fell back to the CPU), 2 usage or input
    error, or TensorRT, a GPU, an ONNX Runtime provider or the plugin missing.

    \b
    Examples:
      attn-export validate model.pt model.onnx
      attn-export validate model.pt model.onnx --input src:2x16x64 --json report.json --junit report.xml
      attn-export validate model.pt model.onnx --html report.html
      attn-export validate --model mypkg.models:build --weights w.pt model.onnx
      attn-export validate ./bert-tiny bert-tiny.onnx
      attn-export validate model.pt model.onnx --engine model.engine --plugin build/tensorrt/libattn_export_trt_plugin.so
      attn-export validate model.pt model.onnx --ort-provider cpu --ort-provider cuda
    """
    from attn_export.conversion import require_providers
    from attn_export.validation import validate

    check_html(reports.html_path)
    _check_backends(engine, plugin, ort)
    model_path, onnx_path = _model_and_onnx_paths(paths, model_args)
    from attn_export.validation.runners import prestart_onnxruntime

    gate = dataclasses.replace(gate, seed=input_args.seed)
    prestart_onnxruntime(gate.runtime_timeout_s)  # ONNX Runtime's process starts while the model loads
    require_providers(ort, gate.runtime_timeout_s, plugin)  # GPU providers: what is missing, before the model loads
    with session.step("loading the model"):
        model, _source = model_args.load(model_path, seed=input_args.seed)
        inputs = input_args.example_inputs(model)
        axes = input_args.axes(inputs, model=model) if input_args.axes_given else None
    with session.step("validating") as update:
        report = validate(model, onnx_path, inputs, dynamic_axes=axes, engine=engine, plugin=plugin, ort=ort,
                          gate=gate, progress=update)
    write_html(session, report, reports.html_path)
    return finish_validation(session, report, reports)


def _check_backends(engine, plugin, ort) -> None:
    """TensorRT present for --engine (before the model is loaded: says what to install); --plugin
    only with a backend that loads it."""
    from attn_export.errors import InputError

    if engine is not None:
        from attn_export import tensorrt as attn_trt

        attn_trt.require_runtime()
    elif plugin is not None and not ort.wants_tensorrt:
        raise InputError("--plugin goes with --engine or --ort-provider tensorrt")


def _model_and_onnx_paths(paths, model_args):
    """(MODEL, ONNX) from the arguments: MODEL is None when --model builds the model (but
    --model transformers:CLASS without --config reads the MODEL folder)."""
    from attn_export.errors import InputError

    factory = model_args.factory
    model_given = not factory or (factory.startswith("transformers:") and not model_args.hf_config)
    want = 2 if model_given else 1
    if len(paths) != want:
        raise InputError(
            "expected MODEL and ONNX paths" if want == 2 else "with --model give only the ONNX path"
        )
    return paths if model_given else (None, paths[0])

