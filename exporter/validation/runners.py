"""The backends of the parity gate, one class each (Polygraphy's runners).

A runner is loaded once, then run on each shape case; it returns the model's outputs as
tensors, flattened in the ONNX graph's output order. The gate (attn_export.validation.gate)
takes a reference runner and a list of runners and knows nothing else about them, so a new
backend — another ONNX Runtime execution provider, the standard-Attention flavor — is one
class here.

    >>> ort_runner = OnnxRuntimeRunner("model.onnx")
    >>> ort_runner.load()
    >>> outputs = ort_runner.run({"src": x})
"""
from __future__ import annotations

import abc
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import nn

from attn_export import inputs as _inputs

BACKEND_REFERENCE = "pytorch"
BACKEND_REPLACED = "pytorch-replaced"
BACKEND_ORT = "onnxruntime"
BACKEND_TRT = "tensorrt"

ONNX_ELEM_TO_TORCH = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16, 11: torch.float64, 7: torch.int64,
                      6: torch.int32, 9: torch.bool, 2: torch.uint8, 3: torch.int8, 5: torch.int16}


class RunnerError(RuntimeError):
    """A runner could not load or run; ``step`` says where (load, run)."""

    def __init__(self, message: str, step: str = "run") -> None:
        super().__init__(message)
        self.step = step


class Runner(abc.ABC):
    """One backend. ``load`` raises RunnerError when the backend cannot take the model at all
    (reported once for every case); ``skip_reason`` says why a case is not run (e.g. shapes
    outside a TensorRT profile); ``run`` returns the outputs or raises."""

    name: str

    def load(self) -> None:
        """Prepare the backend (create a session, deserialize an engine)."""

    def skip_reason(self, inputs: Mapping[str, torch.Tensor]) -> Optional[str]:
        return None

    @abc.abstractmethod
    def run(self, inputs: Mapping[str, torch.Tensor]) -> List[torch.Tensor]:
        """The outputs for these inputs, flattened in output order."""

    def close(self) -> None:
        """Release what ``load`` took."""


class FastPathsOff:
    """The reference runs the original model with PyTorch's native MHA fast paths off: the
    nested-tensor path of nn.TransformerEncoder writes zeros at padded positions, which no
    exported graph reproduces (nor needs to). Restored afterwards."""

    def __enter__(self):
        self._was = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)

    def __exit__(self, *exc):
        torch.backends.mha.set_fastpath_enabled(self._was)


class TorchRunner(Runner):
    """A PyTorch model (in eval mode) run with its floating inputs cast to ``dtype``: the
    original model (the reference, float32, fast paths off; or the same-dtype baseline) or the
    copy whose attention was replaced by the fused operator."""

    def __init__(self, name: str, model: nn.Module, dtype: torch.dtype, *, fast_paths: bool = True) -> None:
        self.name = name
        self.model = model
        self.dtype = dtype
        self.fast_paths = fast_paths

    def run(self, inputs: Mapping[str, torch.Tensor]) -> List[torch.Tensor]:
        from attn_export.onnx_export import flatten_outputs

        cast = _inputs.cast_floats(inputs, self.dtype)
        with torch.no_grad():
            if self.fast_paths:
                return flatten_outputs(self.model(**cast))
            with FastPathsOff():
                return flatten_outputs(self.model(**cast))


def feeds_for(graph_inputs: Mapping[str, int], inputs: Mapping[str, torch.Tensor]) -> dict:
    """numpy feeds for ONNX Runtime, each input cast to the element type the graph declares."""
    feeds = {}
    for name, elem in graph_inputs.items():
        t = inputs[name]
        want = ONNX_ELEM_TO_TORCH.get(elem, t.dtype)
        if want == torch.bfloat16:
            raise RunnerError("bfloat16 inputs cannot be fed to ONNX Runtime's Python API from numpy")
        feeds[name] = t.to(want).numpy()
    return feeds


class OnnxRuntimeRunner(Runner):
    """The ONNX file in an ONNX Runtime session (CPU execution provider, default optimization
    level)."""

    name = BACKEND_ORT

    def __init__(self, onnx_path: str | Path, providers: Sequence[str] = ("CPUExecutionProvider",)) -> None:
        self.onnx_path = Path(onnx_path)
        self.providers = list(providers)
        self._session = None

    def load(self) -> None:
        import onnxruntime as ort

        from attn_export._errors import first_line

        options = ort.SessionOptions()
        options.log_severity_level = 3
        try:
            self._session = ort.InferenceSession(str(self.onnx_path), options, providers=self.providers)
        except Exception as exc:  # noqa: BLE001
            raise RunnerError(f"ONNX Runtime cannot load the model: {first_line(exc)}", step="load") from exc

    def run(self, inputs: Mapping[str, torch.Tensor]) -> List[torch.Tensor]:
        graph_inputs = {v.name: _elem_type(v.type) for v in self._session.get_inputs()}
        outs = self._session.run(None, feeds_for(graph_inputs, inputs))
        return [torch.from_numpy(np.asarray(o)) for o in outs]

    def close(self) -> None:
        self._session = None


_ORT_TYPE_TO_ELEM = {"tensor(float)": 1, "tensor(float16)": 10, "tensor(bfloat16)": 16, "tensor(double)": 11,
                     "tensor(int64)": 7, "tensor(int32)": 6, "tensor(bool)": 9, "tensor(uint8)": 2,
                     "tensor(int8)": 3, "tensor(int16)": 5}


def _elem_type(ort_type: str) -> int:
    return _ORT_TYPE_TO_ELEM.get(ort_type, 0)


class TensorRTRunner(Runner):
    """A TensorRT engine of the ONNX file (attn_export.tensorrt.EngineRunner), with the
    FusedAttention plugin library. Cases outside the engine's optimization profile are skipped."""

    name = BACKEND_TRT

    def __init__(self, engine: str | Path, plugin: Optional[str | Path], graph_inputs: Sequence[str],
                 output_names: Sequence[str]) -> None:
        from attn_export import tensorrt as attn_trt  # looked up here: tests stand in for EngineRunner

        self.engine_path = engine
        self.engine = attn_trt.EngineRunner(engine, plugin=plugin)
        self.graph_inputs = list(graph_inputs)
        self.output_names = list(output_names)

    def _feeds(self, inputs: Mapping[str, torch.Tensor]):
        return {n: inputs[n] for n in self.graph_inputs}

    def skip_reason(self, inputs: Mapping[str, torch.Tensor]) -> Optional[str]:
        return self.engine.outside_profile(self._feeds(inputs)) or None

    def run(self, inputs: Mapping[str, torch.Tensor]) -> List[torch.Tensor]:
        named = self.engine.run(self._feeds(inputs))
        return [named[n] for n in self.output_names]
