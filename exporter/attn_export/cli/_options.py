"""Option groups shared by the verbs, declared once (Polygraphy's argument groups).

Each group's options reach the verb as ONE object (``model_args: ModelArgs``,
``input_args: InputArgs``, ...), so a verb's signature names the groups it takes rather than
every flag. Where the library has the group (attn_export.options: ``export: ExportOptions``,
``ort: OrtOptions``, ``engine: EngineOptions``, ``coverage: CoverageOptions``, ``gate:
GateOptions``) the verb gets the library's object, made here from the flags; the groups of
the command line alone (how the model is loaded, the example inputs, the report files) are
declared here; the library's in _library_options.py.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Optional, Tuple

import click

from attn_export.cli._common import fail
from attn_export.errors import AttnExportError


def _apply(options):
    def decorator(f):
        for option in reversed(options):
            f = option(f)
        return f

    return decorator


def _grouped(build, keyword: str, options):
    """The options, collected by ``build`` (a group class, or a function that makes the group
    from the options' parameter names) into one object passed to the verb as ``keyword``. A
    value the group refuses ends the command like any usage error (one line, exit 2)."""
    names = list(inspect.signature(build).parameters)

    def decorator(f):
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            values = {name: kwargs.pop(name) for name in names if name in kwargs}
            try:
                kwargs[keyword] = build(**values)
            except AttnExportError as exc:
                fail(str(exc), exc.exit_code)
            return f(*args, **kwargs)

        return _apply(options)(wrapper)

    return decorator


@dataclass(frozen=True)
class ModelArgs:
    """How the model is loaded (--model, --config, --weights, --allow-class, --trust-model-file)."""

    factory: Optional[str]
    hf_config: Optional[str]
    weights: Optional[str]
    allow_class: Tuple[str, ...]
    trust_model_file: bool
    path: Optional[str] = None  # MODEL, where the verb's argument is the model alone

    def load(self, model_path: Optional[str], seed: int = 0):
        """(model, description); see attn_export.cli._common.load_model."""
        from attn_export.cli._common import load_model

        return load_model(model_path, self, seed=seed)


@dataclass(frozen=True)
class InputArgs:
    """Example inputs and dynamic axes (--input, --example-inputs, --dynamic, --static, --seed)."""

    input_specs: Tuple[str, ...]
    example_file: Optional[str]
    dynamic: Tuple[str, ...]
    static: bool
    seed: int

    @property
    def axes_given(self) -> bool:
        return bool(self.dynamic or self.static)

    def example_inputs(self, model):
        from attn_export.cli._common import example_inputs

        return example_inputs(model, self.input_specs, self.example_file, self.seed)

    def axes(self, inputs, model=None):
        from attn_export.cli._common import resolve_axes

        return resolve_axes(inputs, self.dynamic, self.static, model=model)


@dataclass(frozen=True)
class SampleArgs:
    """Example inputs for the sample forward that finds the attention calls (--input,
    --example-inputs, --seed); inspect runs it when inputs can be had."""

    input_specs: Tuple[str, ...]
    example_file: Optional[str]
    seed: int

    def example_inputs(self, model):
        """The inputs, or None where none were given and the model has none of its own."""
        from attn_export.cli._common import example_inputs
        from attn_export.errors import InputError

        try:
            return example_inputs(model, self.input_specs, self.example_file, self.seed)
        except InputError:
            if self.input_specs or self.example_file:
                raise
            return None


@dataclass(frozen=True)
class ReportArgs:
    """The report files (--json, --junit, --html); None: not written."""

    json_path: Optional[str] = None
    junit_path: Optional[str] = None
    html_path: Optional[str] = None


_MODEL_OPTIONS = [
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
]


def model_options(f):
    """How the model is loaded: ``model_args: ModelArgs``."""
    return _grouped(ModelArgs, "model_args", _MODEL_OPTIONS)(f)


def model_path_options(f):
    """MODEL, the verb's one argument, and how it is loaded: ``model_args: ModelArgs`` with its ``path``."""
    path = click.argument("path", metavar="[MODEL]", required=False, type=click.Path())
    return _grouped(ModelArgs, "model_args", [path, *_MODEL_OPTIONS])(f)


_INPUT_HELP = ("An example input, trtexec style (repeatable): src:2x16x64, ids:1x32:int64, "
               "mask:2x16:bool. NAME is a parameter of the model's forward; random values "
               "(integers below the smallest embedding table, boolean masks as padding masks).")


def sample_input_options(f):
    """Example inputs for inspect's sample forward: ``sample: SampleArgs``."""
    return _grouped(SampleArgs, "sample", [
        click.option("--input", "input_specs", multiple=True, metavar="NAME:DIMS[:DTYPE]", help=_INPUT_HELP),
        click.option("--example-inputs", "example_file", metavar="FILE.pt", type=click.Path(dir_okay=False),
                     help="A torch.save-d dict name -> tensor (loaded weights-only)."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed for generated inputs."),
    ])(f)


def input_options(f):
    """Example inputs and dynamic axes: ``input_args: InputArgs``."""
    return _grouped(InputArgs, "input_args", [
        click.option("--input", "input_specs", multiple=True, metavar="NAME:DIMS[:DTYPE]", help=_INPUT_HELP),
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


def report_options(f):
    """``reports: ReportArgs``."""
    return _grouped(ReportArgs, "reports", [
        click.option("--json", "json_path", metavar="FILE", type=click.Path(dir_okay=False),
                     help="Write the report as JSON (top-level 'passed')."),
        click.option("--junit", "junit_path", metavar="FILE", type=click.Path(dir_okay=False),
                     help="Write the validation cases as JUnit XML."),
        click.option("--html", "html_path", metavar="FILE", type=click.Path(dir_okay=False),
                     help="Write the report as one self-contained HTML page (verdict, cases, error plots, coverage; "
                          "needs matplotlib: pip install 'attn-export[plot]')."),
    ])(f)


def logging_options(f):
    return _apply([
        click.option("-q", "--quiet", is_flag=True, help="Print errors only (the exit code tells the verdict)."),
        click.option("-v", "--verbose", is_flag=True, help="Show library warnings and tracebacks."),
    ])(f)
