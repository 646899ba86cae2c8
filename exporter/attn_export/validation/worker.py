"""The child process of an isolated runner (attn_export.validation.isolation).

A runtime that segfaults, aborts or hangs while it loads or runs a model must not take the
parity gate with it, so ONNX Runtime and TensorRT run here, in a process of their own, and the
gate reads their death as a failed case. This file is started as a script
(``python worker.py [BACKEND]``: BACKEND's runtime is imported before the first request), never imported as part of attn_export, so that an ONNX Runtime worker
starts in a fraction of a second without torch; only the TensorRT backend imports
attn_export (and torch).

Protocol (stdin -> stdout): length-prefixed pickles (8-byte little-endian size, then the
pickle). Requests: ``{"op": "load", "backend": NAME, "args": {...}}`` then any number of
``{"op": "run", "feeds": {name: ndarray}}``, and ``{"op": "unload"}`` before the next load (one
process serves one model after another). Replies: ``{"ok": True, ...}`` or
``{"ok": False, "error": "first line of the error"}``. ``{"op": "probe"}`` answers what ONNX
Runtime and the machine have (:func:`probe`) without loading a model. The runtimes' own prints
go to stderr (file
descriptor 1 is redirected there before anything loads), so they cannot corrupt the replies.
"""
from __future__ import annotations

import os
import pickle
import struct
import sys

HEADER = struct.Struct("<Q")


def read_message(stream):
    """The next message, or None at end of stream."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    return pickle.loads(stream.read(size))


def write_message(stream, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _first_line(exc: BaseException) -> str:
    """As attn_export.errors.first_line (not imported: this process must start without torch)."""
    for line in str(exc).strip().splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__


class OnnxRuntimeBackend:
    """An ONNX Runtime InferenceSession at the requested graph optimization level."""

    def __init__(self, path: str, optimization_level: str, providers, intra_op_threads: int = 0):
        """``providers``: names, or [name, options] pairs, in priority order."""
        import onnxruntime as ort

        self.version = ort.__version__
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, optimization_level)
        if intra_op_threads:
            options.intra_op_num_threads = intra_op_threads
        # Between requests the parent runs PyTorch on the same cores: ONNX Runtime's threads must
        # sleep, not spin-wait for work (its default), or they slow the parent down.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(path, options, providers=[p if isinstance(p, str) else tuple(p)
                                                                      for p in providers])

    def info(self) -> dict:
        return {"inputs": {v.name: v.type for v in self.session.get_inputs()},
                "outputs": [v.name for v in self.session.get_outputs()],
                "providers": self.session.get_providers(), "version": self.version}

    def run(self, feeds):
        import numpy as np

        return [np.asarray(o) for o in self.session.run(None, feeds)]


class TensorRTBackend:
    """attn_export.tensorrt.EngineRunner; bfloat16 crosses the pipe as float32 (numpy has no
    bfloat16) and is cast back on either side."""

    def __init__(self, engine: str, plugin):
        from attn_export.tensorrt import EngineRunner

        self.engine = EngineRunner(engine, plugin=plugin)

    def info(self) -> dict:
        library = self.engine.plugin_library
        return {"inputs": list(self.engine.inputs), "outputs": list(self.engine.outputs),
                "metadata": self.engine.metadata,
                "plugin_library": None if library is None else {"path": library.path, "sha256": library.sha256,
                                                                 "size": library.size},
                "profile": {n: [list(d) for d in dims] for n, dims in self.engine.profile.shapes.items()}}

    def run(self, feeds):
        import torch

        named = self.engine.run({n: torch.from_numpy(a) for n, a in feeds.items()})
        return {n: (t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy(), str(t.dtype))
                for n, t in named.items()}


class CachedTensorRTBackend(TensorRTBackend):
    """An engine of a cached export stepped by attn_export.tensorrt.CachedEngineSteps: a run
    takes the step's tokens (input_ids, attention_mask, position_ids) and returns the logits;
    the cache stays on the GPU here, between runs."""

    def __init__(self, engine: str, plugin):
        super().__init__(engine, plugin)
        from attn_export.tensorrt.generation import CachedEngineSteps

        self.steps = CachedEngineSteps(self.engine)

    def run(self, feeds):
        import torch

        named = self.steps.step({n: torch.from_numpy(a) for n, a in feeds.items()})
        return {n: (t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy(), str(t.dtype))
                for n, t in named.items()}


BACKENDS = {"onnxruntime": OnnxRuntimeBackend, "tensorrt": TensorRTBackend, "tensorrt-cached": CachedTensorRTBackend}

_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 75, 76


def cuda_devices():
    """([{"name", "capability"}], None) for the GPUs the CUDA driver sees, or ([], why none).
    Asked of the driver (libcuda) itself: torch is not imported here, and a GPU build of ONNX
    Runtime lists its GPU providers whether or not there is a GPU."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return [], f"no NVIDIA driver: {_first_line(exc)}"
    if cuda.cuInit(0) != 0:
        return [], "the NVIDIA driver found no usable GPU (cuInit failed)"
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return [], "the NVIDIA driver sees no GPU"
    gpus = []
    for index in range(count.value):
        device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        name = ctypes.create_string_buffer(256)
        cuda.cuDeviceGet(ctypes.byref(device), index)
        cuda.cuDeviceGetName(name, 256, device)
        cuda.cuDeviceGetAttribute(ctypes.byref(major), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
        cuda.cuDeviceGetAttribute(ctypes.byref(minor), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)
        gpus.append({"name": name.value.decode(errors="replace"), "capability": [major.value, minor.value]})
    return gpus, None


def probe() -> dict:
    """ONNX Runtime's version and available providers, and the GPUs: what the gate checks
    before it asks for a GPU provider (attn_export.validation.providers)."""
    import onnxruntime as ort

    gpus, problem = cuda_devices()
    return {"version": ort.__version__, "available": list(ort.get_available_providers()), "gpus": gpus,
            "gpu_problem": problem}


def serve(requests, replies) -> None:
    backend = None
    while True:
        message = read_message(requests)
        if message is None:
            return
        try:
            for path in message.get("sys_path", ()):  # the parent's, after this interpreter's own
                if path not in sys.path:
                    sys.path.append(path)
            if message["op"] == "load":
                backend = BACKENDS[message["backend"]](**message["args"])
                write_message(replies, {"ok": True, "info": backend.info(), "pid": os.getpid()})
            elif message["op"] == "run":
                write_message(replies, {"ok": True, "outputs": backend.run(message["feeds"])})
            elif message["op"] == "probe":
                write_message(replies, {"ok": True, "probe": probe()})
            elif message["op"] == "unload":
                backend = None
                write_message(replies, {"ok": True})
            else:
                write_message(replies, {"ok": False, "error": f"unknown request {message['op']!r}"})
        except Exception as exc:  # noqa: BLE001 - a Python-level error is an answer, not a crash
            write_message(replies, {"ok": False, "error": _first_line(exc)})


PRELOAD = {"onnxruntime": "onnxruntime"}


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever the runtimes print goes to stderr, never into the replies
    for backend in sys.argv[1:]:  # import the runtime now, while the parent still has other work
        if backend in PRELOAD:
            __import__(PRELOAD[backend])
    serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
