"""What the generation gate found (validation/generation.py): per backend the prefill's error,
each step's error and the tokens, as data, and as the rows and checks of a ValidationReport."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from attn_export.validation.report import CaseResult, CheckResult

# The case names of the report's rows.
PREFILL_CASE = "generate/prefill"


def step_case(step: int) -> str:
    return f"generate/step {step}"


@dataclass
class Comparison:
    """One comparison of logits (tolerances.compare's fields)."""

    passed: bool
    max_abs_err: Optional[float]
    max_rel_err: Optional[float]
    atol: Optional[float]
    message: str = ""
    shape: List[int] = field(default_factory=list)

    @classmethod
    def of(cls, compared: Dict[str, object], shape) -> "Comparison":
        return cls(passed=bool(compared["passed"]), max_abs_err=compared["max_abs_err"],
                   max_rel_err=compared["max_rel_err"], atol=compared["atol"], message=str(compared["message"]),
                   shape=list(shape))


@dataclass
class BackendGeneration:
    """One backend's generation. Step k's logits choose new token k (step 0: the prefill's last
    position). ``tokens``: the backend's greedy choice at every step, fed the reference's tokens
    before it, so up to the first divergence they are what it generates on its own; after it
    the steps still measure the logits' error on the reference's path."""

    backend: str
    prefill: Optional[Comparison] = None
    steps: List[Comparison] = field(default_factory=list)
    tokens: List[List[int]] = field(default_factory=list)
    first_divergence: Optional[int] = None  # the first step whose token differs from the reference's
    divergence: str = ""  # which rows, which tokens, the reference's margin there
    error: str = ""  # the runtime could not load or run the model
    # A quantized file (--quantize): steps where a row picked another token whose reference logit is
    # within 2 * atol of the reference's top (a near tie the tolerance allows), not divergences.
    near_ties: List[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (not self.error and self.prefill is not None and self.prefill.passed and bool(self.steps)
                and all(s.passed for s in self.steps) and self.first_divergence is None)


@dataclass
class GenerationResult:
    """The reference's greedy tokens and every backend's run against them."""

    new_tokens: int
    prompt_lengths: List[int]
    dtype: str
    rtol: float
    reduction_length: int
    reference_tokens: List[List[int]]
    runs: List[BackendGeneration] = field(default_factory=list)
    runtime_version: Optional[str] = None  # ONNX Runtime's, as its process reported it
    reference: str = "original PyTorch model, float32, generate(do_sample=False)"  # what the backends are judged against

    @property
    def passed(self) -> bool:
        return bool(self.runs) and all(run.passed for run in self.runs)

    @property
    def failures(self) -> List[str]:
        out = []
        for run in self.runs:
            if run.error:
                out.append(f"generate / {run.backend}: {run.error}")
                continue
            if run.first_divergence is not None:
                out.append(f"generate / {run.backend}: tokens differ from step {run.first_divergence}: "
                           f"{run.divergence}")
            for name, comparison in _named(run):
                if not comparison.passed:
                    out.append(f"{name} / {run.backend} / logits: {comparison.message}")
        return out

    def to_dict(self) -> Dict[str, object]:
        return {"passed": self.passed, **asdict(self)}

    def add_to(self, report) -> None:
        """Puts this generation into a ValidationReport of the same file (e.g. the parity gate's
        report of a cached export): its rows, its token checks and its ``generation`` section."""
        report.cases.extend(self.case_results())
        report.checks.extend(self.checks())
        report.generation = self.to_dict()

    def case_results(self) -> List[CaseResult]:
        """The report's rows: the prefill and each step per backend (output ``logits``)."""
        rows = []
        for run in self.runs:
            if run.error:
                rows.append(CaseResult(PREFILL_CASE, run.backend, "logits", {}, "error", False, message=run.error))
                continue
            for name, c in _named(run):
                status = "passed" if c.passed else "failed"
                rows.append(CaseResult(name, run.backend, "logits", {"logits": c.shape}, status, c.passed,
                                       max_abs_err=c.max_abs_err, max_rel_err=c.max_rel_err, atol=c.atol,
                                       rtol=self.rtol, message=c.message))
        return rows

    def checks(self) -> List[CheckResult]:
        """One check per backend: the same greedy tokens as the reference."""
        out = []
        for run in self.runs:
            if run.error:
                continue
            same = run.first_divergence is None
            out.append(CheckResult(
                f"generated tokens ({run.backend})", same,
                f"{self.new_tokens} greedy tokens for {len(self.prompt_lengths)} left-padded prompts of lengths "
                f"{self.prompt_lengths}: " + ("identical to PyTorch's generate()" if same else
                                               f"differ from step {run.first_divergence}: {run.divergence}")
                + ("; near ties the tolerance allows: " + "; ".join(run.near_ties) if run.near_ties else "")))
        return out


def _named(run: BackendGeneration):
    if run.prefill is not None:
        yield PREFILL_CASE, run.prefill
    for k, comparison in enumerate(run.steps):
        yield step_case(k), comparison
