"""Errors the tools report to users as one line, with the exit code the CLI uses."""
from __future__ import annotations

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2


class AttnExportError(Exception):
    """A problem the user can act on; the CLI prints ``error: <message>`` and exits with
    ``exit_code`` (a traceback only with --verbose)."""

    exit_code = EXIT_USAGE


class InputError(AttnExportError, ValueError):
    """A bad model file, input specification, or an input the model rejects (exit 2)."""


class ExportError(AttnExportError):
    """The model could not be exported as requested (exit 2)."""


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (library errors run long)."""
    for line in str(exc).strip().splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__
