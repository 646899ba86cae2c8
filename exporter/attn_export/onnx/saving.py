"""The exported model checked and written whole or not at all."""
from __future__ import annotations

import os
from pathlib import Path

import onnx

from attn_export.atomic_io import atomic_output
from attn_export.errors import ExportError, InputError, first_line as _first_line


def save(proto, path: Path, check=None) -> None:
    """Checked by ``check`` (default ``onnx.checker.check_model``; with full_check) and written
    whole or not at all."""
    try:
        (check or onnx.checker.check_model)(proto, full_check=True)
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"the exported model fails onnx.checker.check_model(full_check=True): {_first_line(exc)}") from exc
    if proto.ByteSize() > 2**31 - 1:
        raise ExportError("the model is larger than 2 GB; external-data export is not supported yet")
    try:
        with atomic_output(path) as tmp:
            onnx.save_model(proto, str(tmp))
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from exc


def check_writable(path: Path) -> None:
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise InputError(f"cannot write {path}: directory {directory} does not exist")
    if path.is_dir():
        raise InputError(f"cannot write {path}: it is a directory")

    if not os.access(directory, os.W_OK):
        raise InputError(f"cannot write {path}: directory {directory} is not writable")
