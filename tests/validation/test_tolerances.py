"""The gate's comparison rule and tolerance, pinned rule by rule against docs/validation.md
("Tolerance rule"): the expected values below are written from the documentation (hand-picked
numbers that are exact in binary), never computed by attn_export. Each test is fast: no export,
no runtime. Mutation testing (docs/testing.md) is what these are sized against."""
import math

import pytest
import torch
from torch import nn

from attn_export.validation import TOLERANCE_FACTOR, compare, reduction_length, tolerance

INF, NAN = math.inf, math.nan
FP32_EPS = 2.0 ** -23  # torch.finfo(float32).eps, written out
FP16_EPS = 2.0 ** -10


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# The tolerance's size: rtol = 8 * eps(dtype) * sqrt(K)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, eps", [(torch.float32, FP32_EPS), (torch.float16, FP16_EPS),
                                        (torch.bfloat16, 2.0 ** -7)])
@pytest.mark.parametrize("k, sqrt_k", [(64, 8.0), (256, 16.0), (1, 1.0)])
def test_tolerance_is_the_documented_size(dtype, eps, k, sqrt_k):
    assert TOLERANCE_FACTOR == 8.0
    assert tolerance(dtype, k) == pytest.approx(8.0 * eps * sqrt_k, rel=1e-12)


@pytest.mark.parametrize("precision", ["tf32", "fp16"])
def test_a_coarser_compute_precision_widens_a_float32_tolerance(precision):
    # TF32 and float16 products keep 10 mantissa bits: eps 2^-10 (TensorRT's --tf32/--fp16
    # builds of a float32 model). A dtype coarser than the precision keeps its own eps.
    assert tolerance(torch.float32, 64, precision) == pytest.approx(8.0 * 2.0 ** -10 * 8.0, rel=1e-12)
    assert tolerance(torch.bfloat16, 64, precision) == pytest.approx(8.0 * 2.0 ** -7 * 8.0, rel=1e-12)


def test_tolerance_treats_an_empty_reduction_as_length_one():
    assert tolerance(torch.float32, 0) == pytest.approx(8.0 * FP32_EPS, rel=1e-12)


# --------------------------------------------------------------------------------------------
# compare: max|a - e| <= rtol * max|e| over the finite reference
# --------------------------------------------------------------------------------------------

def test_error_exactly_at_the_tolerance_passes_and_just_above_fails():
    ref = t(1.0, -2.0, 0.5)  # scale max|e| = 2, rtol 0.25: atol = 0.5 exactly
    at = compare(ref + t(0.0, 0.5, 0.0), ref, rtol=0.25)
    assert at["passed"] and at["message"] == ""
    assert at["max_abs_err"] == 0.5 and at["atol"] == 0.5 and at["max_rel_err"] == 0.25
    above = compare(ref + t(0.0, 0.0, 0.5 + 2 ** -20), ref, rtol=0.25)
    assert not above["passed"] and above["message"].startswith("max abs err 5.000e-01 > atol 5.000e-01")


@pytest.mark.parametrize("ratio, passes", [(0.5, True), (0.99, True), (1.01, False), (2.0, False)])
def test_a_perturbation_passes_below_the_tolerance_and_fails_above_it(ratio, passes):
    torch.manual_seed(0)
    ref = torch.randn(4, 8, dtype=torch.float64)
    rtol = 8.0 * FP32_EPS * math.sqrt(64)
    atol = rtol * float(ref.abs().max())
    got = ref.clone()
    got[1, 3] -= ratio * atol  # one element off, the rest exact
    result = compare(got, ref, rtol)
    assert result["passed"] is passes
    assert result["max_abs_err"] == pytest.approx(ratio * atol, rel=1e-9)
    assert result["max_rel_err"] == pytest.approx(ratio * rtol, rel=1e-9)


def test_the_scale_is_the_largest_finite_reference_magnitude():
    # -4 is the largest magnitude (not the largest value); NaN and inf are left out of the scale.
    ref = t(1.0, -4.0, NAN, INF)
    got = t(2.0, -4.0, 7.0, INF)
    r = compare(got, ref, rtol=0.25)  # atol = 0.25 * 4 = 1.0: the error 1.0 passes
    assert r["passed"] and r["atol"] == 1.0 and r["max_abs_err"] == 1.0 and r["max_rel_err"] == 0.25
    assert not compare(got, ref, rtol=0.24)["passed"]


def test_a_reference_smaller_than_one_sets_the_scale_too():
    r = compare(t(0.75, 0.0), t(0.5, 0.0), rtol=0.25)  # scale 0.5: atol 0.125, relative error 0.5
    assert not r["passed"] and r["max_rel_err"] == 0.5 and r["atol"] == 0.125


def test_an_all_zero_reference_accepts_only_zeros():
    zeros = torch.zeros(3, dtype=torch.float64)
    exact = compare(zeros.clone(), zeros, rtol=1.0)
    assert exact["passed"] and exact["max_rel_err"] == 0.0 and exact["max_abs_err"] == 0.0
    # atol = rtol * float32's smallest normal: any visible error fails, and is infinitely relative.
    off = compare(t(0.0, 1e-30, 0.0), zeros, rtol=1.0)
    assert not off["passed"] and off["max_rel_err"] == INF
    assert off["atol"] == pytest.approx(torch.finfo(torch.float32).tiny)


def test_one_float32_ulp_counts():
    ref = torch.tensor([1.0, 3.0], dtype=torch.float32)
    got = torch.tensor([1.0, 3.0 + 2 ** -22], dtype=torch.float32)
    r = compare(got, ref, rtol=2 ** -24)  # atol 3 * 2**-24 < the one-ulp error 2**-22
    assert not r["passed"] and r["max_abs_err"] == 2 ** -22


# --------------------------------------------------------------------------------------------
# compare: NaN and infinities
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expected, actual, passes", [
    # A NaN or an infinity where the reference is finite fails...
    (1.0, NAN, False),
    (1.0, INF, False),
    (1.0, -INF, False),
    # ...a finite value or the other infinity where the reference is infinite fails...
    (-INF, 0.0, False),
    (-INF, -1e300, False),
    (INF, 1e300, False),
    (-INF, INF, False),
    (INF, -INF, False),
    (-INF, NAN, False),
    # ...the same infinity passes...
    (INF, INF, True),
    (-INF, -INF, True),
    # ...and where the reference is NaN anything goes (nn.MultiheadAttention's fully masked rows).
    (NAN, 0.0, True),
    (NAN, NAN, True),
    (NAN, -INF, True),
])
def test_nan_and_infinity_rules(expected, actual, passes):
    ref = t(2.0, expected, -1.0)
    got = t(2.0, actual, -1.0)
    r = compare(got, ref, rtol=1e-6)
    assert r["passed"] is passes, r
    assert r["nan_mismatch"] == (0 if passes else 1)
    # Non-finite positions never enter the error: the finite ones are exact here.
    assert r["max_abs_err"] == 0.0


def test_the_messages_count_each_kind_of_mismatch():
    ref = t(1.0, 1.0, 1.0, -INF, INF, -INF, 0.0)
    got = t(NAN, INF, 1.0, 3.0, -INF, -INF, 0.5)
    r = compare(got, ref, rtol=0.1)
    assert not r["passed"] and r["nan_mismatch"] == 4
    assert r["message"] == ("2 NaN/inf where the reference is finite; 2 infinities differ; "
                            "max abs err 5.000e-01 > atol 1.000e-01")


def test_a_reference_with_no_finite_value_compares_the_infinities_only():
    assert compare(t(INF, 5.0), t(INF, NAN), rtol=0.0)["passed"]
    r = compare(t(NAN, NAN), t(NAN, NAN), rtol=0.5)
    assert r["passed"] and r["max_abs_err"] == 0.0 and r["max_rel_err"] == 0.0
    assert r["atol"] == pytest.approx(0.5 * torch.finfo(torch.float32).tiny)  # scale 0, not 1


# --------------------------------------------------------------------------------------------
# compare: shapes, non-float outputs, valid positions
# --------------------------------------------------------------------------------------------

def test_a_shape_mismatch_fails_with_both_shapes():
    r = compare(torch.zeros(2, 3), torch.zeros(3, 2), rtol=1.0)
    assert r["passed"] is False and r["message"] == "shape [2, 3] != reference [3, 2]"
    assert r["max_abs_err"] is None and r["max_rel_err"] is None and r["atol"] is None and r["nan_mismatch"] == 0


def test_integer_and_boolean_outputs_must_match_exactly():
    same = compare(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3]), rtol=1.0)
    assert same["passed"] and same["message"] == "" and same["max_abs_err"] == 0.0 and same["atol"] == 0.0
    assert same["nan_mismatch"] == 0 and same["max_rel_err"] == 0.0
    differ = compare(torch.tensor([1, 5, 3, 0]), torch.tensor([1, 2, 3, 4]), rtol=1.0)
    assert not differ["passed"] and differ["message"] == "2 element(s) differ" and differ["max_abs_err"] == 2.0
    # float actual against an integer reference: cast to the reference's dtype first
    assert compare(torch.tensor([1.0, 2.0]), torch.tensor([1, 2]), rtol=0.0)["passed"]
    flags = compare(torch.tensor([True, False]), torch.tensor([True, True]), rtol=1.0)
    assert not flags["passed"] and flags["max_rel_err"] == 1.0


def test_valid_positions_restrict_every_rule():
    ref = t(1.0, 2.0, 100.0, 4.0)
    got = t(1.0, 2.0, NAN, 4.75)
    valid = torch.tensor([True, True, False, True])
    r = compare(got, ref, rtol=0.125, valid=valid)  # scale 4 (the masked 100 is not compared)
    assert not r["passed"] and r["atol"] == 0.5 and r["max_abs_err"] == 0.75 and r["nan_mismatch"] == 0
    assert compare(got, ref, rtol=0.125, valid=torch.tensor([True, True, False, False]))["passed"]
    assert not compare(got, ref, rtol=1.0)["passed"]  # without the mask the NaN counts


# --------------------------------------------------------------------------------------------
# K: the longest reduction
# --------------------------------------------------------------------------------------------

class Conv1D(nn.Module):
    """transformers' GPT-2 Conv1D, recognised by name: weight [in, out]."""

    def __init__(self, nx=None, nf=None):
        super().__init__()
        if nx is not None:  # else no weight at all (not counted, not an error)
            self.weight = nn.Parameter(torch.zeros(nx, nf))


class WithEmbedDim(nn.Module):
    """An attention layer known only by its integer ``embed_dim`` (no Linear inside)."""

    def __init__(self, embed_dim):
        super().__init__()
        self.embed_dim = embed_dim


@pytest.mark.parametrize("build, k", [
    (lambda: nn.Sequential(nn.Linear(24, 4), nn.Linear(4, 2)), 24),
    (lambda: nn.Sequential(WithEmbedDim(40), WithEmbedDim("40")), 40),
    (lambda: nn.Sequential(nn.LayerNorm([3, 11])), 33),
    (lambda: nn.Sequential(Conv1D(28, 5), Conv1D()), 28),
    (lambda: nn.Sequential(nn.ReLU()), 1),
])
def test_reduction_length_is_the_widest_contraction(build, k):
    assert reduction_length(build(), {}, {}) == k


def test_reduction_length_counts_sequence_axes_not_batch_axes():
    model = nn.Linear(8, 8)
    inputs = {"x": torch.zeros(300, 50, 8), "y": torch.zeros(2, 70)}
    axes = {"x": {0: "batch", 1: "seq"}, "y": {1: "y_seq"}, "absent": {0: "other"}}
    assert reduction_length(model, inputs, axes) == 70
    assert reduction_length(model, inputs, {"x": {0: "batch", 1: "seq"}}) == 50
    assert reduction_length(model, inputs, {"x": {0: "Batch_size"}}) == 8
