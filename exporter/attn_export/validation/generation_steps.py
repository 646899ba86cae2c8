"""The step runners of the generation gate (validation/generation.py): one loop feeds the
tokens, a step runner holds the cache and runs one step.

    >>> steps.step({"input_ids": ids, "attention_mask": mask, "position_ids": pos})  # -> {"logits": ...}

A step whose attention mask is as wide as its input_ids is a prefill (an empty past); every
other step takes the presents of the step before as its past, by name (the cache's contract,
attn_export/cache_contract.py, maps each present to its past). ``OrtSteps`` holds the cache on the CPU and feeds it to an ONNX
Runtime session; ``EngineSteps`` leaves it to attn_export.tensorrt.CachedEngineSteps, on the
GPU, in TensorRT's child process (or in this one with ``isolate=False``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Mapping, Optional

import torch

from attn_export.cache_contract import DTYPES, CacheContract  # noqa: F401 - DTYPES: public here
from attn_export.errors import InputError
from attn_export.validation.runners import BACKEND_TRT, IsolatedEngine


def is_prefill(feed: Mapping[str, torch.Tensor]) -> bool:
    return feed["attention_mask"].shape[1] == feed["input_ids"].shape[1]


class OrtSteps:
    """An OnnxRuntimeRunner (loaded) stepped with the cache held here."""

    def __init__(self, runner, layout: CacheContract, output_names: List[str]) -> None:
        self.runner, self.name = runner, runner.name
        self.layout, self.output_names = layout, list(output_names)
        self.presents = layout.present_to_past()
        self.past: Dict[str, torch.Tensor] = {}

    def step(self, feed: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        if is_prefill(feed):
            self.past = self.layout.empty_past(feed["input_ids"].shape[0])
        elif not self.past:
            raise InputError("a decode step before any prefill: the cache is empty")
        outs = dict(zip(self.output_names, self.runner.run({**feed, **self.past})))
        self.past = {self.presents[n]: t for n, t in outs.items() if n in self.presents}
        return {n: t for n, t in outs.items() if n not in self.presents}

    def close(self) -> None:
        self.runner.close()


class EngineSteps:
    """A TensorRT engine of a cached export, stepped with its cache on the GPU: in a child
    process (worker backend ``tensorrt-cached``) unless ``isolate=False``. TensorRT or a GPU
    missing: TensorRTUnavailable (exit 2) saying what to install."""

    name = BACKEND_TRT

    def __init__(self, engine: str | Path, plugin: Optional[str | Path], *, isolate: bool = True,
                 timeout_s: float) -> None:
        from attn_export import tensorrt as attn_trt  # looked up here: tests stand in for EngineRunner

        if isolate:
            attn_trt.require_runtime()
            self.engine = IsolatedEngine(engine, plugin, timeout_s, backend="tensorrt-cached")
            self._step = self.engine.run
        else:
            self.engine = attn_trt.EngineRunner(engine, plugin=plugin)
            self._step = attn_trt.CachedEngineSteps(self.engine).step

    def step(self, feed: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return self._step(feed)

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
