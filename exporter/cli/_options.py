"""Option groups shared by the verbs (declared once, like Polygraphy's argument groups)."""
from __future__ import annotations

import click


def _apply(options):
    def decorator(f):
        for option in reversed(options):
            f = option(f)
        return f

    return decorator


def model_options(f):
    """How the model is loaded: --model / --weights / --allow-class / --trust-model-file."""
    return _apply([
        click.option("--model", "factory", metavar="MODULE:FACTORY",
                     help="Build the model by calling FACTORY() from MODULE (importable; the current "
                          "directory is on the path) instead of loading a MODEL file. "
                          "transformers:CLASS (e.g. transformers:AutoModelForCausalLM) loads a Hugging Face "
                          "model with that class: from the save_pretrained folder MODEL, or from --config."),
        click.option("--config", "hf_config", metavar="PATH",
                     type=click.Path(exists=True, file_okay=True, dir_okay=True),
                     help="With --model transformers:CLASS: a config.json (or a folder holding one); the "
                          "model is built from it with random weights (seeded by --seed where the verb has it)."),
        click.option("--weights", metavar="FILE", type=click.Path(dir_okay=False),
                     help="With --model: a state_dict file, loaded weights-only (no code runs)."),
        click.option("--allow-class", "allow_class", multiple=True, metavar="MODULE:CLASS",
                     help="Also allow this class when loading MODEL (repeatable). It is imported by name "
                          "from the installed package. Models built from torch.nn alone need none."),
        click.option("--trust-model-file", is_flag=True,
                     help="Load MODEL with full unpickling. DANGER: this EXECUTES CODE stored in the file; "
                          "only for files you trust. Without it, MODEL is loaded weights-only with an "
                          "audited allowlist of torch.nn classes."),
    ])(f)


def input_options(f):
    """Example inputs and dynamic axes."""
    return _apply([
        click.option("--input", "input_specs", multiple=True, metavar="NAME:DIMS[:DTYPE]",
                     help="An example input, trtexec style (repeatable): src:2x16x64, ids:1x32:int64, "
                          "mask:2x16:bool. NAME is a parameter of the model's forward; random values "
                          "(integers below the smallest embedding table, boolean masks as padding masks)."),
        click.option("--example-inputs", "example_file", metavar="FILE.pt", type=click.Path(dir_okay=False),
                     help="A torch.save-d dict name -> tensor (loaded weights-only). The names become the "
                          "ONNX input names."),
        click.option("--dynamic", "dynamic", multiple=True, metavar="NAME:DIM=LABEL",
                     help="Make axis DIM of input NAME symbolic with this label (repeatable; replaces that "
                          "input's defaults). Default: dim 0 of every input is 'batch', dim 1 a sequence "
                          "('seq' for the first input, '<name>_seq' for others). Labels containing 'batch' "
                          "are swept as batch sizes by the validator, others as sequence lengths."),
        click.option("--static", is_flag=True, help="No dynamic axes: export at the example shapes."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed for generated inputs."),
    ])(f)


def coverage_options(f):
    """The replacement-coverage gate."""
    return _apply([
        click.option("--min-replaced", type=click.IntRange(min=0), metavar="N",
                     help="Fail (exit 1) when fewer than N attention layers end up fused."),
        click.option("--require-all", is_flag=True,
                     help="Fail (exit 1) when any attention layer cannot be fused."),
    ])(f)


def report_options(f):
    return _apply([
        click.option("--json", "json_path", metavar="FILE", type=click.Path(dir_okay=False),
                     help="Write the report as JSON (top-level 'passed')."),
        click.option("--junit", "junit_path", metavar="FILE", type=click.Path(dir_okay=False),
                     help="Write the validation cases as JUnit XML."),
    ])(f)


def logging_options(f):
    return _apply([
        click.option("-q", "--quiet", is_flag=True, help="Print errors only (the exit code tells the verdict)."),
        click.option("-v", "--verbose", is_flag=True, help="Show library warnings and tracebacks."),
    ])(f)


def plugin_option(f):
    return click.option(
        "--plugin", "plugin", metavar="LIB.so", type=click.Path(dir_okay=False),
        help="The FusedAttention TensorRT plugin library (plugins/tensorrt). Default: $ATTN_EXPORT_TRT_PLUGIN, "
             "else build/tensorrt/libattn_export_trt_plugin.so of the source checkout.",
    )(f)


def profile_options(f):
    """The TensorRT engine's optimization profile (trtexec's --minShapes/--optShapes/--maxShapes)."""
    return _apply([
        click.option("--min-shapes", "min_shapes", multiple=True, metavar="NAME:DIMS",
                     help="Smallest shapes of the engine's inputs, NAME:DIMS (repeatable or comma-separated, e.g. "
                          "src:1x1x64). Dimensions the ONNX graph ties together take one value; the others keep "
                          "their defaults. Default: 1 for every dynamic dimension."),
        click.option("--opt-shapes", "opt_shapes", multiple=True, metavar="NAME:DIMS",
                     help="Shapes TensorRT tunes for, as --min-shapes. Default: the example inputs' shapes."),
        click.option("--max-shapes", "max_shapes", multiple=True, metavar="NAME:DIMS",
                     help="Largest shapes, as --min-shapes. Default: 4 x the example sizes, and at least every "
                          "size the validation sweeps."),
        click.option("--workspace-mib", type=click.IntRange(min=1), metavar="MIB",
                     help="TensorRT's workspace memory limit (default: TensorRT's, the GPU's memory)."),
    ])(f)
