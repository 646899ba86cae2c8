"""TensorRT and the GPU: importing TensorRT (10 or newer, for IPluginV3), the GPU checks, the
errors every TensorRT step raises, and the environment facts for reports."""
from __future__ import annotations

import re
from typing import Dict, List

import torch

from attn_export.errors import AttnExportError, first_line as _first_line

INSTALL_TENSORRT = (
    "install TensorRT's Python package for your CUDA version (pip install tensorrt-cu13, or "
    "tensorrt-cu12 for CUDA 12; TensorRT 10 or newer) on a machine with an NVIDIA GPU; see docs/tensorrt.md"
)


class TensorRTUnavailable(AttnExportError):
    """TensorRT's Python package or a usable GPU is missing (exit 2); the message says what to install."""


class PluginError(AttnExportError):
    """The plugin library cannot serve the model's nodes (exit 2); the message says why."""


class EngineError(AttnExportError):
    """Parsing, building, loading or running an engine failed (exit 2)."""


def import_tensorrt():
    """The ``tensorrt`` module, or TensorRTUnavailable saying what to install."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise TensorRTUnavailable(f"TensorRT is not installed ({_first_line(exc)}): {INSTALL_TENSORRT}") from exc
    except Exception as exc:  # noqa: BLE001 - e.g. the wheel's libraries fail to load
        raise TensorRTUnavailable(f"TensorRT failed to import ({_first_line(exc)}): {INSTALL_TENSORRT}") from exc
    major = _major_version(getattr(trt, "__version__", "0"))
    if major < 10:
        raise TensorRTUnavailable(
            f"TensorRT {trt.__version__} has no IPluginV3 support, which the FusedAttention plugin needs: "
            f"{INSTALL_TENSORRT}"
        )
    return trt


def require_gpu() -> None:
    """Engines are built and run on an NVIDIA GPU, through a CUDA build of PyTorch (for the buffers)."""
    if torch.version.cuda is None:
        raise TensorRTUnavailable(
            f"this PyTorch ({torch.__version__}) is a CPU build; TensorRT engines are built and run on an "
            "NVIDIA GPU with a CUDA build of PyTorch (e.g. pip install torch --index-url "
            "https://download.pytorch.org/whl/cu130)"
        )
    if not torch.cuda.is_available():
        raise TensorRTUnavailable(
            "no usable NVIDIA GPU (torch.cuda.is_available() is False: no GPU, or the driver is missing or too "
            "old); TensorRT engines are built and run on a GPU"
        )


def require_runtime():
    """TensorRT and a GPU, both checked (the first thing the CLI does for --to tensorrt / --engine)."""
    trt = import_tensorrt()
    require_gpu()
    return trt


def _major_version(version: str) -> int:
    m = re.match(r"(\d+)", str(version))
    return int(m.group(1)) if m else 0


def collecting_logger(trt):
    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: List[str] = []
            self.warnings: List[str] = []

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.errors.append(str(msg))
            elif severity == trt.ILogger.Severity.WARNING:
                self.warnings.append(str(msg))

    return Logger()


def gpu_name() -> str:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"{props.name} (sm_{props.major}{props.minor})"


def environment() -> Dict[str, object]:
    """TensorRT's version and the GPU, for reports (whatever is importable)."""
    env: Dict[str, object] = {}
    try:
        import tensorrt as trt

        env["tensorrt"] = trt.__version__
    except Exception:  # noqa: BLE001
        env["tensorrt"] = None
    if torch.cuda.is_available():
        env["gpu"] = gpu_name()
    return env
