"""The validation report: one result per (case, backend, output) and per graph check, rendered
as a rich table, Polygraphy-style PASSED/FAILED lines, JSON and JUnit XML."""
from __future__ import annotations

import json
import math
import platform
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import numpy as np
import torch


@dataclass
class CaseResult:
    case: str
    backend: str
    output: str
    shapes: Dict[str, List[int]]
    status: str  # passed | failed | error | skipped
    passed: bool
    max_abs_err: Optional[float] = None
    max_rel_err: Optional[float] = None
    atol: Optional[float] = None
    rtol: Optional[float] = None
    nan_mismatch: int = 0
    baseline_err: Optional[float] = None  # same-dtype PyTorch original vs fp32 reference (fp16/bf16)
    message: str = ""
    seconds: float = 0.0
    crash: Optional[Dict[str, object]] = None  # isolation.CrashInfo when the runtime's process died or hung
    # error_profile.error_profile: the histogram of |actual - expected| / atol and the worst elements
    errors: Optional[Dict[str, object]] = None


@dataclass
class CheckResult:
    name: str
    passed: bool
    message: str


@dataclass
class ValidationReport:
    cases: List[CaseResult]
    checks: List[CheckResult]
    dtype: str
    tolerance: Dict[str, object]
    environment: Dict[str, object]
    onnx_path: str
    input_names: List[str]
    output_names: List[str]
    notes: List[str] = field(default_factory=list)
    # When a runtime crashed: which optimization levels load and run the model (see validate).
    diagnosis: Dict[str, object] = field(default_factory=dict)
    # ReplacementReport.to_dict() of the replaced PyTorch copy: which layers were fused, and why not
    coverage: Dict[str, object] = field(default_factory=dict)
    # Which attention flavor the file uses (--onnx-attention; attn_export.onnx.attention_flavor),
    # read from the file when not given.
    attention_flavor: Optional[Dict[str, object]] = None
    # A cached export's generation gate (GenerationResult.to_dict(); validation/generation.py):
    # the tokens and the first diverging step; its prefill and step errors are the cases.
    generation: Dict[str, object] = field(default_factory=dict)

    def __post_init__(self):
        if self.attention_flavor is None:
            import onnx

            from attn_export.onnx import attention_flavor

            try:
                self.attention_flavor = attention_flavor(onnx.load(self.onnx_path, load_external_data=False))
            except Exception:  # noqa: BLE001 - an unreadable file is reported by the checks
                self.attention_flavor = {"flavor": "unknown", "text": "unknown: the file could not be read"}

    @property
    def passed(self) -> bool:
        ran = [c for c in self.cases if c.status != "skipped"]
        return bool(ran) and all(c.passed for c in ran) and all(c.passed for c in self.checks)

    @property
    def failures(self) -> List[str]:
        out = [f"check {c.name}: {c.message}" for c in self.checks if not c.passed]
        for c in self.cases:
            if c.status in ("failed", "error"):
                out.append(f"{c.case} / {c.backend} / {c.output}: {c.message}")
        if not any(c.status != "skipped" for c in self.cases):
            out.append("no case ran")
        return out

    def to_dict(self) -> Dict:
        return _finite_json({
            "passed": self.passed,
            "onnx": self.onnx_path,
            "attention_flavor": self.attention_flavor,
            "dtype": self.dtype,
            "inputs": self.input_names,
            "outputs": self.output_names,
            "tolerance": self.tolerance,
            "checks": [asdict(c) for c in self.checks],
            "cases": [asdict(c) for c in self.cases],
            "failures": self.failures,
            "notes": self.notes,
            "diagnosis": self.diagnosis,
            "environment": self.environment,
            **({"generation": self.generation} if self.generation else {}),
        })

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False, default=_json_default) + "\n"

    def to_junit_xml(self) -> str:
        suite = ET.Element("testsuite", name="attn-export validate")
        props = ET.SubElement(suite, "properties")
        for key, value in self.environment.items():
            ET.SubElement(props, "property", name=str(key), value=str(value))
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        for check in self.checks:
            counts["tests"] += 1
            tc = ET.SubElement(suite, "testcase", classname="attn_export.validate.checks", name=check.name, time="0")
            if not check.passed:
                counts["failures"] += 1
                ET.SubElement(tc, "failure", message=check.message).text = check.message
        for case in self.cases:
            counts["tests"] += 1
            tc = ET.SubElement(
                suite, "testcase", classname=f"attn_export.validate.{case.backend}",
                name=f"{case.case}/{case.output}", time=f"{case.seconds:.3f}",
            )
            detail = (
                f"shapes={json.dumps(case.shapes)} max_abs_err={case.max_abs_err} max_rel_err={case.max_rel_err} "
                f"atol={case.atol} rtol={case.rtol} nan_mismatch={case.nan_mismatch}"
            )
            if case.status == "failed":
                counts["failures"] += 1
                ET.SubElement(tc, "failure", message=case.message).text = detail
            elif case.status == "error":
                counts["errors"] += 1
                ET.SubElement(tc, "error", message=case.message).text = detail
            elif case.status == "skipped":
                counts["skipped"] += 1
                ET.SubElement(tc, "skipped", message=case.message)
            else:
                ET.SubElement(tc, "system-out").text = detail
        for key, value in counts.items():
            suite.set(key, str(value))
        root = ET.Element("testsuites")
        root.append(suite)
        ET.indent(root)
        return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"

    def to_html(self) -> str:
        """One self-contained HTML page (plots embedded, nothing fetched): the verdict, the
        environment, the cases, the error distribution of every output, the coverage; needs
        matplotlib (attn_export.validation.html)."""
        from attn_export.validation.html import render

        return render(self)

    def table(self):
        from rich.table import Table

        verdict = "[green]PASSED[/]" if self.passed else "[red]FAILED[/]"
        table = Table(title=f"Parity vs the original PyTorch model ({self.dtype}; attention "
                            f"{self.attention_flavor['text']}): {verdict}")
        for col in ("case", "input shapes", "backend", "output", "max abs err", "max rel err", "rtol", "result"):
            table.add_column(col, justify="right" if col.startswith(("max", "rtol")) else "left")
        style = {"passed": "green", "failed": "red", "error": "red", "skipped": "yellow"}
        for c in self.cases:
            shapes = " ".join(f"{n}={'x'.join(map(str, s))}" for n, s in c.shapes.items())
            result = f"[{style[c.status]}]{c.status.upper()}[/]"
            if c.status != "passed" and c.message:
                result += f" {c.message}"
            table.add_row(c.case, shapes, c.backend, c.output, _fmt(c.max_abs_err), _fmt(c.max_rel_err),
                          _fmt(c.rtol), result)
        return table

    def lines(self) -> List[str]:
        """Polygraphy-style one line per check and per case."""
        out = [f"INFO | attention flavor | {self.attention_flavor['text']}"]
        for c in self.checks:
            out.append(f"{'PASSED' if c.passed else 'FAILED'} | check {c.name} | {c.message}")
        for c in self.cases:
            out.append(
                f"{c.status.upper()} | {c.case} | {c.backend} | {c.output} | max_abs_err={_fmt(c.max_abs_err)} "
                f"max_rel_err={_fmt(c.max_rel_err)} rtol={_fmt(c.rtol)} atol={_fmt(c.atol)}"
                + (f" | {c.message}" if c.message else "")
            )
        return out


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else (f"{x:.2e}" if math.isfinite(x) else str(x))


def _finite_json(obj):
    """JSON has no inf/NaN: such floats become the strings "inf", "-inf", "nan"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_json(v) for v in obj]
    return obj


def _json_default(obj):
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    return str(obj)


def environment(seed: int, providers: Optional[List[str]] = None,
                onnxruntime_version: Optional[str] = None) -> Dict[str, object]:
    """Versions and machine facts for the report: what a reader needs to rerun the check.
    ``onnxruntime_version`` as the gate's runtime process reported it (else imported here)."""
    import onnx

    if onnxruntime_version is None:
        import onnxruntime

        onnxruntime_version = onnxruntime.__version__

    from attn_export._version import __version__

    try:
        import onnxscript

        onnxscript_version = onnxscript.__version__
    except Exception:  # noqa: BLE001
        onnxscript_version = None
    return {
        "attn_export": __version__,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime_version,
        "onnxscript": onnxscript_version,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "onnxruntime_providers": providers or ["CPUExecutionProvider"],
        "seed": seed,
    }
