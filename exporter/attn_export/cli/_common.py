"""Shared pieces of the CLI verbs: exit codes, error reporting, progress, and the steps every
verb shares (loading the model, assembling example inputs)."""
from __future__ import annotations

import contextlib
import functools
import sys
import time
import traceback
from typing import Callable, Iterator, NoReturn, Optional, Sequence

import click

from attn_export.errors import EXIT_MISMATCH, EXIT_OK, EXIT_USAGE


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """One clear line on stderr and a non-zero exit; no traceback."""
    click.echo(f"error: {message}", err=True)
    raise SystemExit(code)


class Session:
    """Console output of one command: progress and notes on stderr (nothing with --quiet),
    results on stdout, tracebacks only with --verbose."""

    def __init__(self, quiet: bool = False, verbose: bool = False) -> None:
        from rich.console import Console

        self.quiet = quiet
        self.verbose = verbose
        self.err = Console(stderr=True, quiet=quiet, highlight=False)
        self.out = Console(quiet=quiet, highlight=False, width=max(Console().width, 120))

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[Callable[[str], None]]:
        """A long step: a spinner while it runs, then a one-line summary with its duration."""
        start = time.perf_counter()
        if self.quiet or not self.err.is_terminal:
            self.note(f"{what} ...")
            yield lambda _detail: None
        else:
            with self.err.status(what) as status:
                yield lambda detail: status.update(f"{what}: {detail}")
        from rich.markup import escape

        self.err.print(f"[green]done[/] {escape(what)} ({time.perf_counter() - start:.1f} s)")

    def note(self, message: str) -> None:
        """One line on stderr, as written: a note's ``[batch, 1, vocab]`` is not rich markup."""
        self.err.print(message, markup=False)


def run_guarded(session: Session, body: Callable[[], Optional[int]]) -> NoReturn:
    """Runs a verb's body and maps every failure to one line and an exit code:
    AttnExportError -> its code (2 for input/usage problems); anything unexpected -> 2 with
    its type and first line. Tracebacks only with --verbose."""
    from attn_export.errors import AttnExportError

    try:
        code = body() or EXIT_OK
    except AttnExportError as exc:
        if session.verbose:
            traceback.print_exc()
        fail(str(exc), exc.exit_code)
    except (click.exceptions.Exit, click.ClickException, SystemExit):
        raise
    except KeyboardInterrupt:
        fail("interrupted", EXIT_USAGE)
    except Exception as exc:  # noqa: BLE001 - one line unless --verbose
        if session.verbose:
            traceback.print_exc()
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        fail(f"{type(exc).__name__}: {first} (rerun with --verbose for the traceback)", EXIT_USAGE)
    sys.exit(code)


def silence_library_warnings(verbose: bool) -> None:
    """torch and onnxscript warn freely during export; with --verbose they are shown."""
    if verbose:
        return
    import logging
    import warnings

    warnings.simplefilter("ignore")
    for name in ("torch.onnx", "torch.export", "torch._export", "onnxscript", "torch._dynamo", "torch.fx"):
        logging.getLogger(name).setLevel(logging.ERROR)


def load_model(model_path: Optional[str], args, seed: int = 0):
    """(model, description) from a MODEL file, a transformers save_pretrained folder (MODEL),
    --model module:factory, or --model transformers:CLASS (with the folder or --config);
    ``args`` is the verb's ModelArgs."""
    from pathlib import Path

    from attn_export import loading
    from attn_export.errors import InputError

    factory, hf_config, weights = args.factory, args.hf_config, args.weights
    allow_class, trust_model_file = args.allow_class, args.trust_model_file

    if factory and factory.startswith("transformers:"):
        from attn_export.surgery import transformers as hf

        if weights:
            raise InputError("--weights goes with --model module:factory; a transformers model loads its weights "
                             "from its save_pretrained folder (MODEL)")
        class_name = factory.partition(":")[2] or None
        model = hf.load(class_name, path=model_path, config_path=hf_config, seed=seed)
        return model, model_path or f"{factory} ({hf_config})"
    if hf_config:
        raise InputError("--config goes with --model transformers:CLASS")
    if model_path and Path(model_path).is_dir():
        from attn_export.surgery import transformers as hf

        if factory:
            raise InputError("give either a MODEL folder or --model module:factory, not both")
        if not hf.is_pretrained_dir(model_path):
            raise InputError(f"{model_path}: is a directory without config.json: neither a model file nor a "
                             "transformers save_pretrained folder")
        return hf.load(None, path=model_path), model_path
    if model_path and factory:
        raise InputError("give either a MODEL file or --model module:factory, not both")
    if factory:
        return loading.load_factory(factory, weights), factory
    if weights:
        raise InputError("--weights goes with --model module:factory")
    if not model_path:
        raise InputError("no model: give a MODEL file (torch.save(model)), a transformers save_pretrained folder, "
                         "or --model module:factory")
    return loading.load_model(model_path, allow_classes=allow_class, trust_file=trust_model_file), model_path


def example_inputs(model, input_specs: Sequence[str], example_file: Optional[str], seed: int):
    """Example inputs: --example-inputs FILE, then --input specs (added or overriding), else the
    model's own ``example_inputs`` attribute."""
    from attn_export import inputs as _inputs
    from attn_export.errors import InputError

    from attn_export.surgery import transformers as hf

    is_hf = hf.contains_hf_model(model)
    inputs = {}
    if example_file:
        inputs.update(_inputs.load_example_file(example_file))
    if input_specs:
        specs = [_inputs.parse_input_spec(s) for s in input_specs]
        inputs.update(_inputs.synthesize(specs, _inputs.int_range_for(model), seed=seed,
                                         int_ranges=hf.int_ranges(model) if is_hf else None))
    if not inputs:
        inputs = _inputs.from_attribute(model) or {}
    if not inputs and is_hf:
        inputs = hf.example_inputs(model, seed=seed)
    if not inputs:
        params, _ = _inputs.forward_parameters(model)
        raise InputError(
            "no example inputs: give --input NAME:DIMS[:DTYPE] (repeatable; "
            f"{type(model).__name__}.forward takes {', '.join(params) or 'no named parameters'}) "
            "or --example-inputs FILE.pt, or give the model an example_inputs attribute"
        )
    return _inputs.order_for_model(model, inputs)


def resolve_axes(inputs, dynamic: Sequence[str], static: bool, model=None):
    from attn_export.surgery import transformers as hf
    from attn_export import inputs as _inputs
    from attn_export.errors import InputError

    overrides = [_inputs.parse_dynamic_spec(d) for d in dynamic]
    if static and overrides:
        raise InputError("--static and --dynamic exclude each other")
    defaults = hf.default_axes(inputs) if model is not None and hf.contains_hf_model(model) else None
    return _inputs.resolve_axes(inputs, overrides, static=static, defaults=defaults)


def finish_validation(session: Session, report, reports, extra=None) -> int:
    """The end of every verb that validates: the table, the --json/--junit reports, one
    FAILED line per failure on stderr, and the exit code (0 passed, 1 mismatch)."""
    session.out.print(report.table())
    write_reports(session, report, reports.json_path, reports.junit_path, extra=extra)
    if not report.passed:
        for line in report.failures:
            click.echo(f"FAILED: {line}", err=True)
        if report.diagnosis:
            click.echo(report.diagnosis["summary"], err=True)
        return EXIT_MISMATCH
    session.out.print(f"[green]PASSED[/]: {len(report.cases)} comparisons within tolerance")
    return EXIT_OK


def write_reports(session: Session, report, json_path: Optional[str], junit_path: Optional[str], extra=None) -> None:
    import json

    from attn_export.atomic_io import write_text
    from attn_export.errors import InputError

    try:
        if json_path:
            payload = report.to_dict()
            if extra:
                payload.update(extra)
            write_text(json_path, json.dumps(payload, indent=2, default=str) + "\n")
            session.note(f"wrote {json_path}")
        if junit_path:
            write_text(junit_path, report.to_junit_xml())
            session.note(f"wrote {junit_path}")
    except OSError as exc:
        raise InputError(f"cannot write the report: {exc.strerror or exc} ({exc.filename})") from exc


def common_verb(func):
    """Marks a verb: builds the Session from --quiet/--verbose and guards its body."""

    @functools.wraps(func)
    def wrapper(*args, quiet: bool = False, verbose: bool = False, **kwargs):
        session = Session(quiet=quiet, verbose=verbose)
        silence_library_warnings(verbose)
        run_guarded(session, lambda: func(session, *args, **kwargs))

    return wrapper
