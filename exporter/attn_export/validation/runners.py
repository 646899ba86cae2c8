"""The backends of the parity gate, one class each (Polygraphy's runners).

A runner is loaded once, then run on each shape case; it returns the model's outputs as
tensors, flattened in the ONNX graph's output order. The gate (attn_export.validation.gate)
takes a reference runner and a list of runners and knows nothing else about them, so a new
backend — the standard-Attention flavor — is one class here, and each ONNX Runtime execution
provider is one OnnxRuntimeRunner (providers.py).

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
from attn_export.validation import isolation
from attn_export.validation.isolation import DEFAULT_TIMEOUT_S, RuntimeCrash, WorkerError, WorkerProcess
from attn_export.validation.providers import _ORT_WORKER, CPU_SETUP, ProviderSetup, fallback_problem

BACKEND_REFERENCE = "pytorch"
BACKEND_REPLACED = "pytorch-replaced"
BACKEND_ORT = CPU_SETUP.backend  # "onnxruntime"; the GPU providers' rows are onnxruntime-cuda, -tensorrt
BACKEND_TRT = "tensorrt"
DEFAULT_ORT_LEVEL = "ORT_ENABLE_ALL"  # ONNX Runtime's own default: what users' sessions get
ORT_LEVELS = ("ORT_ENABLE_ALL", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_BASIC", "ORT_DISABLE_ALL")

ONNX_ELEM_TO_TORCH = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16, 11: torch.float64, 7: torch.int64,
                      6: torch.int32, 9: torch.bool, 2: torch.uint8, 3: torch.int8, 5: torch.int16}


class RunnerError(RuntimeError):
    """A runner could not load or run; ``step`` says where (load, run), ``crash`` how the
    runtime's process died (isolation.CrashInfo) when it did."""

    def __init__(self, message: str, step: str = "run", crash=None) -> None:
        super().__init__(message)
        self.step = step
        self.crash = crash


class Runner(abc.ABC):
    """One backend. ``load`` raises RunnerError when the backend cannot take the model at all
    (reported once for every case); ``skip_reason`` says why a case is not run (e.g. shapes
    outside a TensorRT profile); ``run`` returns the outputs or raises. A context manager:
    ``with`` closes it whatever happens inside."""

    name: str
    precision: Optional[str] = None  # float32 math done at lower precision ("tf32", "fp16"): a wider tolerance

    def load(self) -> None:
        """Prepare the backend (create a session, deserialize an engine)."""

    def skip_reason(self, inputs: Mapping[str, torch.Tensor]) -> Optional[str]:
        return None

    @abc.abstractmethod
    def run(self, inputs: Mapping[str, torch.Tensor]) -> List[torch.Tensor]:
        """The outputs for these inputs, flattened in output order."""

    def close(self) -> None:
        """Release what ``load`` took."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
        from attn_export.onnx import flatten_outputs

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


def prestart_onnxruntime(timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Starts ONNX Runtime's process now (the CLI does so before exporting), so that the gate
    finds the runtime imported."""
    isolation.prestart(_ORT_WORKER, timeout_s)


class OnnxRuntimeRunner(Runner):
    """The ONNX file in an ONNX Runtime session (default optimization level ORT_ENABLE_ALL) on
    one execution provider (``setup``, providers.ProviderSetup; default the CPU's), in a child
    process (isolation.WorkerProcess): a crash or a hang of ONNX Runtime becomes a RunnerError
    carrying its CrashInfo, and the next case starts a fresh process. A session that lacks the
    provider it was asked for (ONNX Runtime's silent fall back to the CPU) is a RunnerError at
    load. One runner per provider: ``name`` is the setup's backend row."""

    def __init__(self, onnx_path: str | Path, setup: Optional[ProviderSetup] = None, *,
                 optimization_level: str = DEFAULT_ORT_LEVEL, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.onnx_path = Path(onnx_path)
        self.setup = setup or CPU_SETUP
        self.name = self.setup.backend
        self.precision = self.setup.precision
        self.providers = [(p, dict(o)) for p, o in self.setup.session_providers]  # as InferenceSession takes them
        self.optimization_level = optimization_level
        self.timeout_s = timeout_s
        self._worker: Optional[WorkerProcess] = None
        self._input_types: dict = {}
        self.version: Optional[str] = None
        self.session_providers: Optional[List[str]] = None  # what the session had, once loaded

    def start(self) -> None:
        """Starts the child process now (it imports ONNX Runtime while the caller does other
        work); ``load`` uses it. Optional."""
        prestart_onnxruntime(self.timeout_s)

    def load(self) -> None:
        worker = isolation.take(_ORT_WORKER, self.timeout_s)
        try:
            # Absolute: a warm worker keeps the working directory it was started in.
            info = worker.load("onnxruntime", optimization_level=self.optimization_level,
                               path=str(self.onnx_path.resolve()), providers=self.providers)
        except RuntimeCrash as exc:
            worker.close()
            raise RunnerError(str(exc), step="load", crash=exc.info) from exc
        except WorkerError as exc:
            isolation.release(worker, _ORT_WORKER)
            raise RunnerError(f"ONNX Runtime cannot load the model: {exc}", step="load") from exc
        self.session_providers = list(info["providers"])
        fallback = fallback_problem(self.setup, self.session_providers, worker.stderr_tail())
        if fallback:
            isolation.release(worker, _ORT_WORKER)
            raise RunnerError(fallback, step="load")
        self._worker = worker
        self._input_types = {name: _elem_type(kind) for name, kind in info["inputs"].items()}
        self.version = info["version"]  # the report's, without importing ONNX Runtime here

    def run(self, inputs: Mapping[str, torch.Tensor]) -> List[torch.Tensor]:
        if self._worker is None or not self._worker.alive:
            self.close()
            self.load()  # the process died on an earlier case: a fresh one for this case
        try:
            outs = self._worker.run(feeds_for(self._input_types, inputs))
        except RuntimeCrash as exc:
            self.close()
            raise RunnerError(str(exc), step="run", crash=exc.info) from exc
        return [torch.from_numpy(np.asarray(o)) for o in outs]

    def close(self) -> None:
        if self._worker is not None:
            isolation.release(self._worker, _ORT_WORKER)  # kept warm for the next gate when healthy
            self._worker = None


_ORT_TYPE_TO_ELEM = {"tensor(float)": 1, "tensor(float16)": 10, "tensor(bfloat16)": 16, "tensor(double)": 11,
                     "tensor(int64)": 7, "tensor(int32)": 6, "tensor(bool)": 9, "tensor(uint8)": 2,
                     "tensor(int8)": 3, "tensor(int16)": 5}


def _elem_type(ort_type: str) -> int:
    return _ORT_TYPE_TO_ELEM.get(ort_type, 0)


class TensorRTRunner(Runner):
    """A TensorRT engine of the ONNX file (attn_export.tensorrt.EngineRunner), with the
    FusedAttention plugin library, in a child process unless ``isolate=False`` (a crash or a
    hang of TensorRT then becomes a failed case). Cases outside the engine's optimization
    profile are skipped. ``engine`` has EngineRunner's facts (inputs, outputs, metadata,
    plugin_library) for the gate's engine check."""

    name = BACKEND_TRT

    def __init__(self, engine: str | Path, plugin: Optional[str | Path], graph_inputs: Sequence[str],
                 output_names: Sequence[str], *, isolate: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        from attn_export import tensorrt as attn_trt  # looked up here: tests stand in for EngineRunner

        self.engine_path = engine
        self.graph_inputs = list(graph_inputs)
        self.output_names = list(output_names)
        if isolate:
            attn_trt.require_runtime()  # TensorRT or a GPU missing: exit 2 with what to install, as in-process
            self.engine = IsolatedEngine(engine, plugin, timeout_s)
        else:
            self.engine = attn_trt.EngineRunner(engine, plugin=plugin)

    def _feeds(self, inputs: Mapping[str, torch.Tensor]):
        return {n: inputs[n] for n in self.graph_inputs}

    def skip_reason(self, inputs: Mapping[str, torch.Tensor]) -> Optional[str]:
        return self.engine.outside_profile(self._feeds(inputs)) or None

    def run(self, inputs: Mapping[str, torch.Tensor]) -> List[torch.Tensor]:
        named = self.engine.run(self._feeds(inputs))
        return [named[n] for n in self.output_names]

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


class IsolatedEngine:
    """EngineRunner's interface over a child process that holds the engine. A crash while the
    engine loads is raised as RunnerError (the gate reports it as a failed case); an ordinary
    error (bad engine file, plugin missing) as EngineError (exit 2), as in-process."""

    def __init__(self, engine: str | Path, plugin: Optional[str | Path], timeout_s: float,
                 backend: str = "tensorrt") -> None:
        """``backend``: the worker's (worker.BACKENDS): ``tensorrt`` runs the engine on whole
        inputs; ``tensorrt-cached`` steps a cached export, its cache kept in the child."""
        from attn_export.tensorrt import EngineError, LibraryInfo, ShapeProfile

        self._backend = backend
        self._args = {"engine": str(Path(engine).resolve()),
                      "plugin": None if plugin is None else str(Path(plugin).resolve())}
        self._timeout_s = timeout_s
        self._worker: Optional[WorkerProcess] = None
        try:
            info = self._start()
        except WorkerError as exc:
            raise EngineError(str(exc)) from exc
        self.inputs, self.outputs = info["inputs"], info["outputs"]
        self.metadata = info["metadata"]
        library = info["plugin_library"]
        self.plugin_library = LibraryInfo(**library) if library else None
        self.profile = ShapeProfile(shapes={n: tuple(tuple(d) for d in dims) for n, dims in info["profile"].items()},
                                    labels={})

    def _start(self) -> dict:
        self._worker = WorkerProcess(self._timeout_s)
        try:
            return self._worker.load(self._backend, runtime="tensorrt", **self._args)
        except RuntimeCrash as exc:
            self.close()
            raise RunnerError(str(exc), step="load", crash=exc.info) from exc
        except WorkerError:
            self.close()
            raise

    def outside_profile(self, inputs: Mapping[str, torch.Tensor]) -> Optional[str]:
        return self.profile.outside({n: tuple(t.shape) for n, t in inputs.items() if n in self.profile.shapes})

    def run(self, inputs: Mapping[str, torch.Tensor]):
        if self._worker is None or not self._worker.alive:
            self.close()
            self._start()
        feeds = {n: (t.float() if t.dtype == torch.bfloat16 else t).numpy() for n, t in inputs.items()}
        try:
            named = self._worker.run(feeds)
        except RuntimeCrash as exc:
            self.close()
            raise RunnerError(str(exc), step="run", crash=exc.info) from exc
        return {n: torch.from_numpy(a).to(getattr(torch, kind.replace("torch.", ""))) for n, (a, kind) in named.items()}

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
