"""Shared pieces of the CLI verbs: error reporting and exit codes."""
from __future__ import annotations

from typing import NoReturn

import click

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """One clear line on stderr and a non-zero exit; no traceback."""
    click.echo(f"error: {message}", err=True)
    raise SystemExit(code)
