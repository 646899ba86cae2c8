"""Timing for the GPU benchmark: CUDA events around blocks of calls after a warm-up, the best
block's mean per call (noise on a GPU only adds time); host clock on the CPU (dry run). A column
that cannot run a case comes back as "n/a" with the backend's own reason, never as a crash."""
from __future__ import annotations

import dataclasses
import re
import time
import warnings
from typing import Callable, Optional

import torch

from benchmarks.gpu_cases import Case
from benchmarks.gpu_impls import NotApplicable, prepare


@dataclasses.dataclass(frozen=True)
class Timing:
    blocks: int = 5  # best of this many blocks
    block_s: float = 0.05  # calls per block: enough to fill this long
    max_s: float = 3.0  # stop adding blocks past this much timed work (slow columns)
    warmup: int = 2


@dataclasses.dataclass
class Measurement:
    seconds: Optional[float]  # per call; None: n/a
    note: Optional[str] = None


def elapsed_s(fn: Callable[[], object], iters: int, device: str) -> float:
    """Seconds for ``iters`` back-to-back calls of fn."""
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def best_of_blocks(fn: Callable[[], object], timing: Timing, device: str) -> float:
    for _ in range(timing.warmup):  # allocations, lazy init, autotuning, module load
        fn()
    one = elapsed_s(fn, 1, device)
    iters = max(1, int(timing.block_s / max(one, 1e-7)))
    best, spent = one, one
    for _ in range(timing.blocks):
        block = elapsed_s(fn, iters, device)
        best, spent = min(best, block / iters), spent + block
        if spent > timing.max_s:
            break
    return best


def refusal_reason(error: BaseException, caught) -> str:
    """The backend's words: SDPA warns why each kernel declined, then raises a generic error."""
    why = [re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", str(w.message)).strip()
           for w in caught if issubclass(w.category, UserWarning)]
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = "; ".join(dict.fromkeys(why)) or first
    return text if len(text) <= 240 else text[:237] + "..."


def measure(impl: str, case: Case, device: str, timing: Timing, prepare_fn=prepare) -> Measurement:
    """One column of one row: its time per call, or None and why it did not run."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            prepared = prepare_fn(impl, case, device)
            with prepared.context():
                return Measurement(best_of_blocks(prepared.call, timing, device), prepared.note)
        except torch.OutOfMemoryError:
            return Measurement(None, "n/a: out of memory")
        except NotApplicable as e:
            return Measurement(None, f"n/a: {e}")
        except (RuntimeError, ValueError, NotImplementedError) as e:
            return Measurement(None, f"n/a: {refusal_reason(e, caught)}")
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
