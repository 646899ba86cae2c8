"""The GPU benchmark's rows and tables: each row's figures, its best other column and attn_export's
ratio to it, rendered as markdown (JSON is the rows themselves). No GPU needed."""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

from benchmarks.gpu_cases import BACKWARD_FACTOR, Case, rate

# HBM peak by device name (vendor datasheets, TB/s): the first key found in the name wins.
HBM_PEAK_TBS = {"H200": 4.8, "H100 PCIe": 2.0, "H100": 3.35, "GH200": 4.0, "B200": 8.0, "A100-SXM4-80GB": 2.039,
                "A100 80GB PCIe": 1.935, "A100": 1.555, "L40S": 0.864, "L40": 0.864, "L4": 0.3, "A10": 0.6}
OURS = "attn_export"
TITLES = {
    "prefill": "Prefill: attention core, 16k tokens per batch, 2048 / head dim heads (TFLOP/s)",
    "hdims": "Other head dims: bf16 causal, seq 4096 (TFLOP/s)",
    "decode": "Decode: a query or a few against a KV cache (GB/s of K and V read)",
    "padded": "Padded batch: key_padding_mask, lengths 25-100% of 4096 (TFLOP/s of the unpadded keys)",
    "layer": "The layer against nn.MultiheadAttention (ms per call)",
    "small": "The layer at the seed's small shapes (us per call)",
}


def hbm_peak_tbs(device_name: str) -> Optional[float]:
    for key, peak in HBM_PEAK_TBS.items():
        if key in device_name:
            return peak
    return None


def summarize(case: Case, measurements: Dict[str, "object"], peak_tbs: Optional[float] = None) -> dict:
    """One row: per column its time, figure and note; the fastest other column; attn_export's
    speed relative to it (best time / our time: under 1 means slower)."""
    columns = {impl: dict(seconds=m.seconds, value=None if m.seconds is None else rate(case, m.seconds), note=m.note)
               for impl, m in measurements.items()}
    others = {i: c["seconds"] for i, c in columns.items() if i != OURS and c["seconds"] is not None}
    best = min(others, key=others.get) if others else None
    ours = columns.get(OURS, {}).get("seconds")
    row = dict(group=case.group, label=case.label(), metric=case.metric, case=dataclasses.asdict(case),
               columns=columns, best=best, ours_vs_best=(others[best] / ours) if best and ours else None)
    if case.metric == "GB/s" and peak_tbs:
        row["hbm_peak_tbs"] = peak_tbs
        row["ours_of_peak"] = _of_peak(columns.get(OURS, {}).get("value"), peak_tbs)
        row["best_of_peak"] = _of_peak(columns[best]["value"], peak_tbs) if best else None
    return row


def _of_peak(gbs: Optional[float], peak_tbs: float) -> Optional[float]:
    return None if gbs is None else gbs / (peak_tbs * 1e3)


def cell(column: dict) -> str:
    value = column["value"]
    if value is None:
        return "n/a"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def group_table(group: str, rows) -> list:
    impls = list(rows[0]["columns"])
    decode = group == "decode"
    head = ["case", *impls, "best other", "attn_export / best"] + (["ours % HBM", "best % HBM"] if decode else [])
    out = [f"### {TITLES[group]}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for r in rows:
        pct = lambda x: "–" if x is None else f"{100 * x:.0f}%"  # noqa: E731
        cells = [r["label"], *(cell(r["columns"][i]) for i in impls), r["best"] or "–",
                 "–" if r["ours_vs_best"] is None else f"{r['ours_vs_best']:.2f}"]
        if decode:
            cells += [pct(r.get("ours_of_peak")), pct(r.get("best_of_peak"))]
        out.append("| " + " | ".join(cells) + " |")
        notes += [f"- {r['label']}, {i}: {c['note']}" for i, c in r["columns"].items() if c["note"]]
    return out + ([""] + notes if notes else []) + [""]


def markdown(env: dict, command: str, rows, skipped=()) -> str:
    out = ["# GPU benchmark", "", "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), "",
           f"Command: `{command}`", "",
           f"FLOPs as FlashAttention counts them: 4 B H Lq Lk D forward, halved when causal, {BACKWARD_FACTOR}x "
           "that for forward+backward. Decode: bytes of K and V read, 2 B Hkv Lk D x element size. Times: CUDA "
           "events, best of N blocks after warm-up. `attn_export / best`: the fastest other column's time over "
           "ours (under 1: ours is slower).", ""]
    for group in dict.fromkeys(r["group"] for r in rows):
        out += group_table(group, [r for r in rows if r["group"] == group])
    if skipped:
        out += [f"{len(skipped)} cases skipped (time budget): " + "; ".join(c.label() for c in skipped), ""]
    return "\n".join(out)
