"""Runtimes in a child process with a time limit: a segfault, an abort or a hang of ONNX
Runtime or TensorRT becomes a :class:`RuntimeCrash` (which runtime, which step, the signal or
the timeout, the optimization level) instead of the end of the gate.

    >>> with WorkerProcess(timeout_s=300) as worker:
    ...     info = worker.load("onnxruntime", path="model.onnx", optimization_level="ORT_ENABLE_ALL",
    ...                        providers=["CPUExecutionProvider"])
    ...     outputs = worker.run({"src": x.numpy()})

The child is worker.py started as a script in a fresh interpreter (never forked: a fork of a
process that holds OpenMP or CUDA state can hang or fail to initialize the GPU).
"""
from __future__ import annotations

import atexit
import os
import pickle
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional

from attn_export.options import DEFAULT_TIMEOUT_S
from attn_export.validation import worker as _protocol

WORKER_SCRIPT = Path(_protocol.__file__).resolve()


@dataclass
class CrashInfo:
    """How a runtime died: ``kind`` is "signal", "exit" or "timeout"."""

    runtime: str
    step: str  # "load" (session creation: parsing + graph optimization) | "run"
    kind: str
    detail: str  # "SIGSEGV", "exit code 134", "300 s"
    optimization_level: Optional[str] = None
    stderr_tail: str = ""

    def describe(self) -> str:
        what = {"load": "while loading the model (session creation: parsing and graph optimization)",
                "run": "while running the model"}.get(self.step, f"during {self.step}")
        how = f"timed out after {self.detail}" if self.kind == "timeout" else \
            f"crashed ({self.detail})" if self.kind == "signal" else f"died ({self.detail})"
        level = f" at optimization level {self.optimization_level}" if self.optimization_level else ""
        return f"{self.runtime} {how} {what}{level}"

    def to_dict(self) -> dict:
        return asdict(self)


class RuntimeCrash(RuntimeError):
    """The child process died or hung; ``info`` says how."""

    def __init__(self, info: CrashInfo) -> None:
        super().__init__(info.describe())
        self.info = info


class WorkerError(RuntimeError):
    """The runtime raised an ordinary error (the child is alive and answered)."""


class WorkerProcess:
    """One child process serving one runtime backend (see worker.py for the protocol)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, preload: Optional[str] = None) -> None:
        """Starts the child; ``preload`` names the backend whose runtime it imports right away
        (its start-up then overlaps with the caller's work until the first request)."""
        self.timeout_s = float(timeout_s)
        self.runtime = "runtime"
        self.optimization_level: Optional[str] = None
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, "-I", str(WORKER_SCRIPT), *([preload] if preload else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
        )

    # -- requests ------------------------------------------------------------------------------

    def load(self, backend: str, *, runtime: Optional[str] = None, optimization_level: Optional[str] = None,
             **args) -> dict:
        """Builds the backend in the child (an ONNX Runtime session, a TensorRT engine); its
        facts (inputs, outputs, ...) come back."""
        self.runtime = runtime or backend
        self.optimization_level = optimization_level
        if optimization_level is not None:
            args["optimization_level"] = optimization_level
        sys_path = [os.path.abspath(p) for p in sys.path]  # "" is the caller's working directory
        reply = self._request({"op": "load", "backend": backend, "args": args, "sys_path": sys_path}, "load")
        return reply["info"]

    def run(self, feeds: dict):
        return self._request({"op": "run", "feeds": feeds}, "run")["outputs"]

    def probe(self) -> dict:
        """What the runtime and the machine have (worker.probe): ONNX Runtime's version and
        available providers, the GPUs."""
        return self._request({"op": "probe"}, "probe")["probe"]

    def unload(self) -> None:
        """Drops the backend (the session, its memory); the process stays, ready for a load."""
        self._request({"op": "unload"}, "unload")

    def _request(self, message: dict, step: str) -> dict:
        try:
            _protocol.write_message(self._proc.stdin, message)
        except (BrokenPipeError, OSError):
            self._died(step)
        reply = self._read_reply(step)
        if not reply.get("ok"):
            raise WorkerError(reply.get("error", "unknown error"))
        return reply

    def _read_reply(self, step: str) -> dict:
        deadline = time.monotonic() + self.timeout_s
        fd = self._proc.stdout.fileno()
        data = bytearray()
        need = _protocol.HEADER.size
        size = None
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while len(data) < need:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self.kill()
                    raise RuntimeCrash(self._info(step, "timeout", f"{self.timeout_s:g} s"))
                chunk = os.read(fd, min(need - len(data), 1 << 20))
                if not chunk:
                    self._died(step)
                data += chunk
                if size is None and len(data) >= _protocol.HEADER.size:
                    (size,) = _protocol.HEADER.unpack(bytes(data[:_protocol.HEADER.size]))
                    need = _protocol.HEADER.size + size
        return pickle.loads(bytes(data[_protocol.HEADER.size:need]))

    # -- death ---------------------------------------------------------------------------------

    def _died(self, step: str):
        try:
            code = self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self._proc.returncode
        if code is not None and code < 0:
            try:
                detail = signal.Signals(-code).name
            except ValueError:
                detail = f"signal {-code}"
            raise RuntimeCrash(self._info(step, "signal", detail))
        raise RuntimeCrash(self._info(step, "exit", f"exit code {code}"))

    def _info(self, step: str, kind: str, detail: str) -> CrashInfo:
        return CrashInfo(runtime=self.runtime, step=step, kind=kind, detail=detail,
                         optimization_level=self.optimization_level, stderr_tail=self.stderr_tail())

    def stderr_tail(self, limit: int = 2000) -> str:
        """The end of what the runtime printed (its warnings: e.g. why a provider did not start)."""
        try:
            self._stderr.seek(0, os.SEEK_END)
            size = self._stderr.tell()
            self._stderr.seek(max(0, size - limit))
            return self._stderr.read().decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            return ""

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def close(self) -> None:
        """Ends the child (closing its stdin ends its loop) and frees the pipes."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        for stream in (self._proc.stdin, self._proc.stdout, self._stderr):
            try:
                stream.close()
            except OSError:
                pass

    def __enter__(self) -> "WorkerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Warm workers: a child's start-up (a fresh interpreter importing its runtime, ~0.2 s for ONNX
# Runtime) is paid while the caller does other work, and paid once per process, not per gate.
# --------------------------------------------------------------------------------------------

_IDLE: Dict[str, WorkerProcess] = {}  # preload -> one started worker with no backend loaded


def prestart(preload: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Starts a worker for ``preload`` now (e.g. before an export that takes seconds), so that the
    next :func:`take` finds it with its runtime already imported."""
    worker = _IDLE.get(preload)
    if worker is None or not worker.alive:
        if worker is not None:
            worker.close()
        _IDLE[preload] = WorkerProcess(timeout_s, preload=preload)


def take(preload: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> WorkerProcess:
    """An idle started worker for ``preload`` if there is one, else a new one."""
    worker = _IDLE.pop(preload, None)
    if worker is not None and worker.alive:
        worker.timeout_s = float(timeout_s)
        return worker
    if worker is not None:
        worker.close()
    return WorkerProcess(timeout_s, preload=preload)


def release(worker: WorkerProcess, preload: str) -> None:
    """Keeps a healthy worker (its backend unloaded) for the next :func:`take`; closes it when
    it died, misbehaves, or a worker of that kind is already waiting."""
    if preload not in _IDLE and worker.alive:
        try:
            worker.unload()
        except (RuntimeCrash, WorkerError):
            worker.close()
            return
        worker.optimization_level = None
        _IDLE[preload] = worker
        return
    worker.close()


@atexit.register
def _close_idle_workers() -> None:
    while _IDLE:
        _IDLE.popitem()[1].close()
