"""The GPU benchmark's cases (issue 46's table) and the work each one counts: no GPU needed.

FLOPs as FlashAttention counts them: ``4 B H Lq Lk D`` for the forward (two matrix products of
``2 Lq Lk D`` each per head), halved when causal, and 3.5x that for forward+backward (the
backward is 2.5x the forward). Padded rows count only the keys that are not padding. Decode rows
count bytes instead: the K and V cache read once, ``2 B Hkv Lk D`` elements.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

GROUPS = ("decode", "hdims", "padded", "layer", "prefill", "small")
DEFAULT_GROUPS = ("decode", "hdims", "padded", "layer", "prefill")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
BACKWARD_FACTOR = 3.5  # forward + backward = (1 + 2.5) x forward
PREFILL_TOKENS = 16384  # batch x seq of every prefill row
PREFILL_EMBED = 2048  # heads x head dim of every prefill row
PADDED_LENGTHS = (0.25, 0.5, 0.75, 1.0)  # each sequence's share of the padded length


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the table. ``layer``/``small`` rows are whole layers (embed = heads x head_dim)."""

    group: str
    dtype: str
    mode: str  # "forward", "forward+backward" or (layer rows) "inference"
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    causal: bool = False
    kv_heads: Optional[int] = None  # None: as many as query heads
    pad_lengths: Optional[Tuple[float, ...]] = None  # padded rows: valid fraction per sequence

    @property
    def n_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def metric(self) -> str:
        return {"decode": "GB/s", "layer": "ms", "small": "us"}.get(self.group, "TFLOP/s")

    def valid_lengths(self) -> Tuple[int, ...]:
        """Unpadded key count of each sequence (padded rows cycle through PADDED_LENGTHS)."""
        if self.pad_lengths is None:
            return (self.kv_len,) * self.batch
        return tuple(max(1, round(self.kv_len * self.pad_lengths[b % len(self.pad_lengths)]))
                     for b in range(self.batch))

    def label(self) -> str:
        gqa = f" Hkv{self.n_kv_heads}" if self.n_kv_heads != self.heads else ""
        if self.group in ("layer", "small"):
            shape = f"{self.batch}x{self.q_len}x{self.heads * self.head_dim}x{self.heads}"
        else:
            shape = f"B{self.batch} H{self.heads}{gqa} Lq{self.q_len} Lk{self.kv_len} D{self.head_dim}"
        return f"{shape} {self.dtype}{' causal' if self.causal else ''} {self.mode}"


def attention_flops(case: Case) -> float:
    """FLOPs of the attention core, FlashAttention's count (module docstring)."""
    keys = sum(case.valid_lengths())  # sum over the batch of the keys each query sees
    forward = 4.0 * case.heads * case.q_len * keys * case.head_dim / (2 if case.causal else 1)
    return forward * (BACKWARD_FACTOR if case.mode == "forward+backward" else 1)


def kv_bytes(case: Case) -> int:
    """Bytes of K and V a decode step must read: each element of the cache once."""
    return 2 * case.batch * case.n_kv_heads * case.kv_len * case.head_dim * ITEMSIZE[case.dtype]


def work(case: Case) -> Optional[float]:
    """What the row's rate divides by time: FLOPs, bytes, or nothing (latency rows)."""
    if case.metric == "TFLOP/s":
        return attention_flops(case)
    if case.metric == "GB/s":
        return float(kv_bytes(case))
    return None


def rate(case: Case, seconds: float) -> float:
    """The row's figure from one time: TFLOP/s, GB/s, or the time itself in ms/us."""
    scale = {"TFLOP/s": 1e-12, "GB/s": 1e-9}.get(case.metric)
    if scale is not None:
        return work(case) / seconds * scale
    return seconds * (1e3 if case.metric == "ms" else 1e6)


# ---- the case lists -----------------------------------------------------------------------

MODES = ("forward", "forward+backward")


def prefill_cases(quick: bool):
    seqlens = (1024, 8192) if quick else (1024, 2048, 4096, 8192, 16384)
    return [Case("prefill", dtype, mode, max(1, PREFILL_TOKENS // L), PREFILL_EMBED // d, L, L, d, causal)
            for dtype in ("float16", "bfloat16") for d in (32, 64, 128) for causal in (False, True)
            for L in seqlens for mode in MODES]


def hdims_cases(quick: bool):
    L = 4096
    return [Case("hdims", "bfloat16", mode, PREFILL_TOKENS // L, PREFILL_EMBED // d, L, L, d, True)
            for d in (80, 96, 256) for mode in (MODES[:1] if quick else MODES)]


def decode_cases(quick: bool):
    """32 query heads on 32, 8 or 4 key/value heads: the grouped ones pack 4 or 8 heads' rows into one
    tile under the preview switch (docs/cuda.md "Grouped-query heads packed for decode")."""
    return [Case("decode", "bfloat16", "forward", 16, 32, q_len, kv_len, 128, kv_heads=kv_heads)
            for kv_len in (4096, 32768) for kv_heads in (32, 8, 4) for q_len in ((1,) if quick else (1, 4))]


def padded_cases(quick: bool):
    return [Case("padded", "float16", mode, 8, 16, 4096, 4096, 64, pad_lengths=PADDED_LENGTHS)
            for mode in MODES]


def layer_cases(quick: bool):
    return [Case("layer", "bfloat16", mode, 4, 8, 4096, 4096, 128) for mode in MODES]


def small_layer_cases(quick: bool):
    """The seed's layer shapes (launch-bound): batch 8, seq 10/16, embed 64/128, 4 heads."""
    return [Case("small", dtype, mode, 8, 4, L, L, e // 4)
            for dtype in ("float32", "float16") for L in (10, 16) for e in (64, 128)
            for mode in ("inference",) + MODES]


CASE_LISTS = {"prefill": prefill_cases, "hdims": hdims_cases, "decode": decode_cases,
              "padded": padded_cases, "layer": layer_cases, "small": small_layer_cases}


def select_cases(groups, quick: bool = False):
    """Every case of the named groups, in the order given."""
    return [case for g in groups for case in CASE_LISTS[g](quick)]


def dry_run_case(case: Case) -> Case:
    """The same row at tiny sizes, for a CPU run that checks the script itself."""
    small = dict(batch=min(case.batch, 2), heads=min(case.heads, 4), q_len=min(case.q_len, 64),
                 kv_len=min(case.kv_len, 64), kv_heads=None if case.n_kv_heads == case.heads else 2)
    if case.group == "layer":
        small.update(q_len=32, kv_len=32, head_dim=16)
    return dataclasses.replace(case, **small)
