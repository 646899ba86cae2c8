"""The validation report as one self-contained HTML page (``ValidationReport.to_html()``,
``attn-export validate --html``): the verdict first, then the failures, the environment, the
checks, the cases, per output a plot of the error distributions (one panel per backend, one
line per shape case) with the worst elements, and the coverage of the replaced model. Plots are
embedded as ``data:`` URIs; the page loads nothing from the network."""
from __future__ import annotations

import html
from typing import Dict, Iterable, List, Sequence

from attn_export.maps.plotting import png_data_uri, require_matplotlib

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; }
.verdict { font-size: 1.6em; font-weight: bold; padding: .5em .8em; border-radius: 6px; color: #fff; }
.verdict.passed { background: #2e7d32; } .verdict.failed { background: #c62828; }
table { border-collapse: collapse; margin: .5em 0 1.2em; font-size: 12px; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; } td.num { text-align: right; font-family: monospace; }
tr.failed td, tr.error td { background: #fde0e0; } tr.skipped td { background: #fff6d5; }
.status-passed { color: #2e7d32; font-weight: bold; } .status-failed, .status-error { color: #c62828; font-weight: bold; }
.side { display: flex; gap: 2em; align-items: flex-start; } .side > div { max-width: 48%; }
.status-skipped { color: #9a7000; } img { max-width: 100%; } code { font-size: 12px; }
"""


def _e(value) -> str:
    return html.escape(str(value))


def _num(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3e}" if isinstance(value, float) else _e(value)


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], row_classes: Iterable[str] = ()) -> str:
    """Cells are HTML already (escape before)."""
    classes = list(row_classes)
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        f"<tr{f' class={chr(34)}{classes[i]}{chr(34)}' if i < len(classes) and classes[i] else ''}>"
        + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>"
        for i, row in enumerate(rows)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _shapes(shapes: Dict[str, List[int]]) -> str:
    return " ".join(f"{n}={'x'.join(map(str, s))}" for n, s in shapes.items())


def _status(status: str) -> str:
    return f'<span class="status-{_e(status)}">{_e(status.upper())}</span>'


def _error_plot(plt, output: str, cases) -> str:
    """One panel per backend: the fraction of elements per decade of |actual - expected| / atol,
    one line per shape case; the red line is the tolerance (right of it fails)."""
    backends = list(dict.fromkeys(c.backend for c in cases))
    fig, axes = plt.subplots(1, len(backends), figsize=(4.2 * len(backends), 3.0), squeeze=False,
                             layout="constrained")
    for ax, backend in zip(axes[0], backends):
        for c in (c for c in cases if c.backend == backend):
            counts = c.errors["counts"]
            total = max(sum(counts), 1)
            centers = list(range(len(counts)))
            ax.step(centers, [n / total for n in counts], where="mid", label=f"{c.case} ({_shapes(c.shapes)})"[:48],
                    linewidth=2.2 if c.status == "failed" else 1.2)
        edges = cases[0].errors["log10_edges"]
        labels = ["exact/<1e-8"] + [f"1e{int(edges[i])}" for i in range(1, len(edges) - 2)] + [">1e3"]
        ax.set_xticks(range(len(labels)), labels, rotation=60, fontsize=6)
        # Bins are decades [1e(k), 1e(k+1)); ratio 1 (the tolerance) is the left edge of bin "1e0".
        ax.axvline(labels.index("1e0") - 0.5, color="red", linestyle="--", linewidth=1)
        ax.set_xlabel("|actual - expected| / atol", fontsize=7)
        ax.set_ylabel("fraction of elements", fontsize=7)
        ax.set_title(f"{output}: {backend}", fontsize=8)
        ax.tick_params(axis="y", labelsize=6)
        ax.legend(fontsize=5)
    return png_data_uri(fig)


def _worst_rows(cases) -> List[List[str]]:
    rows = []
    for c in cases:
        for w in c.errors["worst"]:
            rows.append([_e(c.case), _e(c.backend), _e(w["index"]), _num(w["actual"]), _num(w["expected"]),
                         f'<span class="{"status-failed" if w["ratio"] > 1 else ""}">{_num(w["ratio"])}</span>'])
    return rows


def _outputs_section(plt, report) -> str:
    parts = []
    for output in report.output_names:
        cases = [c for c in report.cases if c.output == output and c.errors]
        if not cases:
            continue
        failed = [c for c in cases if c.status == "failed"]
        parts.append(f"<h3>output <code>{_e(output)}</code>"
                     + (f' <span class="status-failed">FAILED in {len(failed)} case(s)</span>' if failed else "")
                     + "</h3>")
        parts.append(f'<img alt="error distribution of {_e(output)}" src="{_error_plot(plt, output, cases)}">')
        headers = ("case", "backend", "index", "actual", "expected", "|actual - expected| / atol")
        if failed:
            parts.append("<p>Worst elements of the failing cases:</p>" + _table(headers, _worst_rows(failed)))
        passed = [c for c in cases if c.status != "failed"]
        if passed:
            parts.append("<details><summary>worst elements of the passing cases</summary>"
                         + _table(headers, _worst_rows(passed)) + "</details>")
    return "<h2>Error distributions</h2>" + ("".join(parts) or "<p>no output was compared</p>")


def _coverage_section(coverage: Dict[str, object]) -> str:
    if not coverage:
        return ""
    layers = coverage.get("layers", [])
    rows = [[f"<code>{_e(l['path'])}</code>", _e(l["cls"]), _e(l["found"]), _e(l["status"]),
             _e("; ".join(([l["reason"]] if l.get("reason") else []) + list(l.get("notes", []))))] for l in layers]
    summary = (f"{coverage.get('num_replaced', 0)} of {coverage.get('num_found', 0)} attention layer(s) fused, "
               f"{coverage.get('num_skipped', 0)} left as they are")
    return (f"<h2>Coverage</h2><p>{_e(summary)}</p>"
            + _table(("module path", "class", "found", "status", "reason / notes"), rows,
                     ["skipped" if l["status"] == "skipped" else "" for l in layers])
            + "".join(f"<p>note: {_e(n)}</p>" for n in coverage.get("notes", [])))


def _generation_section(generation: Dict[str, object]) -> str:
    """A cached export's tokens: the reference's and each backend's greedy choice per prompt, the
    first diverging step marked (the per-step errors are the cases' rows)."""
    if not generation:
        return ""
    reference = generation["reference_tokens"]
    rows, classes = [], []
    for run in generation["runs"]:
        for row, tokens in enumerate(run["tokens"]):
            same = tokens == reference[row]
            rows.append([_e(run["backend"]), _e(row), _e(generation["prompt_lengths"][row]),
                         _e(" ".join(map(str, reference[row]))), _e(" ".join(map(str, tokens))),
                         _status("passed" if same else "failed")])
            classes.append("" if same else "failed")
        if run["first_divergence"] is not None:
            where = f"first diverging step {run['first_divergence']}: {run['divergence']}"
            rows.append([_e(run["backend"]), "", "", "", _e(where), ""])
            classes.append("failed")
    return (f"<h2>Generation</h2><p>{_e(generation['new_tokens'])} greedy tokens per prompt; each step's logits are a "
            f"case below (rtol {_num(generation['rtol'])}).</p>"
            + _table(("backend", "prompt", "prompt length", "reference tokens", "backend tokens", "result"),
                     rows, classes))


def render(report) -> str:
    """The page for a ValidationReport (MissingPlotting when matplotlib is absent)."""
    plt = require_matplotlib("the HTML report")
    verdict = "passed" if report.passed else "failed"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>attn-export validate: {verdict.upper()} ({_e(report.onnx_path)})</title>",
        f"<style>{_STYLE}</style></head><body>",
        f'<div class="verdict {verdict}" id="verdict">{verdict.upper()}: {_e(report.onnx_path)} against the '
        f"original PyTorch model ({_e(report.dtype)})</div>",
    ]
    if report.failures:
        parts.append("<h2>Failures</h2><ul>" + "".join(f"<li>{_e(f)}</li>" for f in report.failures) + "</ul>")
    if report.notes:
        parts.append("<ul>" + "".join(f"<li>note: {_e(n)}</li>" for n in report.notes) + "</ul>")
    parts.append('<div class="side">'
                 + "<div><h2>Environment</h2>"
                 + _table(("", "value"), [[_e(k), _e(v)] for k, v in report.environment.items()]) + "</div>"
                 + "<div><h2>Tolerance</h2>"
                 + _table(("", "value"), [[_e(k), _e(v)] for k, v in report.tolerance.items()]) + "</div></div>")
    parts.append("<h2>Checks</h2>" + _table(
        ("check", "result", "message"),
        [[_e(c.name), _status("passed" if c.passed else "failed"), _e(c.message)] for c in report.checks],
        ["" if c.passed else "failed" for c in report.checks]))
    parts.append(_generation_section(report.generation))
    parts.append("<h2>Cases</h2>" + _table(
        ("case", "input shapes", "backend", "output", "max abs err", "max rel err", "atol", "rtol", "result",
         "message"),
        [[_e(c.case), _e(_shapes(c.shapes)), _e(c.backend), _e(c.output), _num(c.max_abs_err), _num(c.max_rel_err),
          _num(c.atol), _num(c.rtol), _status(c.status), _e(c.message)] for c in report.cases],
        [c.status for c in report.cases]))
    parts.append(_outputs_section(plt, report))
    parts.append(_coverage_section(report.coverage))
    parts.append("</body></html>\n")
    return "\n".join(parts)
